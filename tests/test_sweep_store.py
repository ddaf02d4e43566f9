"""A sweep's MLflow records on a real sqlite store, no engines: the parent's layout, finding a
sweep by id prefix, what counts as a finished trial, telling a dead sweep from a live one (the
SIGKILL case: its runs stay RUNNING), and what a resume may change."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import mlflow
import pytest

from stapoctl.errors import UserError
from stapoctl.sweep import layout, store
from stapoctl.sweep.definition import parse_command
from stapoctl.sweep.runner import _take_over, reconcile, resume_point


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One store for the module (creating an MLflow db costs seconds); each test its own sweep."""
    return f"sqlite:///{tmp_path_factory.mktemp('sweep_store') / 'mlflow.db'}"


def definition(*args):
    return parse_command("tau_p", ["values=[2e-3,2e-1]", "seeds=[0]", *args]).definition


def child(uri, sweep_id, index, status="FINISHED", total=3, val_steps=(3,), step=None):
    """A trial's run as the trainer leaves it: params, the step tag, validation metrics."""
    c = store.client(uri)
    parent = c.get_run(sweep_id)
    run = c.create_run(parent.info.experiment_id, run_name=f"t{index}", tags={
        "mlflow.parentRunId": sweep_id, layout.KIND: "train", layout.SWEEP_ID: sweep_id,
        layout.TRIAL: str(index), "stapoctl.step": str(total if step is None else step)})
    rid = run.info.run_id
    c.log_param(rid, "trainer.total_steps", str(total))
    for s in val_steps:
        c.log_metric(rid, "val/toy/train/avg_at_4", 0.5, step=s)
    if status != "RUNNING":
        c.set_terminated(rid, status)
    return rid


def test_parent_layout_and_lookup(uri):
    d = definition("trainer.total_steps=3", "+tracking.tags.team=rl")
    sweep_id = store.open_parent(d, uri, "stapoctl")
    run = store.client(uri).get_run(sweep_id)
    tags, params = run.data.tags, run.data.params
    assert run.info.status == "RUNNING" and run.info.run_name == "sweep-tau_p"
    assert (tags[layout.KIND], tags[layout.SWEEP_ID], tags[layout.SWEEP_NAME]) == ("sweep", sweep_id, "tau_p")
    assert (tags[layout.PID], tags[layout.HOST]) == (str(os.getpid()), socket.gethostname())
    assert params[layout.P_KEY] == "loss.tau_p" and params[layout.P_VALUES] == "[2e-3, 2e-1]"
    assert params[layout.P_SEEDS] == "[0]" and params[layout.P_EXPERIMENT] == "tiny"
    assert params[layout.P_OVERRIDES] == "trainer.total_steps=3 +tracking.tags.team=rl"
    assert params[layout.P_OVERRIDE_PREFIX + "trainer.total_steps"] == "3"
    found = store.find_parent(sweep_id[:6], uri, "stapoctl")
    assert found.info.run_id == sweep_id
    assert store.recorded_definition(found, uri) == d
    with pytest.raises(UserError, match="no sweep with that id"):
        store.find_parent("zz", uri, "stapoctl")
    # a value's own overrides: one param each, and they come back with the recorded definition
    full = parse_command("baselines", ["values=[grpo,dapo_full]", "seeds=[0]"]).definition
    full_id = store.open_parent(full, uri, "stapoctl")
    run = store.client(uri).get_run(full_id)
    assert run.data.params[layout.P_VALUE_OVERRIDES_PREFIX + "dapo_full"] == (
        "loss=dapo trainer.dynamic_sampling=true reward.overlong_buffer=16")
    assert store.recorded_definition(run, uri) == full
    with pytest.raises(UserError, match="no MLflow experiment 'other'"):
        store.find_parent(sweep_id, uri, "other")
    store.end_parent(sweep_id, uri, "FAILED", "1 of 2 trials failed")
    run = store.client(uri).get_run(sweep_id)
    assert run.info.status == "FAILED" and run.data.tags[layout.ERROR] == "1 of 2 trials failed"


def test_a_trial_counts_only_when_finished_at_its_last_step_with_validation(uri):
    sweep_id = store.open_parent(definition(), uri, "stapoctl")
    done = child(uri, sweep_id, 0)
    child(uri, sweep_id, 1, status="KILLED", step=2, val_steps=(2,))
    no_final_val = child(uri, sweep_id, 2, val_steps=(2,))
    records = store.trial_records(sweep_id, 4, uri)
    assert records[0].finished and records[0].run.info.run_id == done
    assert not records[1].finished and records[1].run.info.status == "KILLED"
    assert not records[2].finished and records[2].run.info.run_id == no_final_val
    assert records[3].run is None and records[3].attempts == 0
    # a re-run that finishes makes the trial finished; the killed attempt stays for the record
    rerun = child(uri, sweep_id, 1)
    records = store.trial_records(sweep_id, 4, uri)
    assert records[1].finished and records[1].run.info.run_id == rerun and records[1].attempts == 2


