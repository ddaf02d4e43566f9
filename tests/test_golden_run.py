"""Golden trajectory of the embedded default, recorded before #50's refactor ("one loss contract and
one learner", behaviour unchanged) and checked after it: the tiny experiment (fp32, loss=stapo, the
session's shared tiny model) trained for 10 steps with validation and evaluation off, every metric it
logs per step (wall-clock ones aside: `VOLATILE`) against tests/golden/embedded_default.json.

Runs on the suite's engine pool (its place in tests/conftest.py POOL_ORDER follows a module that
leaves the embedded default's engines running, so it starts none there; alone it starts them once).
The tolerance is the one measured when the file was recorded (`rel`, `abs` in the JSON, with how
they were found: exact, 4 runs bit-identical). The file also records the machine, since a run's
floats depend on its thread count and kernels: elsewhere the comparison is skipped, saying why.

Regenerate (only on the commit whose behaviour is the reference, and say so in its message)::

    STAPOCTL_REGEN_GOLDEN=1 HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_golden_run.py -q \
        -p no:cacheprovider

which rewrites the trajectory and the machine, keeping the stored tolerance.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.engine

GOLDEN = Path(__file__).parent / "golden" / "embedded_default.json"
REGEN = os.environ.get("STAPOCTL_REGEN_GOLDEN") == "1"
STEPS = 10
OVERRIDES = [f"trainer.total_steps={STEPS}", "eval.every_n_steps=0", "trainer.val_before_train=false",
             "trainer.save_freq=0"]
# logged but not a function of the computation: wall clock, throughput, memory, the machine
VOLATILE = ("timing_s/", "perf/", "system/", "memory/", "mem/")
# what held when the file was first recorded (a regeneration keeps the file's own); test_session.py's
# one-step cold = reused check allows rel 1e-5
DEFAULT_TOLERANCE = {"rel": 0.0, "abs": 0.0, "measured": (
    "2026-12-07, 2 cores AMD EPYC (AVX512), torch 2.13, CPU engines: 4 runs of these 10 steps (cold; on reused "
    "engines after an identical run; cold again; cold on a second build of the tiny model) logged all 78 "
    "metrics bit-identical at every step, so the comparison is exact")}


def machine() -> dict[str, Any]:
    """What a run's floats depend on beyond the code: the intra-op thread counts (auto = the cores
    this process may use, engine_settings.thread_counts), torch's kernels and the CPU."""
    import torch

    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu": cpu or platform.processor(),
            "cuda": torch.cuda.is_available()}


def per_step(uri: str, run_id: str) -> dict[str, dict[str, float]]:
    """{metric: {step: value}} of every metric the run logged, VOLATILE ones aside."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    keys = sorted(k for k in client.get_run(run_id).data.metrics if not k.startswith(VOLATILE))
    return {k: {str(m.step): float(m.value) for m in client.get_metric_history(run_id, k)} for k in keys}


def golden_run(conf, console, session) -> dict[str, Any]:
    """Train `conf` on `session`; its per-step metrics and whether it started engines."""
    from stapoctl.trainer.driver import train

    warm = session.engines is not None
    out = train(conf, console=console, session=session)
    info = dict(session.engines.info)
    return {"run_id": out["run_id"], "warm": warm, "info": info,
            "metrics": per_step(str(conf.tracking.uri), out["run_id"])}


@pytest.fixture(scope="module")
def run(training_store, engine_pool):
    with training_store("golden_run_store", OVERRIDES) as t:
        conf = t.conf()
        return golden_run(conf, t.console, engine_pool)


def differences(got: dict, want: dict, rel: float, abs_: float) -> list[str]:
    """Metric/step pairs outside the tolerance, missing or new, as lines (NaN equals NaN)."""
    out = []
    for key in sorted(set(got) | set(want)):
        if key not in got or key not in want:
            out.append(f"{key}: {'not logged any more' if key in want else 'new metric (not in the golden file)'}")
            continue
        if got[key].keys() != want[key].keys():
            out.append(f"{key}: logged at steps {sorted(got[key], key=int)}, golden {sorted(want[key], key=int)}")
            continue
        for step in sorted(want[key], key=int):
            a, b = got[key][step], want[key][step]
            if not (a == pytest.approx(b, rel=rel, abs=abs_) or (math.isnan(a) and math.isnan(b))):
                out.append(f"{key} at step {step}: {a!r} != {b!r} (rel {rel}, abs {abs_})")
    return out


def test_the_golden_run_started_no_engines_in_the_pool(run):
    """In the suite it follows a module on the embedded default's engines: a start here means its
    POOL_ORDER place (or its overrides) no longer shares their key."""
    if run["warm"]:
        assert run["info"]["reused"], f"the golden run started engines: {run['info'].get('reason')}"


def write_golden(metrics: dict[str, dict[str, float]]) -> None:
    """The golden file of a run's per-step metrics (STAPOCTL_REGEN_GOLDEN=1), keeping the stored tolerance."""
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps({
        "_doc": "tests/test_golden_run.py: regenerate with STAPOCTL_REGEN_GOLDEN=1, never by hand",
        "overrides": OVERRIDES, "machine": machine(), "tolerance": old.get("tolerance") or DEFAULT_TOLERANCE,
        "metrics": metrics,
    }, indent=1, sort_keys=True) + "\n")


def test_the_embedded_default_follows_its_golden_trajectory(run):
    if REGEN:
        write_golden(run["metrics"])
    assert GOLDEN.exists(), f"{GOLDEN} is missing: STAPOCTL_REGEN_GOLDEN=1 writes it (on the reference commit)"
    old = json.loads(GOLDEN.read_text())
    here = machine()
    if old["machine"] != here:
        pytest.skip(f"{GOLDEN.name} was recorded on {old['machine']}, this is {here}: a run's floats depend on "
                    "the threads and kernels, so the trajectory is only compared where it was recorded")
    assert old["overrides"] == OVERRIDES, "the overrides changed since the file was recorded: regenerate it"
    got, want = run["metrics"], old["metrics"]
    assert len(want["actor/pg_loss"]) == STEPS
    lines = differences(got, want, float(old["tolerance"]["rel"]), float(old["tolerance"]["abs"]))
    assert not lines, f"{len(lines)} values left the golden trajectory:\n" + "\n".join(lines[:30])
