"""`stapoctl sweep … max_parallel=K` on a real MLflow store, with `stapoctl train` replaced by a
stand-in process (`STAND_IN` below: it writes the child run `train` writes, takes steps and
fails or ignores signals on cue), so the parallel runner's decisions are checked in seconds:
at most K trials at once, each in its own share of the machine; a failed trial does not stop
the others; Ctrl-C stops them all and leaves no run RUNNING (one trial ends KILLED by itself,
a stubborn one is killed and its run ended for it); `resume=` runs only the unfinished trials;
K trials that cannot fit are refused in one line; on SLURM K is the array's parallelism.
The real trainer and engines, on a local Ray head: test_sweep_parallel_e2e.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import mlflow
import pytest
from rich.console import Console

from stapoctl.errors import UserError
from stapoctl.sweep import layout, store
from stapoctl.sweep.runner import sweep_command

STAND_IN = r'''
import json, os, signal, sys, time
from mlflow import MlflowClient
from stapoctl.config.compose import compose_config

conf = compose_config(sys.argv[1:])
index = int(conf.tracking.tags["stapoctl.trial"])
what = json.loads(os.environ["STAND_IN_SCRIPT"]).get(str(index), "ok")
steps = int(conf.trainer.total_steps)
stop = []
if what == "stubborn":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, frame: stop.append(signum))
log = open(os.environ["STAND_IN_LOG"], "a")
def note(**kw):
    log.write(json.dumps({"index": index, "t": time.time(), **kw}) + "\n"); log.flush()
note(event="start", argv=sys.argv[1:])
if what == "before":
    print("error: no dataset 'toy-train' under data.root", flush=True)
    note(event="end", status=None)
    sys.exit(2)
c = MlflowClient(conf.tracking.uri)
exp = c.get_experiment_by_name(conf.tracking.experiment)
run = c.create_run(exp.experiment_id, run_name=conf.tracking.run_name,
                   tags={"mlflow.parentRunId": conf.tracking.parent_run_id, "stapoctl.kind": "train",
                         **dict(conf.tracking.tags)})
rid = run.info.run_id
c.log_param(rid, "trainer.total_steps", steps)
note(event="run", run_id=rid)
for step in range(1, steps + 1):
    time.sleep(float(os.environ.get(f"STAND_IN_STEP_S_{index}", os.environ.get("STAND_IN_STEP_S", "0.3"))))
    c.log_metric(rid, "timing_s/step", 0.01, step=step)
    c.set_tag(rid, "stapoctl.step", str(step))
    if stop:
        c.set_tag(rid, "stapoctl.stop_reason", "SIGINT: stopped after step %d" % step)
        c.set_terminated(rid, "KILLED")
        note(event="end", status="KILLED")
        sys.exit(128 + stop[0])
    if what == "alarm":  # trainer.alarm_action=stop: its validation, the alarm's tags, KILLED, exit 3
        c.log_metric(rid, "val/toy/train/avg_at_4", 0.1, step=step)
        for k, v in {"stapoctl.alarm.entropy_collapse": str(step), "stapoctl.alarm_stopped": "entropy_collapse",
                     "stapoctl.stop_reason": "alarm entropy_collapse at step %d" % step}.items():
            c.set_tag(rid, k, v)
        c.set_terminated(rid, "KILLED")
        note(event="end", status="KILLED")
        sys.exit(3)
    if what == "boom":
        c.set_tag(rid, "stapoctl.error", "RuntimeError: learner rank 0 died")
        c.set_terminated(rid, "FAILED")
        note(event="end", status="FAILED")
        sys.exit(1)
c.log_metric(rid, "val/toy/train/avg_at_4", 0.25 * (index + 1), step=steps)
c.log_metric(rid, "timing_s/val", 0.01, step=steps)
c.set_terminated(rid, "FINISHED")
note(event="end", status="FINISHED")
'''

FRACTIONAL = ["rollout.cpus_per_worker=0.5", "learner.cpus=0.5", "cluster.num_cpus=2"]


@pytest.fixture()
def world(tmp_path, monkeypatch):
    from stapoctl.sweep import launchers

    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    monkeypatch.setattr(launchers, "TRAIN", (sys.executable, str(stand_in)))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script: dict[str, str] = {}
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = ["seeds=[0]", "trainer.total_steps=2", f"tracking.uri={uri}", *FRACTIONAL]
    return dict(uri=uri, script=script, log=log, args=args, client=mlflow.MlflowClient(uri), tmp=tmp_path,
                monkeypatch=monkeypatch)


def run(world, *extra):
    world["monkeypatch"].setenv("STAND_IN_SCRIPT", json.dumps(world["script"]))
    console = Console(record=True, width=200)
    code = sweep_command("tau_p", [*world["args"], *extra], console)
    return code, console.export_text()


def events(world) -> list[dict]:
    if not world["log"].exists():
        return []
    return [json.loads(line) for line in world["log"].read_text().splitlines() if line.strip()]


def the_sweep(world):
    c = world["client"]
    exp = c.get_experiment_by_name("stapoctl")
    (parent,) = c.search_runs([exp.experiment_id], filter_string=f"tags.`{layout.KIND}` = 'sweep'")
    return parent


def by_trial(world, sweep_id):
    return sorted((r.data.tags[layout.TRIAL], r.info.status, r.data.tags.get(layout.ERROR, ""))
                  for r in store.children(sweep_id, world["uri"]))


def most_at_once(evs: list[dict]) -> int:
    """The most stand-ins alive at one time, from their start and end events."""
    points = sorted([(e["t"], 1) for e in evs if e["event"] == "start"]
                    + [(e["t"], -1) for e in evs if e["event"] == "end"])
    live = best = 0
    for _, delta in points:
        live += delta
        best = max(best, live)
    return best


def test_k_trials_at_once_a_failure_does_not_stop_the_others_and_resume_runs_the_rest(world):
    world["script"].update({"0": "boom", "1": "before"})
    # trial 0 lives one step after its start: long enough, under load too, to overlap trial 1 (which
    # ends at once) and trial 2 (started when 1 ends, after its own imports); the others step at 0.3 s
    world["monkeypatch"].setenv("STAND_IN_STEP_S_0", "8")
    code, log = run(world, "values=[2e-3,2e-2,2e-1]", "max_parallel=2")
    assert code == 1, log
    parent = the_sweep(world)
    sweep_id = parent.info.run_id
    assert parent.info.status == "FAILED" and parent.data.tags[layout.ERROR] == "2 of 3 trials failed"
    assert by_trial(world, sweep_id) == [
        ("0", "FAILED", "RuntimeError: learner rank 0 died"),  # the run's own error
        ("1", "FAILED", "error: no dataset 'toy-train' under data.root"),  # no run existed: its last line
        ("2", "FINISHED", ""),
    ]
    evs = events(world)
    starts = [e for e in evs if e["event"] == "start"]
    assert sorted(e["index"] for e in starts) == [0, 1, 2]
    # each trial in a share of the machine: 2 CPUs / 2 trials, its own Ray of 1 CPU
    assert all(e["argv"][-1] == "cluster.num_cpus=1" for e in starts)
    assert most_at_once(evs) == 2
    assert "running 3 trial(s), 2 at once" in log and "2 of 3 trials did not finish" in log
    assert (Path(world["tmp"]) / "home" / "sweeps" / sweep_id / "trial-2.log").is_file()
    done = [r for r in store.children(sweep_id, world["uri"]) if r.info.status == "FINISHED"]
    assert all(r.data.metrics[layout.M_OVERHEAD] == pytest.approx(r.data.metrics[layout.M_WALL] - 0.03)
               for r in done)

    # resume: only the two failed trials run again, as new children; the failed ones stay
    world["script"].clear()
    world["log"].unlink()
    world["monkeypatch"].delenv("STAND_IN_STEP_S_0")  # nothing below needs a slow trial
    code, log = run(world, f"resume={sweep_id[:8]}", "max_parallel=2")
    assert code == 0, log
    assert sorted(e["index"] for e in events(world) if e["event"] == "start") == [0, 1]
    assert "1 already finished, running 2" in log
    assert [s for _, s, _ in by_trial(world, sweep_id)].count("FINISHED") == 3
    assert world["client"].get_run(sweep_id).info.status == "FINISHED"


def test_a_trial_an_alarm_stopped_is_a_result_and_the_others_go_on(world):
    world["script"]["0"] = "alarm"
    code, log = run(world, "values=[2e-3,2e-2,2e-1]", "max_parallel=2")
    assert code == 0, log
    parent = the_sweep(world)
    assert parent.info.status == "FINISHED" and parent.data.metrics["sweep/trials_alarm_stopped"] == 1
    assert [s for _, s, _ in by_trial(world, parent.info.run_id)] == ["KILLED", "FINISHED", "FINISHED"]
    assert "stopped by the alarm entropy_collapse: last val 10.0%, counted as its result" in " ".join(log.split())
    world["log"].unlink()
    assert run(world, f"resume={parent.info.run_id[:8]}", "max_parallel=2")[0] == 0
    assert events(world) == []  # nothing to run again


def test_ctrl_c_stops_every_trial_and_leaves_no_run_running(world, monkeypatch):
    """Trial 1 ends its step and its run KILLED by itself; trial 2 ignores the signal, is killed
    when the stop's time is up, and its run is ended KILLED for it."""
    import psutil
    from procs import alive

    from stapoctl.sweep import launchers

    monkeypatch.setattr(launchers.LocalTrials, "stop_wait_s", 3.0)
    monkeypatch.setenv("STAND_IN_STEP_S", "0.5")
    world["script"].update({"1": "stubborn"})

    def interrupt_once_both_run():
        # the stand-ins' 400 steps of 0.5 s leave 200 s to catch both running, however long a loaded
        # machine takes to start them (120 s was too short beside a full suite: the sweep then finished)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if {e["index"] for e in events(world) if e["event"] == "run"} == {0, 1}:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C reaches the sweep (the trials have their own sessions)
                return
            time.sleep(0.2)

    waiter = threading.Thread(target=interrupt_once_both_run, daemon=True)
    waiter.start()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code, log = run(world, "values=[2e-3,2e-1]", "max_parallel=2", "trainer.total_steps=400")
    waiter.join(timeout=1)
    assert code == 130, log
    parent = the_sweep(world)
    assert parent.info.status == "KILLED"
    assert parent.data.tags[layout.ERROR] == "interrupted (SIGINT) during trials 1, 2"
    runs = world["client"].search_runs([parent.info.experiment_id])
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
    assert [(t, s) for t, s, _ in by_trial(world, parent.info.run_id)] == [("0", "KILLED"), ("1", "KILLED")]
    ends = [e for e in events(world) if e["event"] == "end"]
    assert [(e["index"], e["status"]) for e in ends] == [(0, "KILLED")]  # trial 2 never got to end itself
    assert "stopping the trials at once" in log and f"resume={parent.info.run_id[:8]}" in log
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not [p for p in left if alive(p)]


