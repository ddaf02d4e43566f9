"""Per-trial overhead of `stapoctl sweep` on warm engines, and where it goes.

    python benchmarks/sweep_overhead.py [--trials 3] [--steps 60] [args passed to the sweep ...]

Runs a `tau_p` sweep of N trials (one seed) in this process on the embedded tiny experiment and
times each phase of every trial. Overhead = trial wall time − (Σ step time + Σ validation time),
the number the sweep itself logs as `sweep/trial_overhead_s`; the target for trials on reused
engines is ≤ 10 s (the issue), against ~45-70 s of engine start-up each trial would pay alone.
The first trial starts the engines, so it is reported but not counted in the reused mean.
`run(...)` returns the numbers as a dict for `stapoctl bench`.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections import defaultdict
from typing import Any

TARGET_S = 10.0
# phase → (module path, attribute); each call's wall time is added to the current trial
PHASES = {
    "model resolve": ("stapoctl.trainer.setup", "resolve_policy"),
    "data + tokenize": ("stapoctl.trainer.setup", "prepare_data"),
    "mlflow config params": ("stapoctl.tracking.mlflow_run", "log_config"),
    "mlflow env tags": ("stapoctl.tracking.mlflow_run", "env_snapshot"),
    "mlflow per-step metrics": ("stapoctl.tracking.mlflow_run", "log_metrics"),
    "mlflow set_tag(s)": ("mlflow", "set_tag"),
    "mlflow set_tags": ("mlflow", "set_tags"),
    "engines acquire (reset+sync)": ("stapoctl.trainer.session.EngineSession", "acquire"),
    "checkpoint save": ("stapoctl.trainer.loop", "_save"),
    "samples artifact": ("stapoctl.trainer.loop", "_log_samples"),
    "base eval read": ("stapoctl.models.tiny", "base_eval"),
    "sweep bookkeeping": ("stapoctl.sweep.store", "log_trial_timing"),
    "sweep finished-check": ("stapoctl.sweep.store", "trial_finished"),
    "(steps)": ("stapoctl.trainer.step_runner.StepRunner", "run"),
    "(validation)": ("stapoctl.trainer.loop", "_validate"),
}


def _resolve(path: str):
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def run(trials: int = 3, steps: int = 60, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    from rich.console import Console

    from stapoctl.sweep.runner import sweep_command

    per_trial: list[dict[str, float]] = []
    current: dict[str, float] = defaultdict(float)
    depth = {"n": 0}  # time only the outermost timed call (log_metrics inside _validate etc. nest)

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            outer = depth["n"] == 0 or name.startswith("(")
            depth["n"] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth["n"] -= 1
                if outer:
                    current[name] += time.perf_counter() - t0
        return wrapper

    import stapoctl.sweep.runner as runner
    import stapoctl.trainer.driver as driver

    real_train, real_compose = driver.train, runner.compose_trial

    def compose_trial(*a, **k):  # a trial starts with its compose
        nonlocal current
        current = defaultdict(float)
        per_trial.append(current)
        t0 = time.perf_counter()
        try:
            return real_compose(*a, **k)
        finally:
            current["compose"] += time.perf_counter() - t0

    def train(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_train(*a, **k)
        finally:
            current["train() wall"] = time.perf_counter() - t0

    originals = []
    for name, (owner_path, attr) in PHASES.items():
        owner = _resolve(owner_path)
        originals.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    originals += [(driver, "train", real_train), (runner, "compose_trial", real_compose)]
    driver.train, runner.compose_trial = train, compose_trial
    values = ["2e-3", "2e-2", "2e-1", "1e-1", "5e-2", "1e-2"][:trials]
    with tempfile.TemporaryDirectory() as tmp:
        args = [f"values=[{','.join(values)}]", "seeds=[0]", f"trainer.total_steps={steps}",
                f"tracking.uri=sqlite:///{tmp}/mlflow.db", *extra]
        console = Console(record=True, width=140)
        t0 = time.perf_counter()
        try:
            code = sweep_command("tau_p", args, console)
        finally:
            for owner, attr, fn in originals:
                setattr(owner, attr, fn)
        total = time.perf_counter() - t0
        text = console.export_text()
    rows = []
    for i, p in enumerate(p for p in per_trial if "train() wall" in p):
        work = p.get("(steps)", 0.0) + p.get("(validation)", 0.0)
        rows.append({"trial": i + 1, "wall_s": p["train() wall"] + p.get("compose", 0.0) + p.get("sweep bookkeeping", 0.0)
                     + p.get("sweep finished-check", 0.0), "work_s": work, **p})
        rows[-1]["overhead_s"] = rows[-1]["wall_s"] - work
    reused = [r["overhead_s"] for r in rows[1:]]
    return {"exit_code": code, "total_s": total, "trials": rows, "target_s": TARGET_S,
            "mean_reused_overhead_s": sum(reused) / len(reused) if reused else None, "log_tail": text[-1500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    known, extra = parser.parse_known_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = run(known.trials, known.steps, tuple(extra))
    from rich.console import Console
    from rich.table import Table

    rows = out["trials"]
    names = ["compose", *(n for n in PHASES if any(n in r for r in rows))]
    table = Table(title=f"sweep trial overhead ({known.steps} steps per trial; target ≤ {TARGET_S:.0f} s on reused engines)")
    table.add_column("phase (s)")
    for r in rows:
        table.add_column(f"trial {r['trial']}" + (" (engines start)" if r["trial"] == 1 else ""), justify="right")
    for key in ("wall_s", "work_s", "overhead_s"):
        table.add_row(f"[bold]{key}", *(f"{r[key]:.2f}" for r in rows))
    for name in names:
        table.add_row(name, *(f"{r.get(name, 0.0):.2f}" for r in rows))
    Console().print(table)
    mean = out["mean_reused_overhead_s"]
    if mean is not None:
        verdict = "meets" if mean <= TARGET_S else "MISSES"
        print(f"mean overhead on reused engines: {mean:.2f} s ({verdict} the ≤ {TARGET_S:.0f} s target); "
              f"sweep exit code {out['exit_code']}")


if __name__ == "__main__":
    main()
