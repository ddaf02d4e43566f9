"""A sweep's records in MLflow: the parent run (opened, claimed by a process, ended), its
children (one `train` run per trial attempt) and what they say about each trial.

The parent is driven through `MlflowClient`, not the fluent API: the trials' own runs use the
fluent API (`mlflow.start_run`) in the same process, and MLflow keeps one fluent run active at a
time. A trial counts as finished when its child is FINISHED, reached `trainer.total_steps` and
logged validation metrics at that step (its final evaluation); a trial a run-health alarm stopped
(trainer.alarm_action=stop) is done too, a result at its last validation that `resume=` never re-runs.

Liveness: the parent records the host, pid and the pid's start time of the process running it.
A RUNNING parent whose process is gone on this host belongs to a dead sweep (SIGKILL, OOM,
power loss) and a resume may take it over; on another host we cannot tell, so resume asks for
`force=true`.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any, Optional

from stapoctl.config import overrides as ov
from stapoctl.errors import UserError
from stapoctl.sweep import layout
from stapoctl.sweep.definition import SweepDefinition
from stapoctl.tracking.runs import alarm_stopped

TERMINAL = ("FINISHED", "FAILED", "KILLED")


def client(uri: Optional[str]):
    from stapoctl.tracking.mlflow_run import tracking_uri
    from stapoctl.tracking.store_init import client as store_client

    return store_client(tracking_uri(uri))


def one_line(exc: BaseException, limit: int = 500) -> str:
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line[:limit]


# -- the parent run ----------------------------------------------------------------------------
def open_parent(definition: SweepDefinition, uri: Optional[str] = None, experiment: str = "stapoctl",
                tags: Optional[dict] = None) -> str:
    """Create the sweep's parent run (RUNNING, claimed by this process) with `tags` besides its
    own (a confirmatory sweep's); returns its run id, which is also the sweep id every trial carries."""
    from stapoctl.tracking.mlflow_run import setup

    setup(uri, experiment)  # creates the experiment (artifacts beside a sqlite store) if needed
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    run = c.create_run(exp.experiment_id, run_name=f"sweep-{definition.name}",
                       tags={**(tags or {}), layout.KIND: layout.KIND_SWEEP, layout.SWEEP_NAME: definition.name})
    run_id = run.info.run_id
    c.set_tag(run_id, layout.SWEEP_ID, run_id)
    params = {
        layout.P_KEY: definition.key,
        layout.P_VALUES: "[" + ", ".join(definition.values) + "]",
        layout.P_SEEDS: "[" + ", ".join(str(s) for s in definition.seeds) + "]",
        layout.P_EXPERIMENT: definition.experiment,
        layout.P_OVERRIDES: " ".join(definition.overrides),
    }
    for o in ov.parse_all(definition.overrides):
        params[layout.P_OVERRIDE_PREFIX + o.key] = o.text if o.kind == ov.DELETE else o.value
    for value, own in definition.value_overrides:
        params[layout.P_VALUE_OVERRIDES_PREFIX + value] = " ".join(own)
    from mlflow.entities import Param

    c.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    c.log_text(run_id, definition.to_yaml(), layout.DEFINITION_ARTIFACT)
    claim(run_id, uri)
    return run_id


def claim(run_id: str, uri: Optional[str]) -> None:
    """This process runs the sweep now: RUNNING, with our host / pid for liveness checks."""
    import os

    import psutil

    c = client(uri)
    c.update_run(run_id, status="RUNNING")
    c.set_tag(run_id, layout.HOST, socket.gethostname())
    c.set_tag(run_id, layout.PID, str(os.getpid()))
    c.set_tag(run_id, layout.PID_STARTED, f"{psutil.Process().create_time():.3f}")


def end_parent(run_id: str, uri: Optional[str], status: str, error: Optional[str] = None) -> None:
    c = client(uri)
    if error:
        c.set_tag(run_id, layout.ERROR, error[:5000])
    c.set_terminated(run_id, status=status)


def find_parent(spec: str, uri: Optional[str], experiment: str, what: str = "resume") -> Any:
    """The sweep's parent run from its id or a unique prefix of it (`what`: the option naming it)."""
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise UserError(f"{what}={spec}: no MLflow experiment '{experiment}' in {_uri(uri)}; set tracking.uri "
                        "(or MLFLOW_TRACKING_URI) to the store the sweep was logged in")
    runs = c.search_runs([exp.experiment_id], filter_string=f"tags.`{layout.KIND}` = '{layout.KIND_SWEEP}'",
                         max_results=5000)
    hits = [r for r in runs if r.info.run_id.startswith(spec.lower())]
    if not hits:
        raise UserError(f"{what}={spec}: no sweep with that id in {_uri(uri)} (experiment '{experiment}'); "
                        "`stapoctl runs` lists them (kind 'sweep')")
    if len(hits) > 1:
        raise UserError(f"{what}={spec}: {len(hits)} sweeps start with that prefix "
                        f"({', '.join(r.info.run_id[:12] for r in hits[:4])}…): give more characters")
    return hits[0]


def recorded_definition(run: Any, uri: Optional[str]) -> SweepDefinition:
    import tempfile
    from pathlib import Path

    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = client(uri).download_artifacts(run.info.run_id, layout.DEFINITION_ARTIFACT, tmp)
            text = Path(path).read_text()
    except Exception as exc:
        raise UserError(f"sweep {run.info.run_id}: its {layout.DEFINITION_ARTIFACT} artifact cannot be read "
                        f"({one_line(exc)})") from None
    name = run.data.tags.get(layout.SWEEP_NAME, "sweep")
    return SweepDefinition.from_yaml(text, name, f"sweep {run.info.run_id[:8]}'s {layout.DEFINITION_ARTIFACT}")


def process_alive(run: Any) -> Optional[bool]:
    """Is the process that claimed this parent still running? None: it ran on another host."""
    import psutil

    tags = run.data.tags
    if tags.get(layout.HOST) != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(tags.get(layout.PID, "-1")))
        started = float(tags.get(layout.PID_STARTED, "0"))
        return abs(proc.create_time() - started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):
        return False


