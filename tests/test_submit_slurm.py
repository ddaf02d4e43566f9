"""`stapoctl submit cluster=slurm` on a real single-node SLURM (slurmctld + slurmd + munge from
cluster/local-slurm/start.sh, which .ci/run starts before the suite and stops after).

1. The tiny experiment submitted with the CLI, requeued with `scontrol requeue` while it trains,
   followed with `stapoctl jobs logs --follow` to COMPLETED: one MLflow run, FINISHED, steps up
   to the last checkpoint logged once and the rest by the requeued attempt, tagged as resumed.
2. `stapoctl sweep tau_p cluster=slurm` with two values: one job array (submitit's map_array),
   the sweep's parent run FINISHED in the real MLflow store, both trials nested under it, FINISHED.
Without SLURM here the module is skipped with the reason; with STAPOCTL_REQUIRE_SLURM=1 (CI) a
missing SLURM fails instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _slurm_missing() -> str | None:
    if not shutil.which("sinfo"):
        return "no SLURM client (sinfo) here; start one with cluster/local-slurm/start.sh"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s (is slurmctld up?)"
    if out.returncode != 0 or not out.stdout.strip():
        return f"sinfo failed: {(out.stderr.strip().splitlines() or ['no partitions'])[0]}"
    return None


_MISSING = _slurm_missing()
if _MISSING and os.environ.get("STAPOCTL_REQUIRE_SLURM") == "1":
    raise RuntimeError(f"STAPOCTL_REQUIRE_SLURM=1 but {_MISSING}")
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

STEPS = 8  # long enough that the job is still training when the first checkpoint appears


def cli(*args: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    return subprocess.run([sys.executable, "-m", "stapoctl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**base, "COLUMNS": "200", **env})


def scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_for(what: str, check, timeout_s: float, poll_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)
    return value


@pytest.fixture(scope="module")
def requeued(shared_home, tmp_path_factory):
    """A job requeued after its first checkpoint and followed to the end."""
    store = f"sqlite:///{tmp_path_factory.mktemp('slurm_store') / 'mlflow.db'}"
    env = {"STAPOCTL_HOME": str(shared_home.home)}
    t0 = time.monotonic()
    res = cli("submit", "cluster=slurm", "cluster.preset=local", *shared_home.overrides,
              f"trainer.total_steps={STEPS}", "trainer.save_freq=1", "eval.every_n_steps=0",
              "tracking.run_name=slurm-requeue", f"tracking.uri={store}", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id = re.search(r"submitted SLURM job (\d+)", res.stdout).group(1)
    log = Path(re.search(r"log file: (\S+)", res.stdout).group(1))
    run_dir = log.parent / "runs" / job_id

    def checkpointed_or_over() -> bool:
        state = scontrol_job(job_id).get("JobState", "")
        assert state not in ("COMPLETED", "FAILED", "CANCELLED"), f"job ended ({state}) before the requeue: " + (
            log.read_text()[-3000:] if log.is_file() else "no log")
        return (run_dir / "checkpoints" / "latest").is_file()

    wait_for("the first checkpoint", checkpointed_or_over, timeout_s=900, poll_s=0.2)
    requeued_at = time.time()
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
    wait_for("the requeued job to be pending", lambda: scontrol_job(job_id).get("JobState") == "PENDING", 120)
    # SLURM holds a requeued job ~2 min before it is eligible again; release it now
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)
    followed = cli("jobs", "logs", job_id, "--follow", env=env)
    return {"job_id": job_id, "store": store, "env": env, "followed": followed, "run_dir": run_dir,
            "requeued_at": requeued_at, "wall_s": time.monotonic() - t0}


@pytest.mark.e2e
def test_requeued_job_resumes_and_completes(requeued):
    followed = requeued["followed"]
    assert followed.returncode == 0, followed.stdout[-4000:] + followed.stderr[-2000:]
    assert "(restart 1), resuming" in followed.stdout
    assert scontrol_job(requeued["job_id"])["Restarts"] == "1"
    assert scontrol_job(requeued["job_id"])["JobState"] == "COMPLETED"


@pytest.mark.e2e
def test_requeued_job_continues_the_same_mlflow_run(requeued):
    import mlflow

    client = mlflow.MlflowClient(requeued["store"])
    runs = client.search_runs([client.get_experiment_by_name("stapoctl").experiment_id])
    assert [r.info.run_name for r in runs] == ["slurm-requeue"]  # one run, not one per attempt
    run = runs[0]
    assert run.info.status == "FINISHED"
    resumed_from = Path(run.data.tags["stapoctl.resumed_from"])
    assert resumed_from.parent == requeued["run_dir"] / "checkpoints"
    last_ckpt = int(resumed_from.name.removeprefix("step_"))
    assert 1 <= last_ckpt < STEPS
    assert run.data.tags["stapoctl.slurm.restarts"] == "1"
    assert run.data.tags["stapoctl.slurm.job_id"] == requeued["job_id"]
    history = client.get_metric_history(run.info.run_id, "actor/pg_loss")
    cut = requeued["requeued_at"] * 1000
    # every step logged once; after the checkpoint it resumed from, each step was done by the new
    # attempt: logged after the requeue, or (a step the first attempt had already logged before it
    # was stopped) recomputed from the checkpoint on the same batch and named in replayed_steps
    replayed = run.data.tags.get("stapoctl.replayed_steps", "")
    first, _, last = replayed.partition("-")
    replayed_steps = set(range(int(first), int(last or first) + 1)) if replayed else set()
    assert "stapoctl.replay_mismatch" not in run.data.tags
    for step in range(1, STEPS + 1):
        records = [m for m in history if m.step == step]
        assert len(records) == 1, step
        if step > last_ckpt:
            assert records[0].timestamp > cut or step in replayed_steps, (step, replayed)


@pytest.mark.e2e
def test_jobs_list_and_status_show_the_slurm_job(requeued):
    listed = cli("jobs", "list", env=requeued["env"])
    row = next(line for line in listed.stdout.splitlines() if f" {requeued['job_id']} " in line)
    assert "slurm" in row and "slurm-requeue" in row and "COMPLETED" in row
    status = cli("jobs", "status", requeued["job_id"], env=requeued["env"])
    assert "Restarts=1" in status.stdout and "MLflow run" in status.stdout, status.stdout + status.stderr


@pytest.fixture(scope="module")
def array(shared_home, tmp_path_factory):
    """`stapoctl sweep tau_p cluster=slurm` with two values: one job array, followed to the end."""
    import mlflow
    from rich.console import Console

    from stapoctl.jobs import records
    from stapoctl.sweep.definition import parse_command
    from stapoctl.sweep.runner import run_sweep

    store = f"sqlite:///{tmp_path_factory.mktemp('array_store') / 'mlflow.db'}"
    args = ["values=[2e-3,2e-1]", "seeds=[0]", "cluster=slurm", "cluster.preset=local", "cluster.cpus_per_task=1",
            "cluster.num_cpus=2", *shared_home.overrides, "trainer.total_steps=2", "eval.every_n_steps=2",
            "trainer.save_freq=0", f"tracking.uri={store}"]
    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(shared_home.home))
    console = Console(record=True, width=200)
    t0 = time.monotonic()
    try:
        rc = run_sweep(parse_command("tau_p", args), console)
        rec = max((r for r in records.load_all() if r.kind == "array"), key=lambda r: r.local_id)
    finally:
        mp.undo()
    client = mlflow.MlflowClient(store)
    exp = client.get_experiment_by_name("stapoctl").experiment_id
    parent = client.search_runs([exp], "tags.`stapoctl.kind` = 'sweep'")[0]
    return {"rc": rc, "rec": rec, "store": store, "parent": parent, "log": console.export_text(),
            "wall_s": time.monotonic() - t0}


@pytest.mark.e2e
def test_sweep_trials_run_as_one_job_array(array):
    rec = array["rec"]
    assert array["rc"] == 0, array["log"][-4000:]
    assert rec.kind == "array" and len(rec.tasks) == 2
    assert rec.tasks == [f"{rec.job_id}_0", f"{rec.job_id}_1"]
    script = (Path(rec.folder) / f"{rec.job_id}_submission.sh").read_text()
    assert "#SBATCH --array=0-1%" in script  # the trials may run at once
    assert array["parent"].info.status == "FINISHED"


@pytest.mark.e2e
def test_array_trials_nest_under_the_sweep_parent(array):
    import mlflow

    client = mlflow.MlflowClient(array["store"])
    exp = client.get_experiment_by_name("stapoctl").experiment_id
    parent_id = array["parent"].info.run_id
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(r.info.run_name for r in children) == ["tau_p=2e-1-seed0", "tau_p=2e-3-seed0"]
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.tags["stapoctl.sweep_id"] == parent_id
        assert float(run.data.params["loss.tau_p"]) == float(run.data.tags["stapoctl.sweep_value"])
        assert [m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")] == [1, 2]


def test_a_partition_sinfo_does_not_list_is_refused_before_submitting(tmp_path):
    res = cli("submit", "cluster=slurm", "cluster.partition=no-such-partition", env={"STAPOCTL_HOME": str(tmp_path)})
    assert res.returncode == 2
    assert "cluster.partition='no-such-partition'" in res.stderr and "sinfo lists:" in res.stderr
    assert not (tmp_path / "jobs").exists()
