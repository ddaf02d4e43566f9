"""The policy learner: a DeepSpeed engine inside a Ray actor (one actor per data-parallel rank).

A step is one call, `train_step(batch)`: recompute old log-probs and entropies (verl style),
then the PPO mini-batch updates with the configured loss from `stapoctl.losses`. π and H for
the STAPO mask come from this learner's forward pass over the mini-batch (000 Alg. 1 line 8):
for the first mini-batch of a step the recompute pass *is* that pass (same weights); later
mini-batches get a no-grad pass first when they span several micro-batches, and reuse the
gradient pass's own detached values when they are a single micro-batch.

On CPU: DeepSpeed's CPU accelerator, gloo, torch AdamW (no FusedAdam/CPUAdam JIT build);
ZeRO stages 0-3 all run. With one rank the shared-memory allreduce op (a ~56 s JIT build)
is skipped: it only speeds up multi-rank CPU allreduce.
"""

from __future__ import annotations

import math
import os
import socket
import time
from contextlib import nullcontext
from typing import Any, Optional, Sequence

from stapoctl.errors import UserError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


def ds_config(learner: dict, *, micro_batch_size: int, grad_accum: int, world_size: int, bf16: bool) -> dict:
    """DeepSpeed JSON config; the loss is already normalised per mini-batch (see `_backward`)."""
    zero: dict[str, Any] = {"stage": int(learner["zero_stage"])}
    if learner.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
        "gradient_accumulation_steps": int(grad_accum),
        "train_batch_size": int(micro_batch_size * grad_accum * world_size),
        "gradient_clipping": float(learner["grad_clip"]),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bool(bf16)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def plan_micro_batches(rows: int, micro: int) -> list[slice]:
    return [slice(s, min(s + micro, rows)) for s in range(0, rows, micro)]


