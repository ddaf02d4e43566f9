"""The peers stapoctl is compared with, each run in a fresh process (`--worker JSON`), and the
inputs both sides share (models, prompts in the order stapoctl's sampler serves them).

- TRL `GRPOTrainer` (generation with transformers, `use_vllm=False`), configured from the very
  stapoctl config it is compared with (`trl_args`): same model dir, prompts and their order,
  batch / mini-batch / micro-batch structure, lr and optimizer settings, clip range, token-mean
  loss, beta 0, fp32 (TRL's default bf16 autocast is 6-20x slower on this CPU), and the same
  reward: stapoctl's `RewardPool` (the DAPO +-1 rule verifier) called from a TRL reward function.
- transformers `generate`: TRL's own generation phase (timed around `_generate_single_turn`), which
  is `model.generate` on the rollout's batch (B prompts x n) with the same sampling and lengths.
- a plain `torch` copy of the learner's state dict (the floor for weight sync).
- the held-out toy accuracy of a saved model (the one evaluator both sides' models go through).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]

# A random Qwen3 at ~25M parameters (h512, 8 layers), with the project's toy tokenizer.
SIZES: dict[str, dict[str, int]] = {
    "25m": dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4,
                head_dim=64, vocab_size=512, max_position_embeddings=512),
}


# -- shared inputs --------------------------------------------------------------------------
def compose(overrides: list[str]):
    from stapoctl.config.compose import compose_config

    return compose_config(list(overrides))


def model_dir(size: str, conf) -> str:
    """The embedded tiny model (built and cached by stapoctl) or a cached random model of `size`."""
    from stapoctl import paths

    if size == "tiny":
        from stapoctl.models.tiny import ensure_base_model

        return str(ensure_base_model(conf.model, conf.data))
    from stapoctl.config.schema import TinyModelConfig
    from stapoctl.models.tiny import build_random

    shape = SIZES[size]
    final = paths.home() / "models" / f"bench-random-{size}"
    if not (final / "config.json").is_file():
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        build_random(tmp, TinyModelConfig(**shape), seed=0)
        os.replace(tmp, final) if not final.exists() else None
    return str(final)


def train_rows(conf, tokenizer_dir: str) -> list[dict]:
    """The training prompts exactly as `stapoctl train` keeps them (same filter, same order)."""
    from rich.console import Console
    from transformers import AutoTokenizer

    from stapoctl.data.prompts import TRAIN_DATA, load_rows, tokenize_prompts

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = load_rows(TRAIN_DATA.get(conf.data.name, conf.data.name), conf, tokenizer_dir)
    _, kept = tokenize_prompts(rows, tok, int(conf.data.max_prompt_length), "training", Console(quiet=True))
    return kept


def step_batches(conf, num_rows: int, steps: int) -> list[list[int]]:
    """Row indices of steps 1..steps, as stapoctl's PromptSampler serves them."""
    from stapoctl.trainer.sampler import PromptSampler

    s = PromptSampler(num_rows, int(conf.data.train_batch_size), seed=int(conf.data.seed),
                      shuffle=bool(conf.data.shuffle))
    return [s.next_batch() for _ in range(steps)]


