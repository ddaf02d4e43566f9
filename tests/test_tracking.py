"""Run records in a real MLflow sqlite store, read back through `stapoctl runs` / `compare`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two finished runs with 5 steps of curves, as a training run would log them."""
    from omegaconf import OmegaConf

    from stapoctl.tracking import mlflow_run

    tmp_path = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cwd = os.getcwd()
    os.chdir(tmp_path)  # MLflow's default artifact root would be ./mlruns of the cwd
    ids = {}
    for name, slope in (("grpo", 0.05), ("stapo", 0.1)):
        cfg = OmegaConf.create({"loss": {"name": name, "tau_p": 0.002}, "trainer": {"total_steps": 5}})
        with mlflow_run.start_run(uri=uri, experiment="stapoctl", run_name=name) as run:
            mlflow_run.log_config(cfg)
            for step in range(5):
                mlflow_run.log_metrics(
                    {"critic/score/mean": -0.5 + slope * step, "actor/entropy": 1.0 - 0.1 * step,
                     "stapo/spurious_ratio": 1e-4, "bad": float("nan")},
                    step=step,
                )
            ids[name] = run.info.run_id
    os.chdir(cwd)
    return uri, ids, tmp_path


def cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "stapoctl.cli", *args], capture_output=True, text=True,
        timeout=120, cwd=cwd, env={**os.environ, "COLUMNS": "250"},
    )


def test_config_and_metrics_land_in_the_store(store):
    from mlflow.tracking import MlflowClient

    uri, ids, tmp = store
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(ids["stapo"])
    assert run.data.params["loss.name"] == "stapo" and run.data.params["loss.tau_p"] == "0.002"
    hist = client.get_metric_history(ids["stapo"], "critic/score/mean")
    assert [round(h.value, 6) for h in sorted(hist, key=lambda h: h.step)] == [-0.5, -0.4, -0.3, -0.2, -0.1]
    assert "bad" not in run.data.metrics  # NaN is dropped, not logged
    # artifacts sit beside the sqlite db, not in the caller's working directory
    assert (tmp / "mlartifacts").is_dir() and not (tmp / "mlruns").exists()


def test_runs_lists_both(store):
    uri, ids, tmp = store
    res = cli("runs", "--uri", uri, cwd=tmp)
    assert res.returncode == 0, res.stderr
    assert ids["grpo"][:7] in res.stdout and ids["stapo"][:7] in res.stdout  # git-style short ids


def test_compare_prints_finals_and_writes_png(store):
    uri, ids, tmp = store
    out = tmp / "curves.png"
    res = cli("compare", ids["grpo"], ids["stapo"], "--uri", uri, "--out", str(out), cwd=tmp)
    assert res.returncode == 0, res.stderr
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    rows = {name: next(line for line in res.stdout.splitlines() if line.strip().startswith(name + " "))
            for name in ("grpo", "stapo")}  # one row per method (loss.name differs)
    assert "-0.3" in rows["grpo"] and "-0.1" in rows["stapo"]  # the last critic/score/mean


def test_unknown_run_is_one_line(store):
    uri, _, tmp = store
    res = cli("compare", "0" * 32, "--uri", uri, cwd=tmp)
    assert res.returncode == 2 and "no such MLflow run" in res.stderr and "Traceback" not in res.stderr
