"""Peak extra memory of chunked token_stats vs the naive log_softmax + entropy, side by side.

    stapoctl bench token_stats_memory [--repeats 5] [--tokens 1024] [--vocab 151936] [--dtype bfloat16]

Each variant runs forward + backward (gradient of sum(log_prob) w.r.t. the logits, the way the
learner uses it) on a [1, N, V] logits tensor that already exists; "extra" is the peak memory
above that point, reported as a multiple of one [B, T, V] logits tensor in the model dtype
(issue target for chunked: <= 1.3x; the gradient w.r.t. the logits alone is 1.0x).

CUDA: ``torch.cuda.max_memory_allocated`` in-process. CPU: each variant runs in its own
subprocess and the peak is ``ru_maxrss`` minus the resident size measured just before the
call (torch's CPU allocator is invisible to tracemalloc). ``run(...)`` returns the numbers as a
dict; ``--repeats N`` measures each variant N times (a fresh subprocess each) and writes the
row to benchmarks/results/token_stats_memory.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Optional

import torch

TARGET = 1.3
VARIANTS = ("naive", "chunked", "chunked_hidden")


def _naive(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """verl-style reference: fp32 log_softmax + gather, entropy = lse - sum(softmax * logits)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    p = torch.softmax(z, dim=-1)
    ent = torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
    return ent.detach(), logp