# -- TRL --------------------------------------------------------------------------------------
def trl_structure(conf) -> dict[str, int]:
    """stapoctl's rollout / mini-batch / micro-batch structure in TRL's terms.

    stapoctl: a rollout of B prompts x n samples; PPO mini-batches of M prompts (M*n rows), one
    optimizer step each, accumulated over micro-batches of m rows; `ppo_epochs` passes.
    TRL: per_device_train_batch_size = m, gradient_accumulation_steps = M*n/m,
    steps_per_generation = B*n/m (micro-steps per generation), num_iterations = ppo_epochs.
    """
    r, lrn = conf.rollout, conf.learner
    rollout_rows = int(conf.data.train_batch_size) * int(r.n)
    mini_rows = int(lrn.ppo_mini_batch_size) * int(r.n)
    micro = min(int(lrn.micro_batch_size), mini_rows)
    return {"per_device_train_batch_size": micro, "gradient_accumulation_steps": mini_rows // micro,
            "steps_per_generation": rollout_rows // micro, "num_iterations": int(lrn.ppo_epochs or 1),
            "optimizer_steps_per_rollout": (rollout_rows // mini_rows) * int(lrn.ppo_epochs or 1)}


def trl_args(conf, rl_steps: int, output_dir: str):
    from trl import GRPOConfig

    return GRPOConfig(**trl_kwargs(conf, rl_steps, output_dir))


def trl_kwargs(conf, rl_steps: int, output_dir: str) -> dict:
    """TRL's `GRPOConfig` arguments for the stapoctl config it is compared with (no TRL needed to
    read them: tests/test_bench.py checks the mapping where TRL is not installed)."""
    r, lrn, loss = conf.rollout, conf.learner, conf.loss
    st = trl_structure(conf)
    agg = str(loss.get("loss_agg_mode", "token-mean"))
    warmup = int(lrn.warmup_steps or 0)
    return dict(
        output_dir=output_dir,
        use_cpu=True, bf16=False, fp16=False,  # equal dtype: fp32 on both sides
        per_device_train_batch_size=st["per_device_train_batch_size"],
        gradient_accumulation_steps=st["gradient_accumulation_steps"],
        steps_per_generation=st["steps_per_generation"],
        num_iterations=st["num_iterations"],
        max_steps=rl_steps * st["optimizer_steps_per_rollout"],
        num_generations=int(r.n),
        max_completion_length=int(r.max_response_length),
        temperature=float(r.temperature), top_p=float(r.top_p), top_k=0,
        learning_rate=float(lrn.lr),
        lr_scheduler_type="constant_with_warmup" if warmup else "constant", warmup_steps=warmup,
        adam_beta1=float(lrn.betas[0]), adam_beta2=float(lrn.betas[1]), adam_epsilon=float(lrn.adam_eps),
        weight_decay=float(lrn.weight_decay), max_grad_norm=float(lrn.grad_clip),
        beta=0.0,
        epsilon=float(loss.get("clip_ratio_low", 0.2)), epsilon_high=float(loss.get("clip_ratio_high", 0.2)),
        # token-mean over the accumulated mini-batch = TRL "dapo"; seq-mean-token-mean = "grpo"
        loss_type="dapo" if agg == "token-mean" else "grpo",
        scale_rewards="group",
        shuffle_dataset=False,  # the dataset is already in stapoctl's sampler order
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        seed=int(conf.trainer.seed), dataloader_num_workers=0,
    )


def _trl_trainer_class():
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with per-phase clocks (generation, reward, the rest of scoring)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.phase: dict[str, list[float]] = {"gen": [], "reward": [], "score": []}
            self.gen_tokens: list[int] = []

        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*a, **kw)
            self.phase["gen"].append(time.perf_counter() - t0)
            self.gen_tokens.append(sum(len(c) for c in out[0]))
            return out

        def _calculate_rewards(self, *a, **kw):
            t0 = time.perf_counter()
            out = super()._calculate_rewards(*a, **kw)
            self.phase["reward"].append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, *a, **kw):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            self.phase["score"].append(time.perf_counter() - t0)
            return out

    return TimedGRPOTrainer


def _reward_func(conf):
    """stapoctl's reward path (RewardPool: extraction + rule verifier subprocesses) as TRL's reward."""
    from stapoctl.reward.pool import RewardPool

    pool = RewardPool(conf.reward)

    def dapo_reward(prompts, completions, answer, problem, **_):
        rewards, _ = pool.score(list(completions), list(answer), list(problem))
        return [float(x) for x in rewards]

    return pool, dapo_reward


