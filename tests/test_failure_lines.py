"""An exception raised inside an engine actor (a save, a weight sync, an update) reaches the user
as one line naming what failed and how to resume; the remote stack goes to `<run_dir>/errors.log`
and the run's journal (MLflow), not the terminal (no engines: Ray's task error built by hand)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from stapoctl.errors import RunFailed
from stapoctl.trainer.faults import engine_faults

STACK = "Traceback (most recent call last):\n  File \"state_io.py\", line 111, in _write_checkpoint\n" \
        "OSError: Repo id must be in the form 'repo_name'"


def _task_error(method: str, cause: BaseException, actor_id: str):
    from ray.exceptions import RayTaskError

    err = RayTaskError(f"Learner.{method}", STACK, cause, proctitle=f"ray::Learner.{method}()", pid=4242, ip="127.0.0.1",
                       actor_repr="<stapoctl.learner.deepspeed_learner.Learner object>", actor_id=actor_id)
    return err.as_instanceof_cause()  # what ray.get raises: also an instance of the cause's type


def _engines():
    handle = lambda hex_id: SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: hex_id))  # noqa: E731
    return SimpleNamespace(learners=[handle("aa"), handle("bb")], workers=[handle("cc")],
                           learner_rank_of=lambda exc: None)


@pytest.mark.parametrize("method, actor, doing", [
    ("save", "learner rank 1", "writing the step-15 checkpoint"),
    ("train_step", "learner rank 1", "the step-15 update"),
    ("update_weights", "rollout actor 0", "the weight sync after step 15"),
    ("receive_weights", "rollout actor 0", "the weight sync after step 15"),
    ("kv_cache_gib", "rollout actor 0", "kv_cache_gib() at step 15"),
])
def test_a_remote_exception_is_one_line_and_its_stack_is_kept(tmp_path, method, actor, doing):
    from stapoctl import checkpoint

    (tmp_path / "checkpoints" / "step_000010").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000010" / checkpoint.TRAINER_STATE).write_text('{"step": 10}')
    actor_id = "cc" if actor.startswith("rollout") else "bb"
    cause = OSError("Repo id must be in the form 'repo_name':\n'/run/checkpoints/step_000005/model'")
    with pytest.raises(RunFailed) as caught:
        with engine_faults(_engines(), "r" * 32, tmp_path, "sqlite:///x.db", lambda: 15):
            raise _task_error(method, cause, actor_id)
    line = str(caught.value)
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"{doing} failed in {actor} (OSError: Repo id must be in the form 'repo_name': "
                           f"'/run/checkpoints/step_000005/model'; its stack: {tmp_path / 'errors.log'}): "), line
    assert line.endswith("the run is FAILED; step_000010 is intact: fix that and resume with "
                         f"`stapoctl train resume={'r' * 32} tracking.uri=sqlite:///x.db`"), line
    log = (tmp_path / "errors.log").read_text()
    assert f"step 15: {actor}, {method}() raised" in log
    assert 'line 111, in _write_checkpoint\nOSError: Repo id must be' in log and "actor_id=" in log


def test_a_local_error_is_left_as_it_is(tmp_path):
    with pytest.raises(KeyError):
        with engine_faults(_engines(), "r" * 32, tmp_path):
            raise KeyError("a bug in the driver is a bug: its traceback stays")
    assert not (tmp_path / "errors.log").exists()


def test_the_stack_goes_to_the_mlflow_run(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from stapoctl.tracking.metric_buffer import MetricBuffer, activated

    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    buffer = MetricBuffer(tmp_path, run_id, uri)
    with activated(buffer), pytest.raises(RunFailed, match=r"and MLflow errors/step_000003\.txt\)"):
        with engine_faults(_engines(), run_id, tmp_path, step_of=lambda: 3):
            raise _task_error("save", ValueError("bad tokenizer_config.json"), "aa")
    assert buffer.close(30)
    text = client.download_artifacts(run_id, "errors/step_000003.txt", str(tmp_path / "dl"))
    assert "step 3: learner rank 0, save() raised" in Path(text).read_text()


def test_a_stop_or_a_bad_input_raised_meanwhile_stays_what_it_is(tmp_path):
    from stapoctl.errors import RunStopped, UserError

    for raised in (RunStopped("SIGTERM: stopped after step 3", 15), UserError("resume=x: no checkpoint")):
        with pytest.raises(type(raised)):
            with engine_faults(_engines(), "r" * 32, tmp_path):
                try:
                    raise _task_error("train_step", RuntimeError("boom"), "aa")
                except RuntimeError:
                    raise raised  # raised while handling the actor's error: not that error
    assert not (tmp_path / "errors.log").exists()
