"""Where a library already says it: the CPUs this process may use (its affinity, not the machine's
count), a rendezvous port held on the address it is given at, Ray's own terminal job states and
one job client per server, submitit's names for a task's files. Nothing here starts an engine."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest


def test_local_ray_gets_the_cpus_of_this_process_affinity(monkeypatch):
    import ray

    from stapoctl.launch import mkl_shim, ray_runtime

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3})  # a cpuset of 2 on a 64-core host
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(mkl_shim, "_mode", mkl_shim._mode)  # configure() sets it: restored after
    monkeypatch.setattr(mkl_shim, "_remote", mkl_shim._remote)
    asked = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: asked.update(kw))
    assert ray_runtime.ensure_ray(SimpleNamespace(address=None, num_cpus=None, num_gpus=None, mkl_amd_shim="off"))
    assert asked["num_cpus"] == 2


def test_rendezvous_port_is_held_on_the_address_it_is_given_at(monkeypatch):
    """Rank 0 answers with the node's address and a port its store listens on already (issue #49
    R4: a port found free and bound later may be taken meanwhile; tests/test_port_binding.py)."""
    import errno

    from stapoctl.learner import engine_setup

    monkeypatch.setattr(engine_setup, "node_ip", lambda: "127.0.0.2")  # the node's address, not 127.0.0.1
    rank0 = SimpleNamespace(world_size=2)
    host, port = engine_setup.EngineSetup.rendezvous(rank0, 5.0)
    assert host == "127.0.0.2" and port == rank0._rendezvous_store.port
    with socket.socket() as s, pytest.raises(OSError) as taken:  # and it is held there
        s.bind((host, port))
    assert taken.value.errno == errno.EADDRINUSE


def test_ray_job_states_and_one_client_per_server(monkeypatch):
    import requests
    from ray.job_submission import JobStatus

    from stapoctl.errors import UserError
    from stapoctl.jobs import ray_jobs

    assert [s for s in ("PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED") if ray_jobs.is_terminal(s)] == [
        "STOPPED", "SUCCEEDED", "FAILED"]
    made, states = [], iter([JobStatus.RUNNING, JobStatus.SUCCEEDED, None, JobStatus.FAILED])

    class FakeClient:
        def __init__(self, address, headers=None):
            made.append(address)

        def get_job_info(self, job_id):
            state = next(states)
            if state is None:
                raise requests.ConnectionError("server restarting")
            return SimpleNamespace(status=state, message="", start_time=0, end_time=None, entrypoint="x",
                                   metadata={})

    monkeypatch.setattr("ray.job_submission.JobSubmissionClient", FakeClient)
    monkeypatch.setattr(ray_jobs, "check_reachable", lambda address: None)
    monkeypatch.setattr(ray_jobs, "_clients", {})
    address = "http://10.0.0.1:8265"
    assert [ray_jobs.status(address, "j")["state"] for _ in range(2)] == ["RUNNING", "SUCCEEDED"]
    assert made == [address]  # polled twice, one client
    with pytest.raises(UserError, match="the Ray job server stopped answering"):
        ray_jobs.status(address, "j")
    assert ray_jobs.status(address, "j")["state"] == "FAILED" and made == [address, address]  # a fresh client


def test_slurm_task_files_are_where_submitit_writes_them(tmp_path):
    import submitit

    from stapoctl.jobs import records, slurm

    rec = records.JobRecord("slurm", "12", "run", "l1", folder=str(tmp_path), tasks=["12_0", "12_1"])
    paths = submitit.core.utils.JobPaths(tmp_path, job_id="12_1", task_id=0)
    assert slurm.log_path(rec, "12_1") == paths.stdout == tmp_path / "12_1_0_log.out"
    assert slurm.result(rec, "12_1") is None
    submitit.core.utils.cloudpickle_dump(("success", {"final": 0.5}), paths.result_pickle)
    assert slurm.result(rec, "12_1") == ("success", {"final": 0.5})
    assert slurm.task_state(rec, "12_1", live={}) == "COMPLETED"