def trl_worker(p: dict) -> dict:
    """Train `steps` RL steps with TRL; per-step wall times, phases, tokens, losses, dtype."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    t_spawn = float(p.get("t_spawn") or time.time())
    conf = compose(p["overrides"])
    mdir, steps = p["model_dir"], int(p["steps"])
    rows = train_rows(conf, mdir)
    order = step_batches(conf, len(rows), steps)
    data = Dataset.from_list([{"prompt": rows[i]["prompt"], "answer": str(rows[i]["answer"]),
                               "problem": str(rows[i].get("problem", rows[i]["prompt"]))}
                              for batch in order for i in batch])
    out_dir = p.get("output_dir") or str(Path(os.environ.get("TMPDIR", "/tmp")) / f"trl-bench-{os.getpid()}")
    args = trl_args(conf, steps, out_dir)
    st = trl_structure(conf)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(mdir)
    pool, reward = _reward_func(conf)
    ends: list[float] = []
    logs: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                logs_copy = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
                logs_copy["step"] = state.global_step
                logs_.append(logs_copy)

    logs_ = logs
    trainer = _trl_trainer_class()(model=model, reward_funcs=[reward], args=args, train_dataset=data,
                                   processing_class=tok, callbacks=[Clock()])
    t_ready = time.time()
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    if p.get("save_dir"):
        trainer.save_model(p["save_dir"])
        tok.save_pretrained(p["save_dir"])
    t_done = time.time()
    k = st["optimizer_steps_per_rollout"]
    rl_ends = [t0] + [ends[i] for i in range(k - 1, len(ends), k)]
    step_s = [b - a for a, b in zip(rl_ends, rl_ends[1:])]
    n_gen = len(trainer.phase["gen"])
    out = {
        "step_s": step_s,
        "gen_s": trainer.phase["gen"], "reward_s": trainer.phase["reward"],
        "score_s": trainer.phase["score"], "gen_tokens": trainer.gen_tokens,
        "losses": [lg.get("loss") for lg in logs if "loss" in lg],
        "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "autocast": bool(args.bf16 or args.fp16),
        "torch_threads": torch.get_num_threads(), "train_s": train_s,
        "startup_s": t_ready - t_spawn, "whole_s": t_done - t_spawn, "generations": n_gen,
        "structure": st, "loss_type": args.loss_type, "optim": str(args.optim),
        "prompt_fingerprint": [order[0][:3], order[-1][-3:]],
    }
    if p.get("loss_check"):
        out["loss_check"] = loss_cross_check(trainer, conf)
    pool.close()
    return out


def loss_cross_check(trainer, conf) -> dict:
    """TRL's loss and stapoctl's `compute_policy_loss` on one identical batch with the same model.

    The last buffered micro-batch of TRL (its prompts, completions, masks and advantages) goes
    through TRL's own `_compute_loss` and through stapoctl's loss registry, with TRL's own old
    log-probs when it kept them (several optimizer steps per generation: ρ ≠ 1, the clip can bind),
    else old = current. Equal values = both sides optimise the same objective.
    """
    import torch

    from stapoctl.losses import compute_policy_loss

    inputs = dict(trainer._buffered_inputs[-1])
    model = trainer.model
    model.eval()
    with torch.no_grad():
        trl_loss = float(trainer._compute_loss(model, inputs))
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        # the same per-token log-probs and entropies TRL's loss sees: only the objective differs
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(model, ids, att, inputs["completion_ids"].shape[1],
                                                                compute_entropy=True)
        mask = inputs["completion_mask"].bool()
        cfg = {k: v for k, v in dict(conf.loss).items()}
        name = "dapo" if str(cfg.get("loss_agg_mode", "token-mean")) == "token-mean" else "grpo"
        cfg = {k: v for k, v in cfg.items() if k in _loss_fields(name) and k != "name"}
        old = inputs.get("old_per_token_logps")
        ours, _ = compute_policy_loss(name, log_prob=lp, old_log_prob=lp if old is None else old,
                                      advantages=inputs["advantages"],
                                      response_mask=mask, entropy=ent, **cfg)
    # TRL normalises a micro-batch by the tokens of its whole accumulation window: scale ours the same way
    window = float(inputs["num_items_in_batch"]) if "num_items_in_batch" in inputs else float(mask.sum())
    ours_scaled = float(ours) * float(mask.sum()) / window if trainer.loss_type == "dapo" else float(ours)
    if trainer.loss_type != "dapo":
        ours_scaled /= trainer.current_gradient_accumulation_steps
    return {"trl": trl_loss, "stapoctl": ours_scaled, "rows": int(mask.shape[0]), "tokens": int(mask.sum())}


def _loss_fields(name: str) -> set[str]:
    from dataclasses import fields

    from stapoctl.losses import LOSSES

    return {f.name for f in fields(LOSSES[name].config_cls)}


# -- torch copy ----------------------------------------------------------------------------------
def torch_copy_worker(p: dict) -> dict:
    """Copy the learner's state dict (tied weights under both names, as it sends) into a preallocated one."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(p["model_dir"], dtype=torch.float32)
    src = model.state_dict()
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    secs = []
    for i in range(int(p["repeats"]) + 1):
        with torch.no_grad():
            for v in src.values():
                v.add_(1e-7)  # fresh values each time (no stale cache lines)
        t0 = time.perf_counter()
        for k, v in src.items():
            dst[k].copy_(v)
        if i:
            secs.append(time.perf_counter() - t0)
    return {"copy_s": secs, "bytes": int(sum(v.numel() * v.element_size() for v in src.values())),
            "tensors": len(src), "torch_threads": torch.get_num_threads()}