class Learner:
    """One data-parallel rank. `setup` (not `__init__`) starts DeepSpeed, so the driver can
    hand every rank the rendezvous address of rank 0 first."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = int(rank), int(world_size)
        self.engine = None
        self.transfer = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port on its node (torch.distributed's MASTER_*)."""
        return node_ip(), free_port()

    # -- start-up --------------------------------------------------------------------------
    def setup(
        self,
        model_path: str,
        learner: dict,
        loss: dict,
        *,
        n_per_prompt: int,
        temperature: float = 1.0,
        dtype: str = "float32",
        seed: int = 0,
        max_response_length: Optional[int] = None,
        master_addr: str = "127.0.0.1",
        master_port: Optional[int] = None,
    ) -> dict:
        t0 = time.perf_counter()
        import torch

        use_cuda = torch.cuda.is_available() and int(learner.get("num_gpus") or 0) > 0
        if not use_cuda:
            os.environ["DS_ACCELERATOR"] = "cpu"
            torch.set_num_threads(max(1, int(math.floor(float(learner.get("cpus") or 1)))))
        os.environ.update(
            RANK=str(self.rank),
            LOCAL_RANK="0" if not use_cuda else os.environ.get("LOCAL_RANK", "0"),
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port or free_port()),
        )
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", _extensions_dir())
        import deepspeed
        from transformers import AutoModelForCausalLM

        if not use_cuda and self.world_size == 1:
            import sys

            import deepspeed.comm  # noqa: F401  (loads the submodule patched below)

            # `deepspeed.comm.torch` as an attribute is torch itself; patch the submodule.
            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # one rank: no allreduce
        deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo")
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

        self.learner = dict(learner)
        self.loss_cfg = dict(loss)
        self.loss_name = self.loss_cfg["name"]
        self.n = int(n_per_prompt)
        self.temperature = float(temperature)
        self.max_response_length = max_response_length
        self.zero_stage = int(learner["zero_stage"])
        bf16 = dtype in ("bfloat16", "bf16")
        torch.manual_seed(seed + self.rank)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.bfloat16 if bf16 else torch.float32
        )
        if learner.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        self.micro = int(learner["micro_batch_size"])
        mini_rows = int(learner["ppo_mini_batch_size"]) * self.n
        if mini_rows % (self.world_size * self.micro) and mini_rows > self.micro * self.world_size:
            raise UserError(
                f"learner.ppo_mini_batch_size={learner['ppo_mini_batch_size']} × rollout.n={self.n} = "
                f"{mini_rows} sequences is not a multiple of learner.micro_batch_size={self.micro} × "
                f"{self.world_size} ranks: change one of them"
            )
        self.mini_rows = mini_rows
        grad_accum = max(1, mini_rows // (self.micro * self.world_size))
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=float(learner["lr"]),
            betas=tuple(float(b) for b in learner["betas"]),
            weight_decay=float(learner["weight_decay"]),
            eps=float(learner.get("adam_eps", 1e-8)),
        )
        warmup = int(learner["warmup_steps"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0
        )
        config = ds_config(learner, micro_batch_size=self.micro, grad_accum=grad_accum,
                           world_size=self.world_size, bf16=bf16)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        self.grad_accum = grad_accum
        self.optimizer_steps = 0
        return {"setup_s": time.perf_counter() - t0, "rank": self.rank, "zero_stage": self.zero_stage,
                "params": sum(p.numel() for p in model.parameters()) if self.zero_stage < 3 else -1}

    @property
    def module(self):
        return self.engine.module

    # -- forward ---------------------------------------------------------------------------
    def _token_stats(self, mb):
        """(entropy, log_prob, sum_p2) [n, R] of the response tokens; log_prob carries grads."""
        import torch

        from stapoctl.losses import token_stats

        input_ids = mb.input_ids().to(self.device)
        attn = mb.attention_mask().to(self.device)
        pos = mb.position_ids().to(self.device)
        p, r = mb.prompt_length, mb.response_length
        labels = torch.where(mb.response_mask, mb.response_ids, -100).to(self.device)
        chunk = int(self.learner.get("logits_chunk_size") or 1024)
        if self.zero_stage == 3:
            # Partitioned weights: go through the module (its hooks gather the shards).
            logits = self.engine(input_ids=input_ids, attention_mask=attn, position_ids=pos).logits
            return token_stats(logits[:, p - 1 : p + r - 1], labels, chunk_size=chunk,
                               temperature=self.temperature, return_sum_p2=True)
        hidden = self.module.get_decoder()(input_ids=input_ids, attention_mask=attn, position_ids=pos)
        hidden = hidden.last_hidden_state[:, p - 1 : p + r - 1]
        return token_stats(hidden, labels, lm_head_weight=self.module.get_output_embeddings().weight,
                           chunk_size=chunk, temperature=self.temperature, return_sum_p2=True)

    def _no_grad_pass(self, batch, rows: slice):
        """Entropy, log-prob and sum p² of batch[rows], micro-batch by micro-batch, no grad."""
        import torch

        ents, lps, p2s = [], [], []
        sub = batch.select(rows)
        self.module.eval()  # no dropout in a measurement (Qwen3 has none; other models may)
        try:
            with torch.no_grad():
                for sl in plan_micro_batches(len(sub), self.micro):
                    ent, lp, p2 = self._token_stats(sub.select(sl))
                    ents.append(ent.float().cpu()), lps.append(lp.float().cpu()), p2s.append(p2.float().cpu())
        finally:
            self.module.train()
        return torch.cat(ents), torch.cat(lps), torch.cat(p2s)

    def compute_log_probs(self, batch) -> dict:
        """Learner log-probs and entropies of every response token (0 on padding), all ranks' rows."""
        import torch

        mine = self._my_rows(len(batch))
        ent, lp, p2 = self._no_grad_pass(batch, mine)
        mask = batch.response_mask[mine]
        ent, lp, p2 = (torch.where(mask, t, 0.0) for t in (ent, lp, p2))
        ent, lp, p2 = (self._all_gather_rows(t) for t in (ent, lp, p2))
        return {"log_prob": lp, "entropy": ent, "sum_p2": p2}

    # -- the step -------------------------------------------------------------------------
    def train_step(self, batch, global_step: int, old_logprob_source: str = "recompute") -> dict:
        """Recompute old log-probs, then PPO updates over mini-batches. Returns metrics and,
        for the driver, the recomputed log-probs (rank 0)."""
        import torch

        t0 = time.perf_counter()
        stats = self.compute_log_probs(batch)
        t_ref = time.perf_counter() - t0
        rmask = batch.response_mask
        diff = (stats["log_prob"] - batch.rollout_log_probs).abs()
        diff = torch.where(rmask, diff, 0.0)
        old = stats["log_prob"] if old_logprob_source == "recompute" else batch.rollout_log_probs
        batch = batch.with_(old_log_probs=old, entropy=stats["entropy"])
        t1 = time.perf_counter()
        metrics = self._update(batch, global_step, first_pass=stats)
        t_update = time.perf_counter() - t1
        metrics.update(
            {
                "rollout/logprob_diff_max": float(diff.max()) if rmask.any() else 0.0,
                "rollout/logprob_diff_mean": float(diff.sum() / rmask.sum().clamp(min=1)),
                "timing_s/ref": t_ref,
                "timing_s/update": t_update,
                "perf/train_tokens_per_s": float(rmask.sum()) / max(t_ref + t_update, 1e-9),
            }
        )
        metrics["_old_log_probs"] = old
        metrics["_entropy"] = stats["entropy"]
        return metrics

    def _update(self, batch, global_step: int, first_pass: dict) -> dict:
        import torch

        from stapoctl.losses import compute_policy_loss, prepare_minibatch, slice_context

        acc = _MetricAccumulator()
        epochs = int(self.learner.get("ppo_epochs") or 1)
        n_rows = len(batch)
        cfg = self.loss_cfg
        adv_all = batch.advantages
        updated = False
        grad_norms = []
        for _ in range(epochs):
            for start in range(0, n_rows, self.mini_rows):
                mini_sl = slice(start, min(start + self.mini_rows, n_rows))
                mini = batch.select(mini_sl)
                mine = self._my_rows(len(mini))
                micro_sls = plan_micro_batches(mine.stop - mine.start, self.micro)
                single = len(micro_sls) == 1 and self.world_size == 1
                extras = {"group_ids": mini.group_ids, "global_step": int(global_step)}
                if self.max_response_length:
                    extras["max_response_length"] = int(self.max_response_length)
                if not updated:
                    ent, lp, p2 = (first_pass[k][mini_sl] for k in ("entropy", "log_prob", "sum_p2"))
                    context = prepare_minibatch(self.loss_name, log_prob=lp, advantages=mini.advantages,
                                                response_mask=mini.response_mask, entropy=ent,
                                                old_log_prob=mini.old_log_probs, sum_p2=p2, **extras, **cfg)
                elif single:
                    ent = lp = context = None  # taken from the gradient pass below
                else:
                    ent, lp, p2 = self._no_grad_pass(mini, mine)
                    ent, lp, p2 = (self._all_gather_rows(t) for t in (ent, lp, p2))
                    context = prepare_minibatch(self.loss_name, log_prob=lp, advantages=mini.advantages,
                                                response_mask=mini.response_mask, entropy=ent,
                                                old_log_prob=mini.old_log_probs, sum_p2=p2, **extras, **cfg)
                for k, sl in enumerate(micro_sls):
                    rows = slice(mine.start + sl.start, mine.start + sl.stop)
                    mb = mini.select(rows)
                    ent_g, lp_g, p2_g = self._token_stats(mb)
                    mask = mb.response_mask.to(self.device)
                    if context is None:
                        context = prepare_minibatch(self.loss_name, log_prob=lp_g.detach(),
                                                    advantages=mb.advantages, response_mask=mask,
                                                    entropy=ent_g, old_log_prob=mb.old_log_probs,
                                                    sum_p2=p2_g, **extras, **cfg)
                        ent_mb = ent_g
                    else:
                        ent_mb = ent[rows].to(self.device)
                    mb_extras = dict(extras, group_ids=mb.group_ids.to(self.device))
                    loss, m = compute_policy_loss(
                        self.loss_name,
                        log_prob=lp_g,
                        old_log_prob=mb.old_log_probs.to(self.device),
                        advantages=_dev(mb.advantages, self.device),
                        response_mask=mask,
                        entropy=ent_mb,
                        sum_p2=p2_g,
                        **mb_extras,
                        **cfg,
                        **slice_context(context, rows),
                    )
                    boundary_norm = self._backward(loss, boundary=k == len(micro_sls) - 1)
                    acc.add(m)
                grad_norms.append(self._optimizer_step(boundary_norm))
                acc.end_minibatch()
                updated = True
                context = None
        out = acc.result()
        out["actor/grad_norm"] = float(sum(grad_norms) / max(len(grad_norms), 1))
        out["actor/lr"] = float(self.scheduler.get_last_lr()[0]) if self.scheduler else float(self.learner["lr"])
        out["actor/optimizer_steps"] = float(self.optimizer_steps)
        return out

    def _backward(self, loss, boundary: bool) -> Optional[float]:
        """backward + engine.step(); at the accumulation boundary that step is the optimizer's.

        The loss library already normalises by the mini-batch (sum of micro losses = mini
        loss), so DeepSpeed must not divide by the accumulation steps; its allreduce
        averages over ranks, so each rank's share is scaled back up to a sum.
        """
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        norm = None
        if boundary and self.zero_stage == 0 and self.world_size == 1:
            # ZeRO-0 clips without recording the norm; measure it before the step clips it.
            import torch

            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        self.engine.step()
        return norm

    def _optimizer_step(self, measured: Optional[float]) -> float:
        """The last micro-batch's `engine.step()` was the accumulation boundary: its grad norm."""
        self.optimizer_steps += 1
        norm = self.engine.get_global_grad_norm()
        if norm is None or not math.isfinite(float(norm)):
            norm = measured
        return float(norm) if norm is not None else float("nan")

    # -- data parallel -----------------------------------------------------------------------
    def _my_rows(self, n_rows: int) -> slice:
        if self.world_size == 1:
            return slice(0, n_rows)
        per = n_rows // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)

    def _all_gather_rows(self, t):
        if self.world_size == 1:
            return t
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(t).to(self.device) for _ in range(self.world_size)]
        dist.all_gather(parts, t.to(self.device))
        return torch.cat([p.cpu() for p in parts])

    # -- weights ----------------------------------------------------------------------------
    def weights(self) -> list:
        """(name, tensor) of the full model, on CPU, for the rollout workers (rank 0's copy)."""
        import torch

        with self._gathered():
            state = [(k, v.detach().to("cpu", copy=True).contiguous())
                     for k, v in self.module.state_dict().items()]
        return state if self.rank == 0 else []

    def full_state_dict(self) -> dict:
        """name → full CPU tensor (gathered under ZeRO-3), tied weights under both names."""
        with self._gathered():
            return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def _gathered(self):
        if self.zero_stage != 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)

    def init_weight_transfer(self, backend: str, rollout_handles: Sequence[Any], vllm_world_size: int) -> None:
        """GPU only (untested here): open the NCCL/IPC link to the vLLM workers."""
        from stapoctl.sync.gpu_transfer import make_trainer_engine

        self.transfer = make_trainer_engine(
            backend, self.module, rollout_handles, rank=self.rank, master_address=node_ip(),
            master_port=free_port(), vllm_world_size=vllm_world_size,
        )

    def send_weights(self) -> float:
        t0 = time.perf_counter()
        with self._gathered():
            self.transfer.send_weights()
        return time.perf_counter() - t0

    def perturb_weights(self, scale: float, seed: int = 0) -> None:
        """Add seeded noise to every weight (tests: make the learner differ from vLLM)."""
        import torch

        g = torch.Generator().manual_seed(seed)
        with torch.no_grad(), self._gathered():
            for p in self.module.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p) * scale)

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, step_dir: str, tokenizer_dir: str) -> dict:
        """HF model dir (loadable by vLLM and eval) + DeepSpeed state (optimizer, scheduler, RNG)."""
        from pathlib import Path

        import torch
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        out = Path(step_dir)
        self.engine.save_checkpoint(str(out / "state"), tag="ds",
                                    client_state={"optimizer_steps": self.optimizer_steps,
                                                  "torch_rng": torch.get_rng_state()})
        if self.rank == 0:
            with self._gathered():
                state = {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
            self.module.save_pretrained(str(out / "model"), state_dict=state, safe_serialization=True)
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(str(out / "model"))
        return {"save_s": time.perf_counter() - t0}

    def load(self, step_dir: str) -> dict:
        from pathlib import Path

        import torch

        _, client = self.engine.load_checkpoint(str(Path(step_dir) / "state"), tag="ds",
                                                load_optimizer_states=True, load_lr_scheduler_states=True)
        client = client or {}
        self.optimizer_steps = int(client.get("optimizer_steps", 0))
        if "torch_rng" in client:
            torch.set_rng_state(client["torch_rng"])
        return {"optimizer_steps": self.optimizer_steps}

    def shutdown(self) -> None:
        try:
            import deepspeed.comm as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _dev(t, device):
    return t.to(device) if t is not None else None


def _extensions_dir() -> str:
    from stapoctl import paths

    path = paths.home() / "torch_extensions"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


class _MetricAccumulator:
    """Micro-batch metrics → mini-batch (sum the loss, token-weight the ratios) → step mean."""

    SUM_KEYS = ("actor/pg_loss", "stapo/spurious_count", "loss/response_tokens")

    def __init__(self) -> None:
        self.mini: list[dict[str, float]] = []
        self.cur_sum: dict[str, float] = {}
        self.cur_w: dict[str, float] = {}

    def add(self, m: dict) -> None:
        w = float(m.get("loss/response_tokens", 1.0)) or 0.0
        for k, v in m.items():
            v = float(v)
            if k in self.SUM_KEYS or k.endswith("_count"):
                self.cur_sum[k] = self.cur_sum.get(k, 0.0) + v
                self.cur_w[k] = -1.0
            else:
                self.cur_sum[k] = self.cur_sum.get(k, 0.0) + v * w
                self.cur_w[k] = self.cur_w.get(k, 0.0) + w

    def end_minibatch(self) -> None:
        out = {}
        for k, s in self.cur_sum.items():
            w = self.cur_w[k]
            out[k] = s if w < 0 else (s / w if w > 0 else 0.0)
        self.mini.append(out)
        self.cur_sum, self.cur_w = {}, {}

    def result(self) -> dict[str, float]:
        if not self.mini:
            return {}
        keys = set().union(*self.mini)
        return {k: sum(m.get(k, 0.0) for m in self.mini) / len(self.mini) for k in keys}


def learner_env(use_cuda: bool) -> dict[str, str]:
    from stapoctl.launch.ray_runtime import actor_env

    extra = {"TORCH_EXTENSIONS_DIR": _extensions_dir()}
    if not use_cuda:
        extra["DS_ACCELERATOR"] = "cpu"
    return actor_env(extra)


def make_learner_group(
    model_path: str,
    learner: dict,
    loss: dict,
    *,
    n_per_prompt: int,
    temperature: float,
    dtype: str,
    seed: int,
    max_response_length: Optional[int] = None,
    placement: Any = None,
    wait: bool = True,
) -> tuple[list, Any]:
    """Start learner.num_gpus ranks (one on CPU), wire their rendezvous, start DeepSpeed.

    Returns (handles, setup refs); with wait=False the caller overlaps the DeepSpeed start-up
    with other work (vLLM's) and waits on the refs itself.
    """
    import ray

    use_cuda = int(learner.get("num_gpus") or 0) > 0
    world = max(1, int(learner.get("num_gpus") or 0))
    actor_cls = ray.remote(Learner)
    handles = []
    for rank in range(world):
        opts: dict[str, Any] = dict(
            num_cpus=float(learner.get("cpus") or 1),
            num_gpus=(placement.learner_gpus if placement is not None and placement.pg is not None else
                      (1.0 if use_cuda else 0.0)),
            runtime_env={"env_vars": learner_env(use_cuda)},
        )
        if placement is not None and placement.pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement.pg, placement_group_bundle_index=placement.learner_bundles[rank]
            )
        handles.append(actor_cls.options(**opts).remote(rank, world))
    addr, port = ray.get(handles[0].rendezvous.remote())
    refs = [
        h.setup.remote(model_path, learner, loss, n_per_prompt=n_per_prompt, temperature=temperature,
                       dtype=dtype, seed=seed, max_response_length=max_response_length,
                       master_addr=addr, master_port=port)
        for h in handles
    ]
    if wait:
        ray.get(refs)
    return handles, refs