def test_k_trials_that_do_not_fit_here_are_refused_in_one_line(world):
    args = ["values=[2e-3,2e-1]", "seeds=[0]", f"tracking.uri={world['uri']}", "cluster.num_cpus=2"]
    with pytest.raises(UserError) as exc:
        sweep_command("tau_p", [*args, "max_parallel=2"], Console(record=True))
    text = str(exc.value)
    assert "\n" not in text
    assert text.startswith("max_parallel=2: 2 trials at once need 2 × 2 CPU (1 rollout worker × 1 + "
                           "1 learner rank × 1) and this machine has 2 (1 for each trial's own Ray)")
    assert "rollout.cpus_per_worker=0.5 learner.cpus=0.5" in text
    assert not world["client"].search_experiments() or not world["client"].search_runs(
        [e.experiment_id for e in world["client"].search_experiments()])  # nothing was started
    console = Console(record=True, width=200)
    code = sweep_command("tau_p", [*args, "max_parallel=3", "rollout.cpus_per_worker=0.5", "learner.cpus=0.5"],
                         console, dry_run=True)
    # 3 asked, 2 trials: 2 at once, each in its own Ray of 1 CPU
    assert code == 0 and "would run 2 at once as `stapoctl train` processes here, cluster.num_cpus=1 each" \
        in console.export_text()
    for bad in ("max_parallel=0", "max_parallel=two"):
        with pytest.raises(UserError, match=f"{bad}: give the number of trials to run at once"):
            sweep_command("tau_p", [*args, bad], Console(record=True), dry_run=True)
    with pytest.raises(UserError, match="did you mean 'max_parallel'"):
        sweep_command("tau_p", [*args, "max_paralel=2"], Console(record=True), dry_run=True)


