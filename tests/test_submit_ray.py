"""`stapoctl submit cluster=ray` against a real Ray head with its dashboard/job server, started
here on 127.0.0.1 with free ports, its own temp dir and token authentication on (a token file of
its own, so nothing under ~/.ray is touched). The tiny experiment runs 2 steps as a Ray job,
followed to SUCCEEDED; its MLflow run must be FINISHED with both steps logged. Then the `jobs`
verbs, a stopped job, and a client without the token being refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

# `ray_head`: one Ray head for the session (tests/conftest.py), shared with test_doctor and
# test_sweep_parallel_e2e


def cli(*args: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """The CLI as a user runs it; Ray auth and MLflow settings come only from `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "MLFLOW_TRACKING"))}
    return subprocess.run([sys.executable, "-m", "stapoctl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**base, "COLUMNS": "200", **env})


@pytest.fixture(scope="module")
def submitted(ray_head, shared_home, tmp_path_factory):
    """The tiny experiment submitted as a Ray job and followed to its end."""
    store = tmp_path_factory.mktemp("ray_store") / "mlflow.db"
    # the client finds the token by RAY_AUTH_TOKEN_PATH alone (no RAY_AUTH_MODE needed)
    env = {"STAPOCTL_HOME": str(shared_home.home), "RAY_AUTH_TOKEN_PATH": str(ray_head["token"])}
    t0 = time.monotonic()
    res = cli("submit", "cluster=ray", f"cluster.address={ray_head['address']}", *shared_home.overrides,
              "trainer.total_steps=2", "eval.every_n_steps=0", "tracking.run_name=ray-job-e2e",
              f"tracking.uri=sqlite:///{store}", "--follow", env=env)
    return {"res": res, "env": env, "uri": f"sqlite:///{store}", "wall_s": time.monotonic() - t0}


def job_id_of(out: str) -> str:
    return next(w for w in out.split() if w.startswith("raysubmit_"))


@pytest.mark.e2e
def test_ray_job_runs_to_succeeded_and_its_mlflow_run_finishes(submitted):
    import mlflow

    res = submitted["res"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "submitted Ray job raysubmit_" in res.stdout
    assert "SUCCEEDED" in res.stdout
    assert "done · run" in res.stdout  # the trainer's own summary, streamed from the job's driver
    client = mlflow.MlflowClient(submitted["uri"])
    runs = client.search_runs([client.get_experiment_by_name("stapoctl").experiment_id],
                              "attributes.run_name = 'ray-job-e2e'")
    assert len(runs) == 1
    assert runs[0].info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "actor/pg_loss")] == [1, 2]
    assert runs[0].data.params["cluster.address"] == "auto"  # the driver joined the job's cluster


@pytest.mark.e2e
def test_jobs_verbs_know_the_ray_job(submitted):
    env = submitted["env"]
    job_id = job_id_of(submitted["res"].stdout)
    listed = cli("jobs", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if job_id in line)
    assert "ray" in row and "ray-job-e2e" in row and "SUCCEEDED" in row
    status = cli("jobs", "status", job_id, env=env)
    assert status.returncode == 0 and "SUCCEEDED" in status.stdout, status.stderr
    logs = cli("jobs", "logs", job_id, env=env)
    assert logs.returncode == 0 and "MLflow run" in logs.stdout
    # token authentication is on: a client that sends no token is refused, in one line
    refused = cli("jobs", "status", job_id, env={**env, "RAY_AUTH_MODE": "disabled"})
    assert refused.returncode == 2
    assert "token" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.e2e
def test_jobs_stop_stops_a_running_ray_job(submitted, ray_head, shared_home):
    env = submitted["env"]
    res = cli("submit", "cluster=ray", f"cluster.address={ray_head['address']}", *shared_home.overrides,
              "trainer.total_steps=500", "eval.every_n_steps=0", "tracking.run_name=ray-job-stopped",
              f"tracking.uri={submitted['uri']}", env=env)
    assert res.returncode == 0, res.stderr
    job_id = job_id_of(res.stdout)
    stop = cli("jobs", "stop", job_id, env=env)
    assert stop.returncode == 0 and "stop requested" in stop.stdout, stop.stdout + stop.stderr
    deadline = time.monotonic() + 60
    while "STOPPED" not in (status := cli("jobs", "status", job_id, env=env)).stdout:
        assert time.monotonic() < deadline, status.stdout
        time.sleep(2)
