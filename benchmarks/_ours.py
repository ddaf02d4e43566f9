"""The stapoctl side: real `stapoctl train` runs, read back from the MLflow store they write.

`train_worker` calls the trainer's public entry point (`stapoctl.trainer.driver.train`) in a
fresh process, so whatever the trainer does per step (the synchronous StepRunner today,
`trainer.mode=async` when it exists) is what gets measured, without edits here. Per-step wall
time is the interval between consecutive steps' MLflow log calls (metric timestamps): the
whole loop iteration, logging included. The phase split is the trainer's own `timing_s/*`.
`whole_command` runs the CLI itself and times the process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("timing_s/gen", "timing_s/reward", "timing_s/ref", "timing_s/update", "timing_s/sync",
          "timing_s/sync_load", "timing_s/step")
PER_STEP = PHASES + ("perf/gen_tokens_per_s", "perf/train_tokens_per_s", "actor/pg_loss",
                     "response_length/mean", "reward/accuracy")


def bench_overrides(workdir: str, steps: int, extra: list[str]) -> list[str]:
    """A short, quiet run: no periodic validation, no checkpoints, its own MLflow store."""
    return [*extra, f"trainer.total_steps={steps}", "eval.every_n_steps=0", "trainer.save_freq=0",
            "trainer.log_samples=0", f"tracking.uri=sqlite:///{workdir}/mlflow.db",
            f"trainer.output_dir={workdir}/run", "tracking.experiment=bench"]


def has_key(overrides: list[str], key: str) -> bool:
    """Whether the composed config has `key` (e.g. trainer.mode): features the bench can use."""
    from omegaconf import OmegaConf

    from stapoctl.config.compose import compose_config

    return OmegaConf.select(compose_config(list(overrides)), key, default="__missing__") != "__missing__"


def read_run(uri: str, run_id: str) -> dict[str, Any]:
    """Per-step metric values and the wall-clock of each step's log call, from MLflow."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out: dict[str, Any] = {"metrics": {}, "step_end_ms": {}}
    for key in PER_STEP:
        hist = client.get_metric_history(run_id, key)
        out["metrics"][key] = {int(m.step): float(m.value) for m in hist if m.step > 0}
        if key == "timing_s/step":
            out["step_end_ms"] = {int(m.step): int(m.timestamp) for m in hist if m.step > 0}
    run = client.get_run(run_id)
    out["params"] = {k: v for k, v in run.data.params.items()
                     if k.split(".")[0] in ("model", "learner", "rollout", "loss", "trainer", "data")}
    out["tags"] = {k: v for k, v in run.data.tags.items() if k.startswith("stapoctl.")}
    return out


def step_seconds(step_end_ms: dict[int, int], skip: int = 1) -> list[float]:
    """Wall seconds of each step after the first `skip` (interval to the previous step's log)."""
    steps = sorted(step_end_ms)
    return [(step_end_ms[b] - step_end_ms[a]) / 1e3 for a, b in zip(steps, steps[1:]) if b > skip]


def train_worker(p: dict) -> dict:
    """One `train(conf)` in this process; engines' start-up info captured from `EngineLaunch.ready`
    (`engines_s`: Ray start → every actor up, the driver's own set-up running meanwhile)."""
    from rich.console import Console

    import stapoctl.trainer.engines as engines_mod
    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.driver import train

    info: dict[str, Any] = {}
    original = engines_mod.EngineLaunch.ready

    def observed(launch):
        eng = original(launch)
        info.update({k: v for k, v in eng.info.items() if isinstance(v, (int, float, str, bool))})
        return eng

    engines_mod.EngineLaunch.ready = observed
    conf = compose_config(p["overrides"])
    t0 = time.perf_counter()
    summary = train(conf, console=Console(file=open(os.devnull, "w")))
    run = read_run(summary["tracking_uri"], summary["run_id"])
    run.update(engines=info, train_s=time.perf_counter() - t0, run_dir=summary.get("run_dir"))
    return run


def train(overrides: list[str], steps: int, *, workdir: Optional[str] = None, timeout: float = 1800) -> dict:
    """`train` for `steps` steps in a fresh process; per-step data (see module doc)."""
    from _harness import run_worker

    import shutil

    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="stapoctl-bench-")
    try:
        return run_worker(Path(__file__), {"overrides": bench_overrides(workdir, steps, overrides)}, timeout=timeout)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


ENGINES_LINE = re.compile(r"engines up in (\d+(?:\.\d+)?) s \(vLLM (\d+(?:\.\d+)?) s, learner (\d+(?:\.\d+)?) s")


def whole_command(args: list[str], *, env: Optional[dict] = None, timeout: float = 1800) -> dict:
    """`python -m stapoctl.cli train ARGS` as a user runs it: wall seconds of the whole process,
    the engines' start-up line it prints, and its exit code."""
    full_env = {**os.environ, **(env or {}), "COLUMNS": "200"}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH")) if p)
    t0, epoch0 = time.perf_counter(), time.time()
    proc = subprocess.run([sys.executable, "-m", "stapoctl.cli", "train", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    wall, epoch1 = time.perf_counter() - t0, time.time()
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"stapoctl train exited with {proc.returncode}")
    m = ENGINES_LINE.search(proc.stdout)
    run_id = re.search(r"MLflow run ([0-9a-f]{32})", proc.stdout)
    return {"wall_s": wall, "spawn_epoch": epoch0, "exit_epoch": epoch1, "engines_s": float(m.group(1)) if m else None,
            "vllm_init_s": float(m.group(2)) if m else None, "learner_setup_s": float(m.group(3)) if m else None,
            "run_id": run_id.group(1) if run_id else None}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        import warnings

        warnings.filterwarnings("ignore")
        result = train_worker(json.loads(sys.argv[2]))
        sys.stdout.flush()
        print(json.dumps(result, default=str))
    else:
        print(__doc__)