# -- evaluation ----------------------------------------------------------------------------------
def toy_accuracy_worker(p: dict) -> dict:
    """Held-out toy accuracy at T=1.0 (4 samples per problem) of each model dir, one evaluator."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapoctl.data.registry import load_rows
    from stapoctl.models.tiny import EVAL_SAMPLES_PER_PROBLEM, toy_scores
    from stapoctl.models.warm_start import sample

    conf = compose(p["overrides"])
    torch.set_num_threads(1)
    out = {}
    for name, mdir in p["models"].items():
        tok = AutoTokenizer.from_pretrained(mdir)
        model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
        rows = load_rows("toy", conf.data, mdir)
        texts = sample(model, tok, [r["prompt"] for r in rows], n=EVAL_SAMPLES_PER_PROBLEM, temperature=1.0,
                       max_new_tokens=int(conf.rollout.max_response_length), seed=int(p.get("seed", 0)))
        out[name] = toy_scores(texts, [str(r["answer"]) for r in rows])["accuracy"]
    return out


WORKERS = {"trl": trl_worker, "torch_copy": torch_copy_worker, "toy_accuracy": toy_accuracy_worker}


def run(kind: str, payload: dict, *, timeout: Optional[float] = None, env: Optional[dict] = None) -> dict:
    from _harness import run_worker  # noqa: E402  (benchmarks/ is the script dir)

    return run_worker(Path(__file__), {"kind": kind, "t_spawn": time.time(), **payload}, timeout=timeout, env=env)


def mkl_shim_env() -> dict:
    """The LD_PRELOAD stapoctl gives its engine actors here (`launch/mkl_shim.py`), or {} where it
    gives none: the peer run once more with it shows how much of a ratio is that library."""
    from stapoctl.launch import mkl_shim

    return mkl_shim.preload_env()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        import warnings

        warnings.filterwarnings("ignore")
        payload: dict[str, Any] = json.loads(sys.argv[2])
        result = WORKERS[payload.pop("kind")](payload)
        sys.stdout.flush()
        print(json.dumps(result, default=str))
    else:
        print(__doc__)
