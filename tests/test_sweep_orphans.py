"""A local `max_parallel=2` sweep whose own process is SIGKILLed mid-trial: every trial it started
gets one stop from the kernel (`sweep/orphans.py`), ends its step, writes a checkpoint and ends its
run KILLED, and no trial process is left alive; the sweep's parent run stays RUNNING (nothing
could end it) until `stapoctl sweep NAME resume=ID` runs only the unfinished trials, each from its
checkpoint, and ends it FINISHED.

`stapoctl train` is replaced by a stand-in (as in test_sweep_parallel.py) that writes the child run
and, when stopped, a checkpoint the way the trainer does (`stapoctl.run_dir` tag, step dir with its
trainer state), and continues that run when resumed from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest
from procs import alive
from rich.console import Console

from stapoctl.sweep import layout, store

ROOT = Path(__file__).resolve().parents[1]

STAND_IN = r'''
import json, os, signal, sys, time
from pathlib import Path
from mlflow import MlflowClient
from stapoctl.config.compose import compose_config

conf = compose_config(sys.argv[1:])
index = int(conf.tracking.tags["stapoctl.trial"])
fast = json.loads(os.environ["STAND_IN_SCRIPT"]).get(str(index)) == "fast"
steps, stop = int(conf.trainer.total_steps), []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda signum, frame: stop.append(signum))
log = open(os.environ["STAND_IN_LOG"], "a")
def note(**kw):
    log.write(json.dumps({"index": index, "pid": os.getpid(), "t": time.time(), **kw}) + "\n"); log.flush()
note(event="start", argv=sys.argv[1:])
c = MlflowClient(conf.tracking.uri)
if conf.resume:  # the trainer continues the checkpoint's run
    state = json.loads((Path(conf.resume) / "trainer_state.json").read_text())
    rid, first = state["mlflow_run_id"], state["step"] + 1
    c.update_run(rid, status="RUNNING")
else:
    exp = c.get_experiment_by_name(conf.tracking.experiment)
    rid = c.create_run(exp.experiment_id, run_name=conf.tracking.run_name,
                       tags={"mlflow.parentRunId": conf.tracking.parent_run_id, "stapoctl.kind": "train",
                             **dict(conf.tracking.tags)}).info.run_id
    first = 1
    run_dir = Path(os.environ["STAND_IN_RUNS"]) / rid
    c.log_param(rid, "trainer.total_steps", steps)
    c.set_tag(rid, "stapoctl.run_dir", str(run_dir))
run_dir = Path(os.environ["STAND_IN_RUNS"]) / rid
note(event="run", run_id=rid, first=first)
for step in range(first, steps + 1):
    time.sleep(0.01 if fast else float(os.environ["STAND_IN_STEP_S"]))
    c.log_metric(rid, "timing_s/step", 0.01, step=step)
    c.set_tag(rid, "stapoctl.step", str(step))
    if stop and step < steps:  # as the trainer: the step done, a checkpoint, the run KILLED
        ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "mlflow_run_id": rid}))
        c.set_tag(rid, "stapoctl.stop_reason", "SIGTERM: stopped after step %d" % step)
        c.set_terminated(rid, "KILLED")
        note(event="end", status="KILLED", step=step)
        sys.exit(128 + stop[0])
c.log_metric(rid, "val/toy/train/avg_at_4", 0.25 * (index + 1), step=steps)
c.log_metric(rid, "timing_s/val", 0.01, step=steps)
c.set_terminated(rid, "FINISHED")
note(event="end", status="FINISHED", step=steps)
'''

# the sweep's own process, as `stapoctl sweep` runs it, with the stand-in as its trainer
PARENT = r'''
import sys
from rich.console import Console
from stapoctl.sweep import launchers
launchers.TRAIN = (sys.executable, sys.argv[1])
from stapoctl.sweep.runner import sweep_command
sys.exit(sweep_command("tau_p", sys.argv[2:], Console(width=200)))
'''

# 100 steps: trial 1 (0.5 s a step) outlives the fast trial 0 and trial 2's start by ~40 s, under load too
ARGS = ["values=[2e-3,2e-2,2e-1]", "seeds=[0]", "max_parallel=2", "trainer.total_steps=100",
        "rollout.cpus_per_worker=0.5", "learner.cpus=0.5", "cluster.num_cpus=2"]


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def _wait(what, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for: {what.__doc__ or what}")


def test_a_killed_sweep_leaves_no_trial_running_and_its_resume_finishes_it(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log = tmp_path / "events.jsonl"
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    env = {"STAPOCTL_HOME": str(tmp_path / "home"), "STAND_IN_LOG": str(log), "STAND_IN_RUNS": str(tmp_path / "runs"),
           "STAND_IN_SCRIPT": json.dumps({"0": "fast"}), "STAND_IN_STEP_S": "0.5"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(stand_in), *ARGS, f"tracking.uri={uri}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def two_running_after_the_fast_one():
            """trial 1 finished, trials 2 and 3 running"""
            evs = _events(log)
            ended = {e["index"] for e in evs if e["event"] == "end"}
            return ended == {0} and {e["index"] for e in evs if e["event"] == "run"} == {0, 1, 2}
        _wait(two_running_after_the_fast_one)
        time.sleep(1.0)  # a step or two into trials 2 and 3
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
    finally:
        if parent.poll() is None:
            parent.kill()

    def both_stopped():
        """every trial ended (the two running ones stopped by the sweep's death)"""
        return {e["index"] for e in _events(log) if e["event"] == "end"} == {0, 1, 2}
    _wait(both_stopped, timeout=60)
    evs = _events(log)
    pids = {e["pid"] for e in evs}

    def all_gone():
        """no trial process alive"""
        return not [pid for pid in pids if alive(pid)]
    _wait(all_gone, timeout=30)  # they exit right after their last words (no process is left behind)
    ends = {e["index"]: e for e in evs if e["event"] == "end"}
    assert ends[0]["status"] == "FINISHED" and ends[1]["status"] == ends[2]["status"] == "KILLED", ends

    client = mlflow.MlflowClient(uri)
    (sweep,) = client.search_runs([client.get_experiment_by_name("stapoctl").experiment_id],
                                  filter_string=f"tags.`{layout.KIND}` = 'sweep'")
    sweep_id = sweep.info.run_id
    assert sweep.info.status == "RUNNING"  # nothing could end it: the resume does
    kids = {r.data.tags[layout.TRIAL]: r.info.status for r in store.children(sweep_id, uri)}
    assert kids == {"0": "FINISHED", "1": "KILLED", "2": "KILLED"}

    # the resume: trials 2 and 3 only, each from its checkpoint, in the same child run; the parent ends
    log.unlink()
    monkeypatch.setenv("STAND_IN_STEP_S", "0.02")
    from stapoctl.sweep import launchers
    from stapoctl.sweep.runner import sweep_command

    monkeypatch.setattr(launchers, "TRAIN", (sys.executable, str(stand_in)))
    console = Console(record=True, width=200)
    code = sweep_command("tau_p", [f"resume={sweep_id[:8]}", *ARGS, f"tracking.uri={uri}"], console)
    out = console.export_text()
    assert code == 0, out
    assert "taking it over" in out and "1 already finished, running 2" in out, out
    starts = sorted((e["index"], e["argv"]) for e in _events(log) if e["event"] == "start")
    assert [i for i, _ in starts] == [1, 2]
    for (i, argv), stopped in zip(starts, (ends[1]["step"], ends[2]["step"])):
        assert any(a.startswith("resume=") and a.endswith(f"/checkpoints/step_{stopped:06d}") for a in argv), argv
    assert sorted((e["index"], e["first"]) for e in _events(log) if e["event"] == "run") == \
        [(1, ends[1]["step"] + 1), (2, ends[2]["step"] + 1)]
    assert client.get_run(sweep_id).info.status == "FINISHED"
    assert {r.data.tags[layout.TRIAL]: r.info.status for r in store.children(sweep_id, uri)} == \
        {"0": "FINISHED", "1": "FINISHED", "2": "FINISHED"}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def _orphan_of_a_killed_sweep(middle_code: str, script: Path, said: Path, env: dict) -> int:
    """Start the stand-in sweep `middle_code` (it starts `script` through the orphans wrapper and
    prints its pid), wait until the trial says "up", SIGKILL the sweep; the trial's pid."""
    middle = subprocess.Popen([sys.executable, "-c", middle_code, str(script), str(said)], stdout=subprocess.PIPE,
                              text=True, env=env)
    pid = int(middle.stdout.readline())
    _wait(lambda: said.exists() and "up" in said.read_text(), timeout=60)
    middle.kill()
    middle.wait()
    return pid


MIDDLE = r"""
import os, subprocess, sys, time
from stapoctl.sweep import orphans
p = subprocess.Popen(orphans.command(os.getpid(), [sys.executable, sys.argv[1], sys.argv[2]]))
print(p.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_a_trial_gets_one_sigterm_when_its_sweep_is_killed(tmp_path):
    """The wrapper execs the trial (same pid, as the sweep knows it); SIGKILL of the sweep → SIGTERM."""
    from stapoctl.sweep import orphans

    script, said = tmp_path / "trial.py", tmp_path / "said"
    script.write_text("import os, signal, sys, time\nout = open(sys.argv[1], 'a')\n"
                      "signal.signal(signal.SIGTERM, lambda s, f: (out.write(f'{os.getpid()} SIGTERM'), out.close(),"
                      " sys.exit(143)))\nout.write('up\\n'); out.flush()\ntime.sleep(60)\n")
    env = _env()
    pid = _orphan_of_a_killed_sweep(MIDDLE, script, said, env)
    _wait(lambda: "SIGTERM" in said.read_text(), timeout=30)
    assert said.read_text() == f"up\n{pid} SIGTERM"
    _wait(lambda: not alive(pid), timeout=30)
    # a sweep already gone when the wrapper starts: the trial never runs
    late = subprocess.run(orphans.command(os.getpid() + 10**7, [sys.executable, str(script), str(said)]), env=env,
                          timeout=60)
    assert late.returncode == 128 + signal.SIGTERM and said.read_text() == f"up\n{pid} SIGTERM"


THREADED_MIDDLE = r"""
import os, subprocess, sys, threading, time
from stapoctl.sweep import orphans
idle = threading.Event()
for _ in range(8):  # a sweep has threads (MLflow's sender, rich's refresh, pools): the kernel reparents
    threading.Thread(target=idle.wait, daemon=True).start()  # its orphan through them as they die
p = subprocess.Popen(orphans.command(os.getpid(), [sys.executable, sys.argv[1], sys.argv[2]]))
print(p.pid, flush=True)
time.sleep(120)
"""

GRACEFUL_TRIAL = r"""
import os, sys, time
from stapoctl.errors import RunStopped
from stapoctl.trainer.signals import GracefulStop
out = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
def say(line):  # unbuffered: a handler may interrupt the main thread's own write
    os.write(out, (line + "\n").encode())
stop = GracefulStop()
handle = stop._handle
stop._handle = lambda signum, frame: (say(f"signal {signum}"), handle(signum, frame))
stop.install()
stop.in_loop = True  # a step is running
say("up")
try:
    while not stop.requested:
        time.sleep(0.005)
    time.sleep(0.5)  # the rest of the step: the other parent-death signals arrive meanwhile
    say("stopped after the step")
except RunStopped as exc:
    say(f"aborted: {exc}")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_a_dying_sweeps_burst_of_parent_death_signals_is_one_stop(tmp_path):
    """The kernel sends the parent-death signal each time it reparents the orphan, once per thread of
    the dying sweep it passes through: 1 to 8 SIGTERMs within a few ms here. The trainer's signal handler
    takes the burst as one stop — it ends its step (and checkpoints) instead of aborting."""
    script, said = tmp_path / "trial.py", tmp_path / "said"
    script.write_text(GRACEFUL_TRIAL)
    pid = _orphan_of_a_killed_sweep(THREADED_MIDDLE, script, said, _env())
    _wait(lambda: "stopped" in said.read_text() or "aborted" in said.read_text(), timeout=30)
    lines = said.read_text().splitlines()
    assert lines[-1] == "stopped after the step", lines
    assert lines.count(f"signal {int(signal.SIGTERM)}") >= 1, lines
    _wait(lambda: not alive(pid), timeout=30)


def test_a_resume_waits_for_a_trial_still_writing_its_checkpoint(tmp_path):
    """Its run dir is locked by the stopping trainer: the resume says so in one line."""
    from types import SimpleNamespace

    from stapoctl.errors import UserError
    from stapoctl.sweep.runner import _still_stopping
    from stapoctl.trainer.run_status import run_dir_holder, run_dir_lock

    run = SimpleNamespace(data=SimpleNamespace(tags={layout.TRIAL: "1", "stapoctl.run_dir": str(tmp_path / "r")}))
    parent = SimpleNamespace(info=SimpleNamespace(run_id="abcdef0123456789"))
    with run_dir_lock(tmp_path / "r"):
        assert run_dir_holder(tmp_path / "r") == str(os.getpid())
        with pytest.raises(UserError, match=rf"^sweep abcdef01: trial 2 \(pid {os.getpid()}\) still stopping"):
            _still_stopping([run], parent)
    assert run_dir_holder(tmp_path / "r") is None
    _still_stopping([run], parent)  # ended: the resume goes on


# -- on the real trainer and engines ----------------------------------------------------------------
REAL = ["values=[2e-3,2e-1]", "seeds=[0]", "max_parallel=2", "rollout.cpus_per_worker=0.5", "learner.cpus=0.5",
        "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.total_steps=200", "eval.every_n_steps=200"]


@pytest.mark.e2e
def test_a_killed_sweep_stops_its_real_trials_with_a_checkpoint(shared_home, tmp_path):
    """Two `stapoctl train` processes with their own Rays; the sweep's process is SIGKILLed once both
    stepped: each trainer gets SIGTERM, ends its step, checkpoints, ends KILLED and takes its Ray
    down; the parent stays RUNNING for the resume."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "STAPOCTL_HOME": str(shared_home.home), "PYTHONPATH": str(ROOT), "COLUMNS": "160",
           "TERM": "dumb", "HF_HUB_OFFLINE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    client = mlflow.MlflowClient(uri)
    log = tmp_path / "sweep.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stapoctl.cli", "sweep", "tau_p", *shared_home.overrides, *REAL,
                                 f"tracking.uri={uri}"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    tree: list[int] = []
    try:
        def both_stepped():
            """both trials RUNNING with a step logged"""
            assert proc.poll() is None, log.read_text()[-4000:]
            exp = client.get_experiment_by_name("stapoctl")
            for run in (client.search_runs([exp.experiment_id], f"tags.`{layout.KIND}` = 'train'") if exp else []):
                if run.info.status != "RUNNING" or not client.get_metric_history(run.info.run_id, "batch/fingerprint"):
                    return False
            return exp is not None and len(client.search_runs([exp.experiment_id],
                                                              f"tags.`{layout.KIND}` = 'train'")) == 2
        _wait(both_stepped, timeout=900)
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.kill()  # SIGKILL: the sweep cannot stop anything itself
        proc.wait()

        def tree_gone():
            """every process the sweep started has exited"""
            return not [p for p in tree if alive(p)]
        _wait(tree_gone, timeout=600)
    finally:
        for pid in tree:  # clean up before failing
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    from stapoctl.sweep.outcome import resume_point

    (sweep,) = client.search_runs([client.get_experiment_by_name("stapoctl").experiment_id],
                                  f"tags.`{layout.KIND}` = 'sweep'")
    assert sweep.info.status == "RUNNING"
    kids = store.children(sweep.info.run_id, uri)
    assert [r.info.status for r in kids] == ["KILLED", "KILLED"]
    assert all(r.data.tags["stapoctl.stop_reason"].startswith("SIGTERM") for r in kids), [r.data.tags for r in kids]
    records = store.trial_records(sweep.info.run_id, 2, uri)
    assert all(resume_point(records[i]) for i in (0, 1)), "a trial stopped without a checkpoint"
