"""The test-only engine-start hook (stapoctl/launch/engine_log.py): one JSON line per start in the
file STAPOCTL_TEST_ENGINE_LOG names, written by `EngineLaunch.ready` and forwarded to jobs;
nothing at all when the variable is unset. No engines: the actors are stand-ins."""

from __future__ import annotations

import builtins
import json
import os
from pathlib import Path
from types import SimpleNamespace

from stapoctl.launch import engine_log

INFO = {"ray_s": 0.4, "vllm_init_s": 3.1, "learner_setup_s": 2.2, "engines_s": 4.5, "sync_method": "object_store",
        "nodes": {"rollout": ["n1"], "learner": ["n1"]}}


def test_a_start_is_one_json_line_with_its_phases_pid_and_the_running_test(tmp_path, monkeypatch):
    log = tmp_path / "starts.jsonl"
    Path(f"{log}.current").write_text("tests/test_x.py::test_y[a]")
    monkeypatch.setenv(engine_log.TEST_ENGINE_LOG, str(log))
    engine_log.record_start(INFO)
    engine_log.record_start({**INFO, "engines_s": 9.0})
    lines = log.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert {k: first[k] for k in INFO} == INFO
    assert first["pid"] == os.getpid() and first["module"] == "tests/test_x.py"
    assert first["test"] == "tests/test_x.py::test_y[a]" and first["time"] > 0
    assert json.loads(lines[1])["engines_s"] == 9.0


def test_unset_the_hook_opens_no_file_and_forwards_nothing(tmp_path, monkeypatch):
    session_log = Path(os.environ[engine_log.TEST_ENGINE_LOG])  # conftest sets it for the session
    size = session_log.stat().st_size if session_log.exists() else -1
    monkeypatch.delenv(engine_log.TEST_ENGINE_LOG)
    monkeypatch.chdir(tmp_path)
    opened: list = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    engine_log.record_start(INFO)
    monkeypatch.setattr(builtins, "open", real_open)
    assert opened == [] and list(tmp_path.iterdir()) == []
    assert (session_log.stat().st_size if session_log.exists() else -1) == size
    assert engine_log.forwarded() == {}


def test_ray_and_slurm_jobs_get_the_variable_where_it_is_set(tmp_path, monkeypatch):
    from stapoctl.config.compose import compose_config
    from stapoctl.jobs import ray_jobs, slurm

    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path))
    monkeypatch.setenv(engine_log.TEST_ENGINE_LOG, str(tmp_path / "starts.jsonl"))
    assert slurm.job_environment("sqlite:///x.db")[engine_log.TEST_ENGINE_LOG] == str(tmp_path / "starts.jsonl")
    here = ray_jobs.job_spec(compose_config(["cluster=ray", "cluster.address=http://127.0.0.1:8265"]), [], "r", "u")
    assert here.runtime_env["env_vars"][engine_log.TEST_ENGINE_LOG] == str(tmp_path / "starts.jsonl")
    # an uploaded job runs elsewhere: this machine's path would mean nothing there
    away = ray_jobs.job_spec(compose_config(["cluster=ray", "cluster.address=http://10.0.0.7:8265"]), [], "r", "u")
    assert engine_log.TEST_ENGINE_LOG not in away.runtime_env["env_vars"]
    monkeypatch.delenv(engine_log.TEST_ENGINE_LOG)
    assert engine_log.TEST_ENGINE_LOG not in slurm.job_environment("sqlite:///x.db")


class _Actor:
    def __init__(self, answer: dict):
        self.info = SimpleNamespace(remote=lambda: answer)


def test_engine_launch_ready_records_its_info(tmp_path, monkeypatch):
    """`EngineLaunch.ready` on stand-in actors (`ray.get` returns what it is given): the line it
    appends is the `Engines.info` it returns."""
    import ray

    from stapoctl.config.compose import compose_config
    from stapoctl.sync import transfer
    from stapoctl.trainer.engines import EngineLaunch

    log = tmp_path / "starts.jsonl"
    monkeypatch.setenv(engine_log.TEST_ENGINE_LOG, str(log))
    monkeypatch.setattr(ray, "get", lambda refs, **kw: refs)
    monkeypatch.setattr(transfer, "WeightSync", lambda *a, **k: SimpleNamespace(method="object_store"))
    worker = _Actor({"init_s": 3.0, "pad_token_id": 0, "eos_token_id": 1, "pid": 11, "node_id": "n"})
    launch = EngineLaunch(conf=compose_config([]), console=None, t0=0.0, t_ray=0.7, started_ray=True,
                          method="object_store", placement=None, workers=[worker], learners=[object()],
                          setup_refs=[{"setup_s": 2.0, "pid": 12, "node_id": "n"}])
    engines = launch.ready()
    (line,) = log.read_text().splitlines()
    got = json.loads(line)
    assert got["ray_s"] == 0.7 and got["vllm_init_s"] == 3.0 and got["learner_setup_s"] == 2.0
    assert got["engines_s"] == engines.info["engines_s"] and got["learner_pids"] == [12]


def test_record_actors_is_off_without_the_hook_and_waits_on_nothing(monkeypatch):
    """Unset, a start outside `EngineLaunch.ready` records nothing and never asks its actors."""
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"asked the actor for {name}")

    monkeypatch.delenv(engine_log.TEST_ENGINE_LOG)
    engine_log.record_actors("eval", 0.0, [Untouchable()], [Untouchable()])
