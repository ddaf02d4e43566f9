"""`stapoctl bench all` and `stapoctl bench docs`: every benchmark script in turn, then the table
in docs/PERFORMANCE.md rewritten from the saved results and printed.

    python benchmarks/_suite.py all [--quick] [--repeats N] ...   # options pass to every script
    python benchmarks/_suite.py docs                              # only rewrite the docs table

A script that fails (e.g. TRL missing) does not stop the others; the exit code says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

HERE = Path(__file__).resolve().parent
# cheap first, so a broken set-up shows in seconds; the 25M rows last
FIRST = ("token_stats_memory", "loss_overhead", "learning", "rl_step")


# scripts `stapoctl bench NAME` runs, but `all` does not: they have no peer and write no row
NOT_IN_ALL = (
    "sweep_overhead",  # per-trial overhead of a sweep on reused engines (docs/SWEEPS.md), ~6 min
    "sweep_summary",  # a report over a finished sweep: needs its id
    "grid_shares",  # docs/RESULTS.md's token-grid mechanism table: a report over a finished grid sweep
    "gpu_learner",  # the learner step on a CUDA GPU (results/gpu/): `all` runs on the machine at hand
    "gpu_kit",  # a lent GPU's one call: learner memory vs the plan, CUDA IPC, NCCL (results/gpu/)
)


def scripts() -> dict[str, Path]:
    """The side-by-side benchmarks `all` runs: benchmarks/*.py except `_` modules and NOT_IN_ALL."""
    found = {p.stem: p for p in sorted(HERE.glob("*.py"))
             if not p.stem.startswith("_") and p.stem not in NOT_IN_ALL}
    order = [n for n in FIRST if n in found] + [n for n in found if n not in FIRST]
    return {n: found[n] for n in order}


def latest_rows(results: Path) -> list[dict]:
    rows = []
    for path in sorted(results.glob("*.json")):
        rows += json.loads(path.read_text()).get("rows", [])
    rank = {k: i for i, k in enumerate(H.ORDER)}
    return sorted(rows, key=lambda r: (rank.get(r["key"], len(H.ORDER)), r["key"]))


def main(argv: list[str]) -> int:
    from rich.console import Console

    console = Console()
    what, args = (argv[0] if argv else "all"), argv[1:]
    out = Path(args[args.index("--out") + 1]) if "--out" in args else H.RESULTS
    if what == "docs":
        console.print(f"rewrote {H.write_docs(out)} from {out}")
        return 0
    load = os.getloadavg()[0]
    if load > 1.5:
        console.print(f"[yellow]warning:[/] load average {load:.1f} on {os.cpu_count()} cores: other work is "
                      "running and the timings will be noisy (run when nothing else does: a 1-minute load "
                      "average below 1.5, see `uptime`)")
    failed, t0 = [], time.perf_counter()
    for name, path in scripts().items():
        console.rule(f"[bold]bench {name}")
        rc = subprocess.call([sys.executable, str(path), *args])
        if rc:
            failed.append(f"{name} (exit {rc})")
    total = time.perf_counter() - t0
    if "--quick" not in args:
        H.write_docs(out)
        console.rule("[bold]all rows (latest saved results)")
        H.print_rows(latest_rows(out), console, title=f"stapoctl bench all: {total / 60:.1f} min")
        console.print(f"table written to {H.DOCS.relative_to(H.ROOT)}; results in {out}")
    console.print(f"bench all took {total / 60:.1f} min" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