def test_on_slurm_max_parallel_is_the_array_parallelism(world, monkeypatch):
    import stapoctl.jobs.submit as submit

    seen = {}

    def fake_submit(base, per_trial, parent_run_id, name=None, console=None):
        seen["base"] = list(base)
        raise KeyboardInterrupt  # stop right after the submission: only the overrides matter here

    monkeypatch.setattr(submit, "submit_trials", fake_submit)
    args = ["values=[2e-3,2e-1]", "seeds=[0]", f"tracking.uri={world['uri']}", "cluster=slurm"]
    assert sweep_command("tau_p", [*args, "max_parallel=3"], Console(record=True)) == 130
    assert seen["base"][-1] == "cluster.array_parallelism=3"
    console = Console(record=True, width=200)
    sweep_command("tau_p", [*args, "cluster.array_parallelism=5"], console, dry_run=True)  # the alias
    assert "one SLURM job array (5 at once)" in console.export_text()
    with pytest.raises(UserError, match="max_parallel=3 and cluster.array_parallelism=5 disagree"):
        sweep_command("tau_p", [*args, "max_parallel=3", "cluster.array_parallelism=5"], Console(), dry_run=True)


def test_a_trial_as_a_ray_job_keeps_its_run_name_and_gets_time_to_stop():
    """The Ray job's command line composes back to the trial's config (the run name
    `tau_p=2e-3-seed0` holds '=': quoted), and a stop gives its driver time for a checkpoint."""
    import shlex

    from stapoctl.config.compose import compose_config
    from stapoctl.jobs.submit import ray_trial_job
    from stapoctl.sweep.definition import load_definition
    from stapoctl.sweep.plan import plan_trials

    trial = plan_trials(load_definition("tau_p"), "0" * 32, ("cluster=ray", "cluster.address=http://127.0.0.1:9"))[0]
    spec = ray_trial_job(list(trial.overrides), stop_wait_s=120)
    argv = shlex.split(spec.entrypoint)
    assert argv[1:4] == ["-m", "stapoctl.cli", "train"]
    conf = compose_config(argv[4:])
    assert conf.tracking.run_name == "tau_p=2e-3-seed0" and conf.cluster.address == "auto"
    assert conf.tracking.parent_run_id == "0" * 32 and dict(conf.tracking.tags)[layout.TRIAL] == "0"
    assert spec.runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "120"
