"""`stapoctl plan`'s CPU learner figure against the learner's measured peak RSS, side by side.

    stapoctl bench plan_accuracy [--quick] [--repeats 1] [--write-docs]

Each configuration runs stapoctl's DeepSpeed `Learner` (one rank, gloo, fp32, ZeRO-0, the
defaults of `LearnerConfig` but the micro-batch and length below) in a fresh process on a random
Qwen3 at the 25M shape (h512, 8 layers, the toy vocabulary of 512): two `train_step`s on a fixed
batch, then `ru_maxrss`. The plan is `preflight.memory.learner_memory` for the same shape and
settings. A second process that only imports what the learner imports gives the runtime baseline
the plan assumes (`RUNTIME_GIB["cpu"]`). The ratio is plan / measured: above 1 the plan is
conservative. GPU figures come from `stapoctl bench gpu_kit` on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

# (micro-batch sequences, prompt tokens, response tokens, gradient checkpointing)
CONFIGS = [(8, 64, 192, False), (16, 64, 448, False), (16, 64, 448, True)]
QUICK = [(8, 64, 192, False)]


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def worker(payload: dict) -> dict:
    """In a fresh process: the learner's peak RSS over two steps (or the imports' alone)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch  # noqa: F401

    from stapoctl.learner.deepspeed_learner import Learner  # noqa: F401  (what an actor imports)

    if payload.get("imports_only"):
        import deepspeed  # noqa: F401
        import transformers  # noqa: F401

        return {"rss_gib": _rss_gib()}
    from dataclasses import asdict

    import stapoctl.losses as L
    from stapoctl.config.schema import LearnerConfig
    from stapoctl.learner.engine_setup import free_port

    micro, prompt, response, ckpt = payload["config"]
    lcfg = asdict(LearnerConfig())
    lcfg.update(lr=0.0, warmup_steps=0, micro_batch_size=micro, ppo_mini_batch_size=2, gradient_checkpointing=ckpt,
                shared_prefix=False)
    batch, rewards = _fixed_batch(2, micro // 2, prompt, response)
    loss_cfg = dict(vars(L.LOSSES["grpo"].config_cls()))
    lrn = Learner(0, 1)
    lrn.setup(payload["model"], lcfg, loss_cfg, n_per_prompt=micro // 2, temperature=1.0, dtype="float32", seed=0,
              max_response_length=response, master_port=free_port())
    adv = L.compute_advantages("grpo", rewards, batch.group_ids, **loss_cfg)
    b = batch.with_(rewards=rewards, advantages=adv)
    before = _rss_gib()
    for step in (1, 2):
        lrn.train_step(b, step)
    peak = _rss_gib()
    lrn.shutdown()
    return {"rss_gib": peak, "after_setup_gib": before}


def _fixed_batch(prompts: int, n: int, prompt_len: int, response_len: int):
    """Random tokens of the toy vocabulary, every response at full length (the plan's worst case)."""
    import torch

    from stapoctl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(10, 512, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    rs = [[torch.randint(10, 512, (response_len,), generator=g).tolist() for _ in range(n)] for _ in range(prompts)]
    lps = [[[0.0] * response_len for _ in range(n)] for _ in range(prompts)]
    batch = RolloutBatch.from_token_lists(ps, rs, lps, [[False] * n] * prompts, [[""] * n] * prompts, pad_id=0)
    rewards = torch.tensor([1.0, -1.0] * (prompts * n // 2))
    return batch, rewards


def _plan(shape: dict, config) -> dict:
    from stapoctl.preflight.memory import learner_memory

    micro, prompt, response, ckpt = config
    return learner_memory(shape, zero_stage=0, num_ranks=1, dtype="float32", micro_tokens=micro * (prompt + response),
                          gradient_checkpointing=ckpt, logits_chunk=1024, on_gpu=False, seq_len=prompt + response)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.base_args(p, repeats=1)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return 0
    from rich.console import Console

    from _peers import SIZES, compose, model_dir
    from stapoctl.preflight.model_shape import tiny_shape
    from stapoctl.config.schema import TinyModelConfig

    console = Console()
    t0 = time.perf_counter()
    conf = compose([])
    model = model_dir("25m", conf)
    shape = tiny_shape(TinyModelConfig(**SIZES["25m"]))
    base = H.run_worker(Path(__file__), {"imports_only": True})["rss_gib"]
    rows = []
    for config in (QUICK if a.quick else CONFIGS):
        measured = [H.run_worker(Path(__file__), {"model": model, "config": list(config)})["rss_gib"]
                    for _ in range(max(1, a.repeats))]
        plan = _plan(shape, config)
        micro, prompt, response, ckpt = config
        what = (f"25M learner, fp32 ZeRO-0, micro-batch {micro} x {prompt + response} tokens, "
                f"checkpointing {'on' if ckpt else 'off'}")
        ratio = plan["total"] / max(measured)
        rows.append(H.row(f"plan_cpu_{micro}x{prompt + response}{'_ckpt' if ckpt else ''}", what,
                          ours=[plan["total"]], peer=measured, unit="GiB", lower_is_better=False, ratio=ratio,
                          target=1.0, target_max=False, extra={"plan_parts": plan, "imports_gib": base}, target_text="plan ≥ measured (≥ 1×)",
                          ours_label="plan", peer_label="measured peak RSS",
                          checks=[H.check("runtime", True, f"imports alone {base:.2f} GiB; the plan assumes "
                                                           f"{plan['runtime']:.2f}")]))
    H.print_rows(rows, console, title="plan vs measured (CPU learner)")
    H.publish("plan_accuracy", rows, a, console, config={"configs": CONFIGS, "imports_gib": base},
              seconds=time.perf_counter() - t0, env=H.environment())
    return 0


if __name__ == "__main__":
    sys.exit(main())
