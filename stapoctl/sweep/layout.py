"""A sweep's MLflow layout: the tag and param names `stapoctl compare` and the SLURM array
submitter read. One parent run per sweep, one nested child (`train` run) per (value, seed).

Parent: tags KIND=sweep, SWEEP_ID=<its own run id>, SWEEP_NAME; params P_KEY, P_VALUES, P_SEEDS,
P_EXPERIMENT, P_OVERRIDES (+ one P_OVERRIDE_PREFIX<key> per override, one P_VALUE_OVERRIDES_PREFIX<value>
per value carrying overrides of its own); artifact DEFINITION_ARTIFACT.
Child: tags mlflow.parentRunId, KIND=train, SWEEP_ID, SWEEP_VALUE (as written), SEED, TRIAL (index);
run name RUN_NAME_FORMAT (e.g. `tau_p=2e-2-seed1`).
"""

from __future__ import annotations

# the names readers share (runs, compare, ui) live in tracking.keys; the sweep-only ones below
from stapoctl.tracking.keys import (KIND, KIND_SWEEP, SEED, SWEEP_ID, SWEEP_NAME,  # noqa: F401
                                    SWEEP_VALUE)
from stapoctl.tracking.keys import SWEEP_DEFINITION as DEFINITION_ARTIFACT  # noqa: F401
from stapoctl.tracking.keys import SWEEP_KEY as P_KEY  # noqa: F401

TRIAL = "stapoctl.trial"  # 0-based index in the plan (value-major, then seed)
ENGINES_REUSED = "stapoctl.engines_reused"  # child: "true" when it ran on a previous trial's engines
ERROR = "stapoctl.error"  # one-line reason on a FAILED / KILLED child (and on a FAILED parent)
# parent only: who runs it, so a resume can tell a dead sweep from a live one
HOST = "stapoctl.sweep_host"
PID = "stapoctl.sweep_pid"
PID_STARTED = "stapoctl.sweep_pid_started"  # the process's start time (pid reuse guard)

P_VALUES = "sweep.values"
P_SEEDS = "sweep.seeds"
P_EXPERIMENT = "sweep.experiment"
P_OVERRIDES = "sweep.overrides"  # every trial's extra Hydra overrides, space-separated
P_OVERRIDE_PREFIX = "sweep.override."  # + key: one param per override, for filtering
P_VALUE_OVERRIDES_PREFIX = "sweep.value_overrides."  # + value: the overrides only its trials get

# metrics: on each child at step 0, on the parent at step = trial index
M_OVERHEAD = "sweep/trial_overhead_s"  # wall time minus the trial's steps and validations
M_WALL = "sweep/trial_wall_s"
M_WORK = "sweep/trial_steps_s"  # Σ timing_s/step + Σ timing_s/val


def run_name(key: str, value: str, seed: int) -> str:
    """`tau_p=2e-2-seed1` for loss.tau_p, `grpo-seed0` for a method sweep (key `loss`)."""
    short = key.rsplit(".", 1)[-1]
    return f"{value}-seed{seed}" if key == "loss" else f"{short}={value}-seed{seed}"