def test_liveness_of_the_process_that_runs_a_sweep(uri):
    sweep_id = store.open_parent(definition(), uri, "stapoctl")
    c = store.client(uri)
    assert store.process_alive(c.get_run(sweep_id)) is True  # claimed by this very process
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    c.set_tag(sweep_id, layout.PID, str(dead.pid))
    assert store.process_alive(c.get_run(sweep_id)) is False
    c.set_tag(sweep_id, layout.PID, str(os.getpid()))
    c.set_tag(sweep_id, layout.PID_STARTED, "12.0")  # our pid, another process's start: pid reuse
    assert store.process_alive(c.get_run(sweep_id)) is False
    c.set_tag(sweep_id, layout.HOST, "elsewhere")
    assert store.process_alive(c.get_run(sweep_id)) is None


def test_resume_takes_over_a_dead_sweep_and_ends_its_running_trial(uri):
    from rich.console import Console

    console = Console(record=True, width=200)
    sweep_id = store.open_parent(definition(), uri, "stapoctl")
    c = store.client(uri)
    stale = child(uri, sweep_id, 1, status="RUNNING", step=1, val_steps=())
    with pytest.raises(UserError, match=f"sweep {sweep_id} is still running \\(pid {os.getpid()}"):
        _take_over(c.get_run(sweep_id), uri, False, console)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    c.set_tag(sweep_id, layout.PID, str(dead.pid))  # what SIGKILL leaves: RUNNING runs, no process
    _take_over(c.get_run(sweep_id), uri, False, console)
    assert c.get_run(stale).info.status == "KILLED"
    assert "its sweep process died" in c.get_run(stale).data.tags[layout.ERROR]
    assert "taking it over" in console.export_text()
    c.set_tag(sweep_id, layout.HOST, "elsewhere")
    with pytest.raises(UserError, match="this host cannot check that process: resume it there, or add force=true"):
        _take_over(c.get_run(sweep_id), uri, False, console)
    _take_over(c.get_run(sweep_id), uri, True, console)


def test_what_a_resume_may_change():
    recorded = definition("trainer.total_steps=3")
    same = parse_command("tau_p", ["values=[2e-3,2e-1]", "trainer.total_steps=3", "resume=ab",
                                   "tracking.uri=sqlite:///x.db"])
    d, extra = reconcile(same, recorded)
    assert d == recorded and extra == ("tracking.uri=sqlite:///x.db",)
    bare = parse_command("tau_p", ["resume=ab"])
    assert reconcile(bare, recorded) == (recorded, ())
    for args, message in (
        (["values=[2e-3]"], r"values \[2e-3\] differ from the sweep's recorded \[2e-3, 2e-1\]"),
        (["trainer.total_steps=4"], "trainer.total_steps=4 differs from the sweep's recorded trainer.total_steps=3"),
        (["learner.lr=1e-3"], "learner.lr=1e-3 was not part of the sweep's trials"),
    ):
        with pytest.raises(UserError, match=message):
            reconcile(parse_command("tau_p", [*args, "resume=ab"]), recorded)
    with pytest.raises(UserError, match="that is sweep 'tau_p', not 'tau_h'"):
        reconcile(parse_command("tau_h", ["resume=ab"]), recorded)


def test_an_unfinished_trial_with_a_checkpoint_continues_from_it(uri, tmp_path):
    sweep_id = store.open_parent(definition(), uri, "stapoctl")
    rid = child(uri, sweep_id, 0, status="KILLED", total=4, step=2, val_steps=())
    run_dir = tmp_path / "run"
    store.client(uri).set_tag(rid, "stapoctl.run_dir", str(run_dir))
    record = store.trial_records(sweep_id, 1, uri)[0]
    assert resume_point(record) is None  # no checkpoint: a new child run
    step2 = run_dir / "checkpoints" / "step_000002"
    step2.mkdir(parents=True)
    (step2 / "trainer_state.json").write_text(json.dumps({"step": 2}))
    assert resume_point(record) == str(step2)
    step4 = run_dir / "checkpoints" / "step_000004"
    step4.mkdir()
    (step4 / "trainer_state.json").write_text(json.dumps({"step": 4}))
    assert resume_point(record) is None  # at its last step already: nothing to continue, run it again
