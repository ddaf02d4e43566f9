"""The per-token trace page and the drift-per-rule metrics, on vs off, beside the learner step.

    stapoctl bench token_trace_overhead [--repeats 40] [--quick]

One DeepSpeed `Learner` (in this process, 1 thread, as `loss_overhead`) with loss=stapo and a
shadow rule takes one fixed RolloutBatch (8 prompts x 8 responses of the embedded tiny model) through
`train_step` with lr = 0. "on" adds what the driver does with the step's `StepResult` as training
does it at its busiest (bf16, where every step is measured): the drift and flips of every rule
(`losses/drift.py`) on every step, and the trace page (`tracking/token_diagnostics.write_page`) every
`trainer.diagnostics_every` (20) steps on a background thread, as `StepRunner.log_diagnostics` draws
it. "off" is the bare step. Calls alternate; each side's own cost is clocked too.

The ratio is the median of per-pair on/off ratios (target <= 1.03).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _peers  # noqa: E402
from loss_overhead import fixed_batch  # noqa: E402

TARGET = 1.03
PAGE_EVERY = 20  # trainer.diagnostics_every's default
LOSS = ["loss=stapo", "loss.shadow=[stapo_prob_only]"]


def make_learner(conf, model_dir: str):
    from omegaconf import OmegaConf

    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.learner.engine_setup import free_port

    lrn = OmegaConf.to_container(conf.learner, resolve=True)
    lrn["lr"] = 0.0
    loss_cfg = OmegaConf.to_container(_peers.compose(LOSS).loss, resolve=True)
    learner = Learner(0, 1)
    learner.setup(model_dir, lrn, loss_cfg, n_per_prompt=int(conf.rollout.n), temperature=float(conf.rollout.temperature),
                  dtype=str(conf.model.dtype), seed=int(conf.trainer.seed),
                  max_response_length=int(conf.rollout.max_response_length), master_port=free_port())
    return learner, loss_cfg


def page(batch, result, loss_cfg, d, decode, out_dir: str, mini_rows: int) -> float:
    """Seconds to draw the trace page of one step (with the counts it shows)."""
    from stapoctl.tracking.token_diagnostics import diagnose, write_page

    t0 = time.perf_counter()
    counts = diagnose(batch.response_ids, batch.response_mask, batch.advantages, result.old_log_probs, result.entropy,
                      tau_p=float(loss_cfg["tau_p"]), tau_h=float(loss_cfg["tau_h"]), mini_rows=mini_rows).counts
    write_page(out_dir, batch, result.old_log_probs, result.entropy, loss_cfg, step=1, mini_rows=mini_rows,
               decode=decode, drift=d, seed=0, counts=counts)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    import torch
    from rich.console import Console
    from transformers import AutoTokenizer

    import stapoctl.losses as L

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.base_args(p, repeats=40)
    a = p.parse_args(argv)
    console = Console()
    repeats = 3 if a.quick else a.repeats
    env = H.environment()
    t_start = time.perf_counter()
    conf = _peers.compose([])
    mdir = _peers.model_dir("tiny", conf)
    batch, rewards = fixed_batch(conf, mdir)
    learner, loss_cfg = make_learner(conf, mdir)
    batch = batch.with_(rewards=rewards, advantages=L.compute_advantages("stapo", rewards, batch.group_ids, **loss_cfg))
    decode = AutoTokenizer.from_pretrained(mdir).decode
    mini_rows = int(conf.learner.ppo_mini_batch_size) * int(conf.rollout.n)
    import concurrent.futures

    from stapoctl.losses.drift import drift
    from stapoctl.trainer.inert import loss_config

    cfg = loss_config(loss_cfg)
    on, off, drift_s, pages = [], [], [], []
    out_dir = tempfile.mkdtemp(prefix="stapoctl-bench-page-")
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stapoctl-diagnostics")
    try:
        first = learner.train_step(batch, 1)  # warm-up; vLLM's stand-in log-probs: the learner's, perturbed
        g = torch.Generator().manual_seed(0)
        noise = 0.05 * torch.randn(first.old_log_probs.shape, generator=g)
        batch = batch.with_(rollout_log_probs=torch.where(batch.response_mask, first.old_log_probs + noise, 0.0))
        for r in range(repeats):
            for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
                t0 = time.perf_counter()
                result = learner.train_step(batch, r + 2)
                if side == "on":
                    t1 = time.perf_counter()
                    d = drift(cfg, learner_log_prob=result.old_log_probs, rollout_log_prob=batch.rollout_log_probs,
                              entropy=result.entropy, advantages=batch.advantages,
                              response_mask=batch.response_mask, mini_rows=mini_rows)
                    drift_s.append(time.perf_counter() - t1)
                    if r % PAGE_EVERY == 0:
                        pages.append(pool.submit(page, batch, result, loss_cfg, d, decode, out_dir, mini_rows))
                (on if side == "on" else off).append(time.perf_counter() - t0)
    finally:
        pool.shutdown(wait=True)
        learner.shutdown()
    page_s = [f.result() for f in pages]
    paired = H.summary([x / y for x, y in zip(on, off)])["median"]
    page_kb = (Path(out_dir) / "tokens.html").stat().st_size / 1024
    row = H.row(
        "token_trace_overhead", "trace page + drift per rule beside the learner step, embedded tiny",
        ours=on, peer=off, unit="s", lower_is_better=True, ratio=paired, target=TARGET, target_max=True,
        target_text=f"≤ {TARGET}× (+{(TARGET - 1) * 100:.0f}%)", ours_label="page + drift on", peer_label="off",
        checks=[H.check("batch", True, f"one fixed batch, {len(batch)} rows, {int(batch.response_mask.sum())} "
                                       "response tokens, lr 0, loss=stapo + shadow stapo_prob_only"),
                H.check("page", page_kb > 0, f"tokens.html {page_kb:.0f} KiB")],
        notes=(f"drift {H.fmt(H.summary(drift_s)['median'], 's')} on every step (in training: on measured steps; "
               f"bf16 measures every step), page {H.fmt(H.summary(page_s)['median'], 's')} on a background thread "
               f"every {PAGE_EVERY} steps ({len(page_s)} drawn here): {H.fmt(H.summary(page_s)['median'], 's')} on "
               "the critical path would be the upper bound."),
        extra={"drift_s": H.summary(drift_s), "page_s": H.summary(page_s), "page_kib": page_kb},
    )
    H.print_rows([row], console, title=f"token_trace_overhead ({time.perf_counter() - t_start:.0f} s)")
    H.publish("token_trace_overhead", [row], a, console, config={"repeats": repeats},
              seconds=time.perf_counter() - t_start, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
