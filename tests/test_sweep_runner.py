"""The sweep loop's bookkeeping on a real MLflow store, with the trainer replaced by a stand-in.

The stand-in writes what `train` writes (a child run nested by `tracking.parent_run_id`, tagged
by `tracking.tags`, per-step timings, the last step's validation) and fails on cue, so the
runner's decisions are checked in seconds: a failed trial is marked FAILED with its error and
the sweep goes on, a trial that failed before its run existed still gets a FAILED child, the
parent ends FAILED with the count and the command exits 1, an interrupt ends the runs KILLED,
and a resume runs only what did not finish. The real trainer and engines: test_sweep_e2e.py.
"""

from __future__ import annotations

import mlflow
import pytest
from rich.console import Console

from stapoctl.sweep import layout, store
from stapoctl.sweep.runner import sweep_command

STEPS = 2


@pytest.fixture()
def world(tmp_path, monkeypatch):
    """A store, and a stand-in trainer whose behaviour per trial index the test sets."""
    import stapoctl.trainer.driver as driver
    from stapoctl.errors import AlarmStopped
    from stapoctl.tracking import mlflow_run
    from stapoctl.trainer.run_status import final_status

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script: dict[int, str] = {}
    calls: list[int] = []

    def train(conf, console=None, session=None):
        index = int(conf.tracking.tags[layout.TRIAL])
        calls.append(index)
        what = script.get(index, "ok")
        if what == "before":
            raise FileNotFoundError("no dataset 'toy-train' under data.root\nsecond line")
        with mlflow_run.start_run(uri=conf.tracking.uri, experiment=conf.tracking.experiment,
                                  run_name=conf.tracking.run_name, parent_run_id=conf.tracking.parent_run_id,
                                  tags={"stapoctl.kind": "train", **conf.tracking.tags}) as run:
            mlflow.log_params({"trainer.total_steps": conf.trainer.total_steps, "loss.tau_p": conf.loss.tau_p})
            for step in range(1, STEPS + 1):
                mlflow_run.log_metrics({"timing_s/step": 0.01}, step=step)
                mlflow.set_tag("stapoctl.step", str(step))
                if what == "boom" and step == 1:
                    raise RuntimeError("learner rank 0 died")
                if what == "interrupt" and step == 1:
                    raise KeyboardInterrupt
                if what == "alarm" and step == 1:
                    break
            mlflow_run.log_metrics({"val/toy/train/avg_at_4": 0.25 * (index + 1), "timing_s/val": 0.01}, step=STEPS)
        if what == "alarm":  # what train does at trainer.alarm_action=stop: tags, KILLED, AlarmStopped
            stop = AlarmStopped("alarm entropy_collapse at step 1 (trainer.alarm_action=stop)", ("entropy_collapse",))
            status, tags = final_status(stop)
            client = mlflow.MlflowClient(conf.tracking.uri)
            for k, v in {**tags, "stapoctl.alarm.entropy_collapse": "1"}.items():
                client.set_tag(run.info.run_id, k, v)
            client.set_terminated(run.info.run_id, status)
            raise stop
        return {"run_id": run.info.run_id, "final": {"val/toy/train/avg_at_4": 0.25 * (index + 1)}}

    monkeypatch.setattr(driver, "train", train)
    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path / "home"))
    args = ["values=[2e-3,2e-2,2e-1]", "seeds=[0]", f"trainer.total_steps={STEPS}", f"tracking.uri={uri}"]
    return dict(uri=uri, script=script, calls=calls, args=args, client=mlflow.MlflowClient(uri))


def run(world, *extra):
    console = Console(record=True, width=200)
    code = sweep_command("tau_p", [*world["args"], *extra], console)
    return code, console.export_text()


def sweeps(world):
    c = world["client"]
    exp = c.get_experiment_by_name("stapoctl")
    return c.search_runs([exp.experiment_id], filter_string=f"tags.`{layout.KIND}` = 'sweep'")


def by_trial(world, sweep_id):
    return [(r.data.tags[layout.TRIAL], r.info.status, r.data.tags.get(layout.ERROR, ""))
            for r in store.children(sweep_id, world["uri"])]


