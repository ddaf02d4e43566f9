"""The ZeRO-3 forward's peak memory with transformers' `logits_to_keep` (the response positions'
logits only) against the forward before it (every position's logits, the prompt's thrown away).

    stapoctl bench zero3_logits [--repeats 3] [--quick] [--prompt 1024] [--response 64]

stapoctl's DeepSpeed `Learner` (one rank, gloo, fp32, ZeRO-3, in the process as
tests/test_learner.py runs it) on a random Qwen3 of ~25M parameters with Qwen3's own vocabulary
of 151,936 (h128, 22 layers, tied embeddings: the vocabulary is where the logits' size comes
from), one micro-batch of 2 rows of a long prompt and a short response. Two passes, each side in
a fresh process per sample:
- `forward`: `compute_log_probs`, the no-grad forward every step runs for the old log-probs;
- `step`: a `train_step` (that pass, then forward + backward of the GRPO loss; lr 0).
Peak = the process's high-water RSS during the call (reset before it through
/proc/self/clear_refs) minus its resident size just before. "before" is the forward as it was:
`learner.forward._keeps_logits` patched to False, so the module computes every position's logits
and the loss slices the response's; "after" is the code as shipped. Same-work check: both sides'
log-probs are the same numbers (max |Δ| = 0 expected, ≤ 1e-6 accepted).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

SHAPE = dict(vocab_size=151_936, hidden_size=128, intermediate_size=512, num_hidden_layers=22,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
             tie_word_embeddings=True)
ROWS = 2
PASSES = ("forward", "step")
MIB = 1 << 20


def model_dir() -> str:
    """The random model, built once and cached under $STAPOCTL_HOME/models."""
    from stapoctl import paths

    final = paths.home() / "models" / "bench-random-25m-vocab152k"
    if not (final / "config.json").is_file():
        import shutil
        import tempfile

        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**SHAPE)).save_pretrained(tmp)
        try:
            os.rename(tmp, final)  # whole or not at all; a concurrent build's dir wins
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def _batch(prompt: int, response: int, seed: int = 0):
    """One prompt, ROWS responses at full length (the forward's widest), ±1 rewards."""
    import torch

    from stapoctl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    p = torch.randint(10, SHAPE["vocab_size"], (prompt,), generator=g).tolist()
    rs = [torch.randint(10, SHAPE["vocab_size"], (response,), generator=g).tolist() for _ in range(ROWS)]
    batch = RolloutBatch.from_token_lists([p], [rs], [[[0.0] * response] * ROWS], [[False] * ROWS], [[""] * ROWS],
                                          pad_id=0)
    rewards = torch.tensor([1.0, -1.0] * (ROWS // 2))
    return batch, rewards


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _high_water() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def worker(payload: dict) -> dict:
    """In a fresh process: one side's peak over one pass, and its log-probs."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dataclasses import asdict

    import torch

    import stapoctl.losses as L
    from stapoctl.config.schema import LearnerConfig
    from stapoctl.learner import forward
    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.learner.engine_setup import free_port

    if payload["side"] == "before":
        forward._keeps_logits = lambda module: False  # every position's logits, as before
    prompt, response = payload["prompt"], payload["response"]
    lcfg = asdict(LearnerConfig())
    lcfg.update(zero_stage=3, lr=0.0, warmup_steps=0, micro_batch_size=ROWS, ppo_mini_batch_size=1, cpus=2,
                shared_prefix=False, gradient_checkpointing=False)
    loss_cfg = dict(vars(L.LOSSES["grpo"].config_cls()))
    lrn = Learner(0, 1)
    lrn.setup(payload["model"], lcfg, loss_cfg, n_per_prompt=ROWS, temperature=1.0, dtype="float32", seed=0,
              max_response_length=response, master_port=free_port())
    small, _ = _batch(8, 4, seed=1)
    lrn.compute_log_probs(small)  # the kernels' first use, outside the measurement
    batch, rewards = _batch(prompt, response)
    batch = batch.with_(rewards=rewards, advantages=L.compute_advantages("grpo", rewards, batch.group_ids, **loss_cfg))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the resident size now
    rss0, t0 = _rss(), time.perf_counter()
    if payload["pass"] == "forward":
        log_prob = lrn.compute_log_probs(batch)["log_prob"]
    else:
        log_prob = lrn.train_step(batch, 1).old_log_probs
    seconds = time.perf_counter() - t0
    peak = _high_water() - rss0
    lrn.shutdown()
    return {"peak_bytes": peak, "seconds": seconds, "log_prob": torch.as_tensor(log_prob).float().tolist()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.base_args(p, repeats=3)
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens per row (default 1024)")
    p.add_argument("--response", type=int, default=64, help="response tokens per row (default 64)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return 0
    from rich.console import Console

    from stapoctl.config.shapes import decoder_params

    console = Console()
    if a.quick:
        a.repeats = 1
    t0 = time.perf_counter()
    model = model_dir()
    runs: dict[str, dict[str, list[dict]]] = {ps: {"before": [], "after": []} for ps in PASSES}
    for ps in PASSES:
        for _ in range(max(1, a.repeats)):
            for side in ("before", "after"):  # alternating: drift on a shared machine hits both
                runs[ps][side].append(H.run_worker(Path(__file__), {"model": model, "side": side, "pass": ps,
                                                                     "prompt": a.prompt, "response": a.response}))
    params = decoder_params(SHAPE)
    rows = [_row(ps, runs[ps], a, params) for ps in PASSES]
    H.print_rows(rows, console, title="ZeRO-3 forward: response logits only vs every position's")
    H.publish("zero3_logits", rows, a, console, seconds=time.perf_counter() - t0, env=H.environment(),
              config={"shape": SHAPE, "params": params, "rows": ROWS, "prompt": a.prompt, "response": a.response},
              extra={ps: {side: [{k: v for k, v in r.items() if k != "log_prob"} for r in rs]
                          for side, rs in runs[ps].items()} for ps in PASSES})
    return 0


def _row(ps: str, runs: dict[str, list[dict]], a, params: int) -> dict:
    before, after = runs["before"], runs["after"]
    diff = max(abs(x - y) for b, f in zip(before, after)
               for xs, ys in zip(b["log_prob"], f["log_prob"]) for x, y in zip(xs, ys))
    full = ROWS * (a.prompt + a.response) * SHAPE["vocab_size"] * 4
    kept = ROWS * (a.response + 1) * SHAPE["vocab_size"] * 4
    what = ("compute_log_probs (no grad)" if ps == "forward" else "train_step (forward + backward)")
    return H.row(
        f"zero3_logits_{ps}", f"ZeRO-3 {what}, {params / 1e6:.1f}M Qwen3 with vocab 151,936, "
                             f"{ROWS} × ({a.prompt} + {a.response}) tokens, CPU fp32: peak memory",
        ours=[r["peak_bytes"] / MIB for r in after], peer=[r["peak_bytes"] / MIB for r in before], unit="MiB",
        lower_is_better=True, target=1.0, target_text="< before (ratio > 1×)",
        ours_label="logits_to_keep (response + 1 positions)", peer_label="every position's logits (before)",
        checks=[H.check("same log-probs", diff <= 1e-6, f"max |Δ log-prob| = {diff:.3g} over "
                                                      f"{ROWS} × {a.response} tokens")],
        notes=(f"one [B, T, V] fp32 logits tensor: {full / MIB:.0f} MiB at every position, {kept / MIB:.0f} MiB "
               f"kept; peak = VmHWM during the call − RSS before it, a fresh process per sample; "
               f"seconds before/after {_median(before, 'seconds'):.2f}/{_median(after, 'seconds'):.2f}."),
    )


def _median(rs: list[dict], key: str) -> float:
    return H.summary([r[key] for r in rs])["median"] or float("nan")


if __name__ == "__main__":
    sys.exit(main())
