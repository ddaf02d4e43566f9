"""A real 2-node Ray cluster on this machine: the rollout actors on one node, the learner on the other.

`ray start --head` (127.0.0.1, free ports, its own temp dir) advertises a custom resource
`rollout_node`, a second `ray start --address=…` advertises `learner_node`; the tiny experiment
asks for those resources per role (`rollout.resources`, `learner.resources`), so the weights
cross from one node's object store to the other's at every sync. The test stops only the two
node processes it started (each `ray start --block` runs in its own process group).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

RAY = str(Path(sys.executable).parent / "ray")
# `ray start` turns token authentication on by default while a client's default is off: the nodes,
# the probe and the stapoctl driver all run in token mode (the token: ~/.ray/auth_token), as the
# README tells a user to do
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}


def _free_port() -> int:
    from stapoctl.learner.engine_setup import free_port

    return free_port()


def _start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([RAY, "start", "--block", *args], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, **RAY_ENV})


def _wait_for_nodes(address: str, count: int, proc: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> None:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "print(len([n for n in ray.nodes() if n['Alive']]))")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # `ray start` refused or crashed: say why at once
            raise RuntimeError(f"`ray start` exited {proc.returncode}: {log.read_text()[-1500:]}")
        out = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True,
                             env={**os.environ, **RAY_ENV})
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(2)
    raise TimeoutError(f"the Ray cluster at {address} did not show {count} nodes in {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ray2_logs")
    temp_dir = tempfile.mkdtemp(prefix="stray", dir="/tmp")  # short: Ray's socket paths have a length limit
    subprocess.run([RAY, "get-auth-token", "--generate"], capture_output=True, env={**os.environ, **RAY_ENV})
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus=1", "--disable-usage-stats"]
    head = _start(["--head", "--include-dashboard=false", f"--port={port}", "--node-ip-address=127.0.0.1",
                   f"--temp-dir={temp_dir}",
                   f"--object-manager-port={_free_port()}", f"--node-manager-port={_free_port()}",
                   '--resources={"rollout_node": 1}', *common], logs / "head.log")
    procs = [head]
    try:
        _wait_for_nodes(address, 1, head, logs / "head.log")
        procs.append(_start([f"--address={address}", "--node-ip-address=127.0.0.1",
                             f"--object-manager-port={_free_port()}", f"--node-manager-port={_free_port()}",
                             '--resources={"learner_node": 1}', *common], logs / "worker.log"))
        _wait_for_nodes(address, 2, procs[-1], logs / "worker.log")
        yield address
    finally:
        for proc in reversed(procs):
            try:  # SIGTERM makes a node drain for up to 30 s; nothing runs on it any more
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_rollout_and_learner_run_on_different_nodes(cluster, tmp_path, shared_home):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, **RAY_ENV, "STAPOCTL_HOME": str(shared_home.home), "COLUMNS": "120"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "stapoctl.cli", "train", *shared_home.overrides, "trainer.total_steps=2",
           "trainer.save_freq=0", "eval.every_n_steps=0", f"cluster.address={cluster}",
           "+rollout.resources.rollout_node=1", "+learner.resources.learner_node=1", f"tracking.uri={uri}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("stapoctl").experiment_id])
    assert run.info.status == "FINISHED"
    nodes = json.loads(run.data.tags["stapoctl.nodes"])
    assert len(nodes["rollout"]) == len(nodes["learner"]) == 1
    assert nodes["rollout"][0] and nodes["learner"][0] and nodes["rollout"][0] != nodes["learner"][0]
    diffs = [m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff_max")]
    assert diffs and max(diffs) <= 1e-4  # the weights that crossed the nodes are the learner's
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")]
    assert steps == [1, 2]