# -- the children ------------------------------------------------------------------------------
@dataclass
class TrialRecord:
    """What the store says about one trial: its newest child run and whether it finished."""

    index: int
    run: Any = None  # newest child (mlflow Run) or None
    finished: bool = False
    attempts: int = 0


def children(sweep_id: str, uri: Optional[str]) -> list:
    c = client(uri)
    parent = c.get_run(sweep_id)
    return c.search_runs([parent.info.experiment_id],
                         filter_string=f"tags.`{layout.SWEEP_ID}` = '{sweep_id}' and tags.`{layout.KIND}` = 'train'",
                         order_by=["attributes.start_time ASC"], max_results=10000)


def trial_finished(run: Any, uri: Optional[str]) -> bool:
    """FINISHED, at its last step, with that step's validation metrics logged."""
    if run.info.status != "FINISHED":
        return False
    total = run.data.params.get("trainer.total_steps")
    if total is None or run.data.tags.get("stapoctl.step") != str(total):
        return False
    val_keys = [k for k in run.data.metrics if k.startswith("val/") and "/avg_at_" in k]
    if not val_keys:
        return False
    history = client(uri).get_metric_history(run.info.run_id, val_keys[0])
    return any(m.step == int(total) for m in history)


def trial_records(sweep_id: str, n_trials: int, uri: Optional[str]) -> dict[int, TrialRecord]:
    records = {i: TrialRecord(i) for i in range(n_trials)}
    for run in children(sweep_id, uri):
        try:
            index = int(run.data.tags.get(layout.TRIAL, "-1"))
        except ValueError:
            continue
        rec = records.get(index)
        if rec is None:
            continue
        rec.attempts += 1
        done = trial_finished(run, uri) or bool(alarm_stopped(run))
        if done or not rec.finished:  # the newest attempt, unless an earlier one finished
            rec.run, rec.finished = run, rec.finished or done
    return records


def newest_child(sweep_id: str, index: int, uri: Optional[str], since_s: float) -> Any:
    """The child of trial `index` started at or after `since_s` (epoch seconds), if any."""
    found = [r for r in children(sweep_id, uri)
             if r.data.tags.get(layout.TRIAL) == str(index) and r.info.start_time >= since_s * 1000 - 1000]
    return found[-1] if found else None


def end_child(run_id: str, uri: Optional[str], status: str, error: Optional[str]) -> None:
    c = client(uri)
    if error:
        c.set_tag(run_id, layout.ERROR, error[:5000])
    c.set_terminated(run_id, status=status)


def record_failed_trial(sweep_id: str, trial: Any, experiment: str, uri: Optional[str], error: str) -> str:
    """A trial that failed before its run existed still gets a (FAILED) child with the reason."""
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    run = c.create_run(exp.experiment_id, run_name=trial.run_name,
                       tags={**trial.tags, "mlflow.parentRunId": sweep_id, layout.KIND: "train",
                             layout.ERROR: error[:5000]})
    c.set_terminated(run.info.run_id, status="FAILED")
    return run.info.run_id


def log_trial_timing(sweep_id: str, child_id: str, index: int, uri: Optional[str], since_s: float,
                     wall_s: float) -> dict[str, float]:
    """Overhead = wall time − (Σ timing_s/step + Σ timing_s/val) of the steps this attempt ran;
    logged on the child (step 0) and on the parent (step = trial index)."""
    from mlflow.entities import Metric

    c = client(uri)
    since_ms = since_s * 1000
    work = 0.0
    for key in ("timing_s/step", "timing_s/val"):
        work += sum(m.value for m in c.get_metric_history(child_id, key) if m.timestamp >= since_ms)
    out = {layout.M_WALL: wall_s, layout.M_WORK: work, layout.M_OVERHEAD: wall_s - work}
    now = int(time.time() * 1000)
    c.log_batch(child_id, metrics=[Metric(k, v, now, 0) for k, v in out.items()])
    c.log_batch(sweep_id, metrics=[Metric(k, v, now, index) for k, v in out.items()])
    return out


def _uri(uri: Optional[str]) -> str:
    from stapoctl.tracking.mlflow_run import tracking_uri

    return tracking_uri(uri)
