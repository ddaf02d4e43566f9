"""Starting one data-parallel rank's DeepSpeed engine: process group, model, optimizer, schedule.

On CPU: DeepSpeed's CPU accelerator, gloo, torch AdamW (no FusedAdam/CPUAdam JIT build); ZeRO
stages 0-3 all run, with any number of ranks. The shared-memory allreduce op DeepSpeed builds
at `init_distributed` (a ~56 s JIT compile) is skipped: only `inference_all_reduce` uses it,
training collectives go through torch.distributed (gloo) either way.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
from typing import Any, Optional

from stapoctl.config.loss_modules import load_on_rank
from stapoctl.config.loss_settings import build_loss_config
from stapoctl.errors import UserError
from stapoctl.learner.rendezvous import free_port  # noqa: F401  (tests and benchmarks import it here)


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


def process_group_timeout_s(learner: dict) -> float:
    """The learner ranks' process-group timeout (NCCL's watchdog, gloo's collectives): the driver's
    resolved `learner.process_group_timeout_s` (twice the weight-sync timeout by default), never
    DeepSpeed's 10 minutes, which a push queued behind long async rollouts outlasts while ranks > 0
    sit in a collective (TRL hit it: trl#7103)."""
    return float(learner.get("process_group_timeout_s") or 3600.0)


def uses_cuda(learner: dict) -> bool:
    import torch

    return torch.cuda.is_available() and float(learner.get("gpus_per_rank") or 0) > 0


def clips_itself(learner: dict, bf16: bool) -> bool:
    """Whether the learner clips gradients itself instead of DeepSpeed: ZeRO-0 in fp32, where
    DeepSpeed keeps no norm (`get_global_grad_norm` is None) and the learner measured it anyway,
    so one pass over the gradients gives the logged norm and the clip. Under bf16 DeepSpeed's
    BF16_Optimizer clips its own fp32 copies of the gradients, so it keeps the clip."""
    return int(learner["zero_stage"]) == 0 and not bf16


def ds_config(learner: dict, *, micro_batch_size: int, grad_accum: int, world_size: int, bf16: bool) -> dict:
    """DeepSpeed JSON config; the loss is already normalised per mini-batch (see `PPOStep._backward`)."""
    zero: dict[str, Any] = {"stage": int(learner["zero_stage"])}
    if learner.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
        "gradient_accumulation_steps": int(grad_accum),
        "train_batch_size": int(micro_batch_size * grad_accum * world_size),
        "gradient_clipping": 0.0 if clips_itself(learner, bf16) else float(learner["grad_clip"]),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bool(bf16)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def adamw(params, **kwargs):
    """torch AdamW, fused where torch has the kernel (CPU and CUDA, float params): on CPU the
    default single-tensor loop took 4x as long (43 vs 11 ms per step at 25M here). Same update
    up to float rounding; TRL's default (`adamw_torch_fused`) is the same kernel."""
    import torch

    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, **kwargs)


def extensions_dir() -> str:
    from stapoctl import paths

    path = paths.home() / "torch_extensions"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def import_training_stack() -> None:
    """Once per process, before the process group; `reset` then finds the model stack loaded."""
    from stapoctl.launch.import_gc import paused_gc, skip_unused_imports
    from stapoctl.launch.ray_runtime import in_ray_actor

    if in_ray_actor():
        skip_unused_imports()
    # DeepSpeed + transformers imports are most of the learner's start-up
    with paused_gc("transformers.models.qwen3.modeling_qwen3"):
        import torch
        import transformers.models.qwen3.modeling_qwen3  # (the tiny and Qwen3 models)
        from transformers import AutoModelForCausalLM
    del torch, transformers, AutoModelForCausalLM  # imported for their load only; callers import their own


