"""vLLM eager vs torch.compile on this CPU: what each costs at start-up and saves per rollout.

    python benchmarks/_vllm_modes.py [--size tiny|25m] [--modes eager,compile] [--threads 2] [--calls 8]

Each mode runs in a fresh process (so engine init includes the vLLM import, as in the rollout
actor): `make_llm` in-process exactly as the actor builds it, then `--calls` rollouts of the
toy's first 8 training prompts × 8 samples, ≤ 48 new tokens, T = 1.0, per-prompt seeds (the
trainer's call). Prints engine init, the first call (warm-up) and the median of the later calls.
torch.compile caches its artefacts under ~/.cache/vllm: the first compile run pays more than
later ones. A diagnostic (no peer, no target): not part of `stapoctl bench all`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _peers  # noqa: E402


def worker(p: dict) -> dict:
    import torch

    from stapoctl.rollout.vllm_engine import EngineSpec, generate, make_llm

    torch.set_num_threads(int(p["threads"]))  # as the rollout actor does before vLLM is up
    t0 = time.perf_counter()
    llm = make_llm(EngineSpec(model_path=p["model"], max_model_len=int(p["max_model_len"]),
                              enforce_eager=p["mode"] == "eager", num_threads=int(p["threads"])))
    init_s = time.perf_counter() - t0
    calls, tokens = [], 0
    for c in range(int(p["calls"])):
        t0 = time.perf_counter()
        out = generate(llm, p["prompts"], n=8, temperature=1.0, top_p=1.0, max_tokens=48,
                       seed=[1000 * c + i for i in range(len(p["prompts"]))])
        calls.append(time.perf_counter() - t0)
        tokens = sum(len(s.token_ids) for group in out for s in group)
    return {"mode": p["mode"], "init_s": init_s, "calls_s": calls, "tokens_last_call": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=sorted(_peers.SIZES) + ["tiny"])
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    from rich.console import Console
    from rich.table import Table

    from stapoctl.data.templates import load_tokenizer
    from stapoctl.trainer.engines import max_model_len

    conf = _peers.compose([])  # the embedded default (experiments/tiny.yaml)
    model = _peers.model_dir(args.size, conf)
    rows = _peers.train_rows(conf, model)[:8]
    prompts = load_tokenizer(model)([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    table = Table(title=f"vLLM modes, {args.size}, {args.threads} thread(s), 8 prompts × 8, ≤ 48 tokens")
    for col in ("mode", "engine init (incl. import)", "first call", f"median of calls 2–{args.calls}", "tokens/call"):
        table.add_column(col)
    for mode in args.modes.split(","):
        r = H.run_worker(Path(__file__), {"mode": mode, "model": model, "threads": args.threads, "calls": args.calls,
                                          "prompts": prompts, "max_model_len": max_model_len(conf, model)})
        table.add_row(mode, f"{r['init_s']:.1f} s", f"{r['calls_s'][0]:.2f} s",
                      f"{statistics.median(r['calls_s'][1:]):.3f} s", str(r["tokens_last_call"]))
    Console().print(table)


if __name__ == "__main__":
    main()