def test_a_failed_trial_is_recorded_and_the_sweep_goes_on(world):
    world["script"].update({0: "boom", 1: "before"})
    code, log = run(world)
    assert code == 1 and world["calls"] == [0, 1, 2]
    (parent,) = sweeps(world)
    sweep_id = parent.info.run_id
    assert parent.info.status == "FAILED" and parent.data.tags[layout.ERROR] == "2 of 3 trials failed"
    assert sorted(by_trial(world, sweep_id)) == [
        ("0", "FAILED", "RuntimeError: learner rank 0 died"),
        ("1", "FAILED", "FileNotFoundError: no dataset 'toy-train' under data.root"),  # no run existed: one made
        ("2", "FINISHED", ""),
    ]
    assert parent.data.metrics["sweep/trials_failed"] == 2 and parent.data.metrics["sweep/trials_finished"] == 1
    assert "2 of 3 trials did not finish" in log and f"resume={sweep_id[:8]}" in log
    # the finished trial carries its timing; overhead = wall − (steps + validation)
    done = next(r for r in store.children(sweep_id, world["uri"]) if r.info.status == "FINISHED")
    m = done.data.metrics
    assert m[layout.M_WORK] == pytest.approx(0.03) and m[layout.M_OVERHEAD] == pytest.approx(m[layout.M_WALL] - 0.03)

    # resume: only the two failed trials run again, as new children; the failed ones stay
    world["script"].clear()
    world["calls"].clear()
    code, log = run(world, f"resume={sweep_id[:10]}")
    assert code == 0 and world["calls"] == [0, 1]
    assert "1 already finished, running 2" in log
    assert sorted(s for _, s, _ in by_trial(world, sweep_id)) == ["FAILED", "FAILED", "FINISHED", "FINISHED", "FINISHED"]
    parent = world["client"].get_run(sweep_id)
    assert parent.info.status == "FINISHED" and len(sweeps(world)) == 1
    # nothing left to do: a further resume runs no trial and still ends FINISHED
    world["calls"].clear()
    assert run(world, f"resume={sweep_id}")[0] == 0 and world["calls"] == []


def test_a_trial_an_alarm_stopped_is_a_result_and_the_sweep_goes_on(world):
    """trainer.alarm_action=stop ends one trial KILLED at its last validation: the next trials
    still run, the parent ends FINISHED, and a resume does not run that trial again."""
    world["script"][1] = "alarm"
    code, log = run(world)
    assert code == 0 and world["calls"] == [0, 1, 2]
    (parent,) = sweeps(world)
    sweep_id = parent.info.run_id
    assert parent.info.status == "FINISHED"
    assert sorted(by_trial(world, sweep_id)) == [("0", "FINISHED", ""), ("1", "KILLED", ""), ("2", "FINISHED", "")]
    m = parent.data.metrics
    assert (m["sweep/trials_alarm_stopped"], m["sweep/trials_failed"], m["sweep/trials_finished"]) == (1, 0, 3)
    assert "stopped by the alarm entropy_collapse: last val 50.0%, counted as its result" in log
    assert "KILLED (alarm)" in log and "1 of 3 trials were stopped by a run-health alarm" in log
    world["calls"].clear()
    code, log = run(world, f"resume={sweep_id[:8]}")
    assert code == 0 and world["calls"] == [] and "KILLED (alarm)" in log


def test_an_interrupt_ends_the_trial_and_the_sweep_killed(world):
    world["script"][1] = "interrupt"
    code, log = run(world)
    assert code == 130 and world["calls"] == [0, 1]
    (parent,) = sweeps(world)
    assert parent.info.status == "KILLED" and "interrupted (SIGINT) during trial 2" in parent.data.tags[layout.ERROR]
    assert sorted((t, s) for t, s, _ in by_trial(world, parent.info.run_id)) == [("0", "FINISHED"), ("1", "KILLED")]
    assert "runs ended KILLED" in log
    all_runs = world["client"].search_runs([parent.info.experiment_id])
    assert [r for r in all_runs if r.info.status == "RUNNING"] == []