def host_info(shim: bool) -> dict:
    """Where this rank runs, for the run's records: MKL's code path and the Ray node."""
    from stapoctl.launch import mkl_shim
    from stapoctl.launch.ray_runtime import runtime_context

    mkl = {"code_path": mkl_shim.mkl_code_path(), "amd_shim": shim}
    ctx = runtime_context()  # None: constructed outside Ray (tests, benchmarks)
    return {"mkl": mkl, "node_id": ctx.get_node_id() if ctx is not None else "", "pid": os.getpid()}


class EngineSetup:
    """Mixin of the learner actor: `setup` (not `__init__`) starts DeepSpeed, so the driver can
    hand every rank the rendezvous address of rank 0 first; `reset` starts a fresh run (a new
    sweep trial) in the same process without re-joining the process group."""

    rank: int
    world_size: int

    def pg_timeout_s(self) -> float:
        """The shortest timeout of this rank's collectives, as torch reads them: its default group's
        (the CPU backend's: gloo here) and what a group created later without one gets (DeepSpeed's)."""
        import torch
        import torch.distributed as dist

        c10d = dist.distributed_c10d
        backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
        later = [c10d._get_default_timeout(b) for b in (dist.Backend.GLOO, dist.Backend.NCCL)]
        return float(min([backend.options._timeout, *later]).total_seconds())

    def rendezvous(self, timeout_s: float = 3600.0) -> tuple[str, int]:
        """Rank 0's address and the port of a store it listens on from now (torch.distributed's
        MASTER_*), kept for `setup`'s process group: no other process can take the port meanwhile."""
        from stapoctl.learner.rendezvous import listen

        host = node_ip()
        self._rendezvous_store = listen(host, self.world_size, timeout_s)
        return host, int(self._rendezvous_store.port)

    def setup(
        self,
        model_path: str,
        learner: dict,
        loss: dict,
        *,
        n_per_prompt: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        dtype: str = "float32",
        seed: int = 0,
        max_response_length: Optional[int] = None,
        reference_path: Optional[str] = None,
        master_addr: str = "127.0.0.1",
        master_port: Optional[int] = None,
    ) -> dict:
        """Once per process: what a later sweep trial keeps (imports, process group, MKL's first
        use) is done here, the rest in `reset`."""
        from stapoctl.launch.ray_runtime import process_start

        t0 = time.perf_counter()
        marks = {"spawned": process_start(), "setup_called": time.time()}
        import_training_stack()
        marks["imports"] = time.time()
        self._join_process_group(learner, master_addr, master_port)
        marks["process_group"] = time.time()  # DeepSpeed's import + init_distributed
        out = self.reset(model_path, learner, loss, n_per_prompt=n_per_prompt, temperature=temperature,
                         top_p=top_p,
                         dtype=dtype, seed=seed, max_response_length=max_response_length,
                         reference_path=reference_path)
        marks["engine_built"] = time.time()  # model load, AdamW, deepspeed.initialize, KL reference
        shim = self._take_first_forward()
        marks["first_forward"] = time.time()
        out["setup_s"] = time.perf_counter() - t0
        out["startup"] = marks  # epoch seconds of each start-up phase's end (the driver's phase table)
        out.update(host_info(shim))
        return out

    def _join_process_group(self, learner: dict, master_addr: str, master_port: Optional[int]) -> None:
        """torch.distributed's default group on rank 0's store (`rendezvous`), then DeepSpeed's
        `init_distributed`, which wraps it; fixes the device every later call uses."""
        import torch

        from stapoctl.launch.import_gc import paused_gc
        from stapoctl.learner import rendezvous

        use_cuda = uses_cuda(learner)
        if not use_cuda:
            os.environ["DS_ACCELERATOR"] = "cpu"
        local_rank = "0" if not use_cuda else os.environ.get("LOCAL_RANK", "0")
        os.environ.update(RANK=str(self.rank), LOCAL_RANK=local_rank, WORLD_SIZE=str(self.world_size),
                          MASTER_ADDR=master_addr)
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
        with paused_gc("deepspeed.comm"):
            import deepspeed
            import deepspeed.comm  # noqa: F401  (loads the submodule patched below)

        if not use_cuda:
            # `deepspeed.comm.torch` as an attribute is torch itself; patch the submodule.
            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        timeout_s = process_group_timeout_s(learner)
        timeout = datetime.timedelta(seconds=timeout_s)
        # DeepSpeed creates groups of its own without a timeout (its world-group clone, the gradient
        # reduce groups: deepspeed/utils/groups.py), which take torch's default — 10 min for NCCL
        import torch.distributed.distributed_c10d as c10d

        c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
        held = getattr(self, "_rendezvous_store", None) if self.rank == 0 else None
        store = rendezvous.store_for(self.rank, self.world_size, master_addr, master_port, timeout_s, held=held)
        os.environ["MASTER_PORT"] = str(store.port)
        backend = "nccl" if use_cuda else "gloo"
        # DeepSpeed's own init binds the device on CUDA for more than one rank (deepspeed/comm/torch.py)
        device_id = torch.device("cuda", int(local_rank)) if use_cuda and self.world_size != 1 else None
        rendezvous.init_default_group(backend, store, self.rank, self.world_size, timeout_s, device_id=device_id)
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        self.use_cuda = use_cuda

    def _take_first_forward(self) -> bool:
        """Whether the MKL shim is loaded. On CPU, spends the first-use effect of the learner
        process's first forward on a discarded one, so that no measured forward gets it."""
        import torch

        from stapoctl.launch import mkl_shim

        shim = mkl_shim.loaded_here()
        if not self.use_cuda:
            # The first forward pass of a learner process sometimes came out slightly off (~30% of
            # runs under the MKL shim on an AMD CPU; 1 of 8 to 8 of 16 starts without it on an
            # Intel one): log-probs up to 7.6e-4 from vLLM's, against 5e-6 at every later step,
            # on whole micro-batches, with the rollout bit-identical. Once per process; a sweep's
            # reset does not need it. A discarded forward here takes it (docs/PERFORMANCE.md,
            # `python benchmarks/_first_step_canary.py`); the sync canary of
            # tests/test_train_e2e.py watches for it.
            with torch.no_grad():
                self.module(input_ids=torch.ones(2, 8, dtype=torch.long))
        return shim

    def reset(
        self,
        model_path: str,
        learner: dict,
        loss: dict,
        *,
        n_per_prompt: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        dtype: str = "float32",
        seed: int = 0,
        max_response_length: Optional[int] = None,
        reference_path: Optional[str] = None,
    ) -> dict:
        """A fresh model, optimizer and schedule from `model_path`, as a new process would have
        (and the frozen reference from `reference_path`, the run's initial policy, when the loss
        has a KL term; `model_path` when not given).

        The process group stays; everything a run's update depends on (weights, Adam moments,
        lr schedule, RNG, loss config, step counters) is rebuilt, so a sweep trial on a reused
        learner computes what a freshly started one would.
        """
        t0 = time.perf_counter()
        load_on_rank(learner.get("loss_modules") or (), self.rank)  # loss.modules, reloaded: before the loss is read
        self._release_engine()
        if not self.use_cuda:
            self._set_threads(learner)
        self._set_run_config(learner, loss, n_per_prompt=n_per_prompt, temperature=temperature, top_p=top_p,
                             max_response_length=max_response_length)
        bf16 = dtype in ("bfloat16", "bf16")
        model = self._load_model(model_path, learner, seed=seed, bf16=bf16)
        grad_accum = self._plan_batches(learner)
        self._build_engine(model, learner, grad_accum=grad_accum, bf16=bf16)
        self.load_reference(reference_path or model_path, bf16=bf16)
        self.clip = float(learner["grad_clip"]) if clips_itself(learner, bf16) else None
        self.grad_accum = grad_accum
        self.optimizer_steps = 0
        return {"reset_s": time.perf_counter() - t0, "rank": self.rank, "zero_stage": self.zero_stage,
                "world_size": self.world_size,
                "params": sum(p.numel() for p in model.parameters()) if self.zero_stage < 3 else -1}

    def _set_threads(self, learner: dict) -> None:
        """CPU: torch's intra-op threads to the rank's CPU share, unless `num_threads` says."""
        import torch

        threads = int(learner.get("num_threads") or 0) or max(1, int(math.floor(float(learner.get("cpus") or 1))))
        torch.set_num_threads(threads)

    def _set_run_config(self, learner: dict, loss: dict, *, n_per_prompt: int, temperature: float,
                        top_p: float, max_response_length: Optional[int]) -> None:
        """The run's settings the PPO step reads; copies, so a caller's later edits don't leak in."""
        self.learner = dict(learner)
        # typed, once per set-up/reset (after loss.modules are reloaded): every micro-batch's loss reads it
        self.loss_config = build_loss_config(loss)
        self.n = int(n_per_prompt)
        # the rollout's sampling distribution, which every log-prob the learner returns is taken under
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.max_response_length = max_response_length
        self.zero_stage = int(learner["zero_stage"])

    def _load_model(self, model_path: str, learner: dict, *, seed: int, bf16: bool):
        """The weights from `model_path`, after seeding this rank's RNG (dropout, any fresh init)."""
        import torch
        from transformers import AutoModelForCausalLM

        from stapoctl.learner import packing

        torch.manual_seed(seed + self.rank)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16 if bf16 else torch.float32)
        if packing.enabled(learner):
            packing.use_packed_attention(model)
        if learner.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        return model

    def _plan_batches(self, learner: dict) -> int:
        """Micro- and mini-batch sizes (`micro`, `mini_rows`); returns the accumulation steps a
        rank's share of a mini-batch takes in fixed micro-batches (DeepSpeed's config wants a count;
        the learner sets each mini-batch's boundary itself, see `micro_batches.MicroBatching`)."""
        from stapoctl.config.validate import packing_conflict, token_budget_conflict

        conflict = token_budget_conflict(learner, vars(self.loss_config)) or packing_conflict(learner)
        if conflict:
            raise UserError(conflict)
        self.micro = int(learner["micro_batch_size"])
        mini_rows = int(learner["ppo_mini_batch_size"]) * self.n
        if mini_rows % self.world_size:
            raise UserError(
                f"learner.ppo_mini_batch_size={learner['ppo_mini_batch_size']} × rollout.n={self.n} = "
                f"{mini_rows} sequences do not split evenly over learner.num_ranks={self.world_size}: "
                "make the ranks divide the mini-batch"
            )
        self.mini_rows = mini_rows
        per_rank = mini_rows // self.world_size
        return max(1, -(-per_rank // self.micro))

    def _build_engine(self, model, learner: dict, *, grad_accum: int, bf16: bool) -> None:
        """AdamW and the warm-up schedule, wrapped by DeepSpeed (`engine`, `optimizer`, `scheduler`)."""
        import deepspeed
        import torch

        optimizer = adamw(
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
        if self.world_size == 1 and self.zero_stage == 0:
            # One rank: DeepSpeed's allreduce flattens every gradient into a buffer, "reduces" it
            # over a group of one and copies it back (5.7% of a 25M step here) - an identity.
            self.engine.enable_backward_allreduce = False

    def _release_engine(self) -> None:
        """Drop the previous run's engine (ZeRO-3 hooks included) before building the next."""
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        try:
            engine.destroy()
        except Exception:
            pass
        self.engine = self.optimizer = self.scheduler = self.reference = None
        import gc

        gc.collect()

    @property
    def module(self):
        return self.engine.module

    def shutdown(self) -> None:
        try:
            import deepspeed.comm as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        self._rendezvous_store = None  # rank 0's port, free again
