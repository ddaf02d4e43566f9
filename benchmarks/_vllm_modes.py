"""vLLM engine modes on this CPU: what each costs at start-up and saves per rollout.

    python benchmarks/_vllm_modes.py [--size tiny|25m] [--modes eager,eager-dynamo,compile,eager-block128] [--threads 2] [--calls 8]

Modes: `eager` (the rollout actor's engine: 32-token blocks, prefix caching, dynamo off),
`eager-dynamo` (the same with vLLM's torch.compiled log-prob rank helper, compiled at the
first call), `compile` (the model under torch.compile), `eager-block128` (vLLM-CPU's default
128-token blocks without prefix caching). Each mode runs in a fresh process (so engine
init includes the vLLM import, as in the rollout actor): `make_llm` in-process exactly as the
actor builds it, then `--calls` rollouts, each of the next 8 toy training prompts × 8 samples,
≤ 48 new tokens, T = 1.0, per-prompt seeds (the trainer's call), the prefix cache reset after
each (as after a weight sync). Prints engine init, the first call (warm-up), the median of the
later calls and a hash of every sampled token and log-prob: equal hashes, equal samples.
torch.compile caches its artefacts under ~/.cache/vllm: the first compile run pays more than
later ones. A diagnostic (no peer, no target): not part of `stapoctl bench all`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _peers  # noqa: E402


# mode → (enforce_eager, extra engine kwargs, environment); "eager" is the rollout actor's engine
# (`rollout_env` sets TORCHDYNAMO_DISABLE=1 in eager mode on CPU), "eager-dynamo" the same with
# vLLM's one torch.compiled sampler helper left on (the actor before that), "eager-block128" the
# engine before the actor took 32-token blocks and prefix caching (no block of a short prompt is full)
NO_DYNAMO = {"TORCHDYNAMO_DISABLE": "1"}
MODES = {"eager": (True, {}, NO_DYNAMO), "eager-dynamo": (True, {}, {}), "compile": (False, {}, {}),
         "eager-block128": (True, {"block_size": 128, "enable_prefix_caching": False}, NO_DYNAMO)}


def worker(p: dict) -> dict:
    import os

    import torch

    from stapoctl.rollout.vllm_engine import EngineSpec, generate, make_llm

    torch.set_num_threads(int(p["threads"]))  # as the rollout actor does before vLLM is up
    eager, extra, env = MODES[p["mode"]]
    os.environ.update(env)  # before vLLM is imported, as in the actor's runtime_env
    t0 = time.perf_counter()
    llm = make_llm(EngineSpec(model_path=p["model"], max_model_len=int(p["max_model_len"]),
                              enforce_eager=eager, num_threads=int(p["threads"]), extra=dict(extra)))
    init_s = time.perf_counter() - t0
    calls, tokens, samples = [], 0, []
    for c, prompts in enumerate(p["prompts"]):  # a new batch each call, as in training
        t0 = time.perf_counter()
        out = generate(llm, prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=48,
                       seed=[1000 * c + i for i in range(len(prompts))])
        calls.append(time.perf_counter() - t0)
        llm.reset_prefix_cache()  # as after every weight sync
        tokens = sum(len(s.token_ids) for group in out for s in group)
        samples.append([[s.token_ids, s.logprobs] for group in out for s in group])
    digest = hashlib.sha256(json.dumps(samples).encode()).hexdigest()[:16]
    return {"mode": p["mode"], "init_s": init_s, "calls_s": calls, "tokens_last_call": tokens, "samples_sha": digest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=sorted(_peers.SIZES) + ["tiny"])
    ap.add_argument("--modes", default="eager,compile", help=f"comma-separated, of {sorted(MODES)}")
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
    from stapoctl.trainer.engine_settings import max_model_len

    conf = _peers.compose([])  # the embedded default (experiments/tiny.yaml)
    model = _peers.model_dir(args.size, conf)
    rows = _peers.train_rows(conf, model)[: 8 * args.calls]
    ids = load_tokenizer(model)([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    prompts = [ids[8 * c: 8 * c + 8] for c in range(args.calls)]
    table = Table(title=f"vLLM modes, {args.size}, {args.threads} thread(s), 8 new prompts × 8 per call, ≤ 48 tokens")
    for col in ("mode", "engine init (incl. import)", "first call", f"median of calls 2–{args.calls}", "tokens/call",
                "samples (sha256 of tokens + log-probs)"):
        table.add_column(col)
    for mode in args.modes.split(","):
        r = H.run_worker(Path(__file__), {"mode": mode, "model": model, "threads": args.threads, "calls": args.calls,
                                          "prompts": prompts, "max_model_len": max_model_len(conf, model)})
        table.add_row(mode, f"{r['init_s']:.1f} s", f"{r['calls_s'][0]:.2f} s",
                      f"{statistics.median(r['calls_s'][1:]):.3f} s", str(r["tokens_last_call"]), r["samples_sha"])
    Console().print(table)


if __name__ == "__main__":
    main()