def _fill(t: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """Random fill in row chunks, so that no full-size fp32 temporary precedes the measurement."""
    flat = t.view(-1, t.shape[-1])
    g = torch.Generator(device=t.device).manual_seed(0)
    for s in range(0, flat.shape[0], rows):
        flat[s : s + rows] = torch.randn(flat[s : s + rows].shape, generator=g, device=t.device).to(t.dtype) * 2
    return t


def _one(variant: str, tokens: int, vocab: int, dtype: str, chunk_size: int, hidden_size: int, device: str):
    """Build the inputs, then time and run forward + backward of one variant (caller measures memory)."""
    from stapoctl.losses import token_stats

    dt = getattr(torch, dtype)
    labels = torch.randint(0, vocab, (1, tokens), device=device)
    if variant == "chunked_hidden":
        hidden = _fill(torch.empty(1, tokens, hidden_size, dtype=dt, device=device)).requires_grad_(True)
        weight = (_fill(torch.empty(vocab, hidden_size, dtype=dt, device=device)) * 0.05).requires_grad_(True)
        inputs: tuple = (hidden, weight)

        def call():
            _, lp = token_stats(hidden, labels, lm_head_weight=weight, chunk_size=chunk_size)
            return torch.autograd.grad(lp.sum(), (hidden, weight))
    else:
        logits = _fill(torch.empty(1, tokens, vocab, dtype=dt, device=device)).requires_grad_(True)
        inputs = (logits,)

        def call():
            if variant == "naive":
                _, lp = _naive(logits, labels)
            else:
                _, lp = token_stats(logits, labels, chunk_size=chunk_size)
            return torch.autograd.grad(lp.sum(), logits)

    return inputs, call


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure_cpu_worker(variant: str, tokens: int, vocab: int, dtype: str, chunk_size: int, hidden_size: int) -> dict:
    _, warm = _one(variant, 4, 1000, dtype, 2, 16, "cpu")
    warm()  # load the kernels' code pages first: they count in RSS but are not tensor memory
    del warm
    inputs, call = _one(variant, tokens, vocab, dtype, chunk_size, hidden_size, "cpu")
    gc.collect()
    rss0 = _rss_bytes()
    max0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    grads = call()
    seconds = time.perf_counter() - t0
    max1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del grads
    return {"peak_extra_bytes": max(0, max1 - rss0), "seconds": seconds,
            "warning": "pre-call peak above resident size" if max0 > rss0 + (64 << 20) and max1 <= max0 else ""}


def _measure_cuda(variant: str, tokens: int, vocab: int, dtype: str, chunk_size: int, hidden_size: int, device: str):
    inputs, call = _one(variant, tokens, vocab, dtype, chunk_size, hidden_size, device)
    call()  # warm-up (cuBLAS workspaces, allocator)
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    grads = call()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - base
    del grads, inputs, call
    gc.collect()
    torch.cuda.empty_cache()
    return {"peak_extra_bytes": int(peak), "seconds": seconds, "warning": ""}


def run(
    *,
    tokens: int = 1024,
    vocab: int = 151_936,
    dtype: str = "bfloat16",
    chunk_size: int = 64,
    hidden_size: int = 2048,
    variants: Optional[tuple[str, ...]] = None,
    device: Optional[str] = None,
) -> dict[str, Any]:
    """Measure each variant; returns sizes, per-variant peak extra bytes, ratios and the verdict."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if variants is None:
        # the hidden-state path is matmul-bound: only by default where matmuls are cheap
        variants = VARIANTS if device.startswith("cuda") else ("naive", "chunked")
    logits_bytes = tokens * vocab * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    results: dict[str, Any] = {}
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r} (choose from {', '.join(VARIANTS)})")
        if device.startswith("cuda"):
            r = _measure_cuda(variant, tokens, vocab, dtype, chunk_size, hidden_size, device)
        else:
            args = json.dumps([variant, tokens, vocab, dtype, chunk_size, hidden_size])
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", args],
                                 capture_output=True, text=True, check=True, env=env)
            r = json.loads(out.stdout.strip().splitlines()[-1])
        r["ratio_to_logits"] = r["peak_extra_bytes"] / logits_bytes
        results[variant] = r
    summary: dict[str, Any] = {
        "device": device if device == "cpu" else torch.cuda.get_device_name(device),
        "measure": "cuda max_memory_allocated" if device.startswith("cuda") else "ru_maxrss delta per subprocess",
        "tokens": tokens, "vocab": vocab, "dtype": dtype, "chunk_size": chunk_size,
        "logits_bytes": logits_bytes, "target_ratio": TARGET, "variants": results,
    }
    if "chunked" in results:
        summary["chunked_meets_target"] = results["chunked"]["ratio_to_logits"] <= TARGET
    if "chunked" in results and "naive" in results:
        summary["naive_over_chunked"] = results["naive"]["peak_extra_bytes"] / max(1, results["chunked"]["peak_extra_bytes"])
    return summary


def _print(summary: dict[str, Any]) -> None:
    mib = 1 << 20
    print(f"token_stats memory, {summary['device']} ({summary['measure']})")
    print(f"[1, {summary['tokens']}, {summary['vocab']}] {summary['dtype']} logits = "
          f"{summary['logits_bytes'] / mib:.0f} MiB; chunk_size = {summary['chunk_size']}")
    print(f"{'variant':<16}{'peak extra MiB':>16}{'x logits':>10}{'seconds':>10}")
    for name, r in summary["variants"].items():
        print(f"{name:<16}{r['peak_extra_bytes'] / mib:>16.0f}{r['ratio_to_logits']:>10.2f}{r['seconds']:>10.2f}"
              + (f"  ({r['warning']})" if r.get("warning") else ""))
    if "chunked_meets_target" in summary:
        verdict = "meets" if summary["chunked_meets_target"] else "MISSES"
        print(f"chunked {verdict} the <= {summary['target_ratio']}x target", end="")
        if "naive_over_chunked" in summary:
            print(f"; naive needs {summary['naive_over_chunked']:.1f}x the chunked peak", end="")
        print()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=1024, help="B*T positions (default 1024)")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--variants", default=None, help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--device", default=None)
    p.add_argument("--json", action="store_true", help="print the dict as JSON")
    p.add_argument("--repeats", type=int, default=5, help="measurements per variant (default 5)")
    p.add_argument("--quick", action="store_true", help="one measurement per variant; nothing saved")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--write-docs", action="store_true", help="rewrite the table in docs/PERFORMANCE.md")
    a = p.parse_args(argv)
    if a.worker:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        print(json.dumps(_measure_cpu_worker(*json.loads(a.worker))))
        return 0
    if a.quick:
        a.repeats = 1
    t0 = time.perf_counter()
    runs = [run(tokens=a.tokens, vocab=a.vocab, dtype=a.dtype, chunk_size=a.chunk_size, hidden_size=a.hidden_size,
                variants=tuple(a.variants.split(",")) if a.variants else None, device=a.device)
            for _ in range(max(1, a.repeats))]
    print(json.dumps(runs[-1], indent=2)) if a.json else _print(runs[-1])
    if not a.json:
        _bench_row(runs, a, seconds=time.perf_counter() - t0)
    return 0


def _bench_row(runs: list[dict[str, Any]], args: argparse.Namespace, *, seconds: float) -> None:
    """The `stapoctl bench` row: chunked peak as a multiple of one logits tensor (target <= 1.3)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _harness as H

    first = runs[0]
    mib = 1 << 20
    peaks = {v: [r["variants"][v]["peak_extra_bytes"] / mib for r in runs if v in r["variants"]]
             for v in first["variants"]}
    ratios = [r["variants"]["chunked"]["ratio_to_logits"] for r in runs if "chunked" in r["variants"]]
    ratio = H.summary(ratios)["median"]
    row = H.row(
        "token_stats_memory", f"log-prob + entropy over vocab {first['vocab']:,}: peak extra memory",
        ours=peaks.get("chunked"), peer=peaks.get("naive"), unit="MiB", lower_is_better=True, ratio=ratio,
        target=TARGET, target_max=True, target_text=f"≤ {TARGET}× the logits tensor",
        ours_label="chunked token_stats", peer_label="naive log_softmax + entropy",
        checks=[H.check("shape", True, f"[1, {first['tokens']}, {first['vocab']}] {first['dtype']} logits "
                                       f"({first['logits_bytes'] / mib:.0f} MiB) both, forward + backward")],
        notes=(f"ratio = chunked peak / one logits tensor (median of {len(ratios)}); naive needs "
               f"{H.summary([r.get('naive_over_chunked') for r in runs])['median'] or float('nan'):.1f}x "
               f"the chunked peak; {first['measure']}."),
    )
    from rich.console import Console

    console = Console()
    H.print_rows([row], console)
    args.out = args.out or str(H.RESULTS)
    H.publish("token_stats_memory", [row], args, console,
              config={k: first[k] for k in ("tokens", "vocab", "dtype", "chunk_size")}, seconds=seconds,
              env=H.environment(), extra={"runs": runs})


if __name__ == "__main__":
    sys.exit(main())
