"""`stapoctl compare`, `runs` and `ui` on a real MLflow sqlite store holding a small sweep laid
out as `stapoctl.tracking.keys` documents (parent run + nested trials), plus plain runs.

Metric values are chosen so the table cells can be computed by hand (see `FINAL`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TAUS = ("0.002", "0.02", "0.2")
SEEDS = (0, 1)
STEPS = 10
# final held-out accuracy (val/toy/train/avg_at_4 at the last step) per (τ_p, seed)
FINAL = {("0.002", 0): 0.70, ("0.002", 1): 0.74, ("0.02", 0): 0.60, ("0.02", 1): 0.66,
         ("0.2", 0): 0.40, ("0.2", 1): 0.44}
EVAL_OVERRIDE = 0.50  # an eval run nested under (0.2, seed 1) supersedes its validation number
METHODS = {"grpo": (0.30, 0.34), "stapo": (0.50, 0.56)}  # plain runs: final val per seed


def _train_metrics(step: int, final: float, seed: int, slope: float) -> dict:
    frac = step / STEPS
    return {"critic/score/mean": -1 + 2 * final * frac, "reward/accuracy": final * frac + 0.01 * seed,
            "actor/entropy": 0.8 - 0.3 * frac * slope, "stapo/spurious_ratio": 1e-4 * (1 + seed) * frac,
            "response_length/mean": 30 + 10 * frac + seed, "actor/pg_clipfrac": 0.01 * frac,
            "grad/lmhead_norm/spurious": 1.2 + 0.1 * seed, "grad/lmhead_norm/pos_normal": 1.0,
            "grad/lmhead_norm/neg": 0.9}


def _log_train(mlflow_run, keys, *, final: float, seed: int, slope: float, loss: str, tau: str) -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"loss": {"name": loss, "tau_p": float(tau), "tau_h": 0.2},
                            "trainer": {"seed": seed, "total_steps": STEPS},
                            "tracking": {"run_name": None}})
    mlflow_run.log_config(cfg)
    mlflow_run.log_metrics({"val/toy/train/avg_at_4": final - 0.3}, step=0)
    for step in range(1, STEPS + 1):
        m = _train_metrics(step, final, seed, slope)
        if step % 5 == 0:
            m["val/toy/train/avg_at_4"] = final - 0.3 * (1 - step / STEPS)
        mlflow_run.log_metrics(m, step=step)


def build_store(root: Path) -> dict:
    """A τ_p sweep (3 values × 2 seeds, one eval run nested under a trial) and 4 plain runs."""
    import mlflow

    from stapoctl.tracking import keys, mlflow_run

    uri = f"sqlite:///{root / 'mlflow.db'}"
    ids: dict = {"trials": {}, "plain": {}}
    with mlflow_run.start_run(uri=uri, experiment="stapoctl", run_name="sweep-tau_p",
                              tags={keys.KIND: keys.KIND_SWEEP, keys.SWEEP_NAME: "tau_p"}) as parent:
        sweep_id = parent.info.run_id
        mlflow.set_tag(keys.SWEEP_ID, sweep_id)
        mlflow.log_param(keys.SWEEP_KEY, "loss.tau_p")
        mlflow.log_text("name: tau_p\nkey: loss.tau_p\nvalues: [0.002, 0.02, 0.2]\nseeds: [0, 1]\n",
                        keys.SWEEP_DEFINITION)
    for tau in TAUS:
        for seed in SEEDS:
            tags = {keys.KIND: keys.KIND_TRAIN, keys.SWEEP_ID: sweep_id, keys.SWEEP_VALUE: tau,
                    keys.SEED: str(seed)}
            with mlflow_run.start_run(uri=uri, experiment="stapoctl", run_name=f"tau_p={tau}-seed{seed}",
                                      parent_run_id=sweep_id, tags=tags) as child:
                _log_train(mlflow_run, keys, final=FINAL[(tau, seed)], seed=seed, slope=float(tau) * 10,
                           loss="stapo", tau=tau)
                ids["trials"][(tau, seed)] = child.info.run_id
    trial = ids["trials"][("0.2", 1)]
    with mlflow_run.start_run(uri=uri, experiment="stapoctl", run_name="eval-step_000010", parent_run_id=trial,
                              tags={keys.KIND: keys.KIND_EVAL, keys.TRAIN_RUN_ID: trial}):
        mlflow_run.log_metrics({"eval/toy/train/avg_at_4": EVAL_OVERRIDE}, step=0)
    for loss, finals in METHODS.items():
        for seed, final in enumerate(finals):
            with mlflow_run.start_run(uri=uri, experiment="stapoctl", run_name=f"tiny-{loss}-seed{seed}",
                                      tags={keys.KIND: keys.KIND_TRAIN}) as run:
                _log_train(mlflow_run, keys, final=final, seed=seed, slope=1.0, loss=loss, tau="0.002")
                ids["plain"][(loss, seed)] = run.info.run_id
    return {"uri": uri, "sweep": sweep_id, **ids}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_store")
    cwd = os.getcwd()
    os.chdir(root)  # nothing may land in the caller's cwd
    try:
        ids = build_store(root)
    finally:
        os.chdir(cwd)
    return {**ids, "root": root}


class Result:
    def __init__(self, code: int, stdout: str, error: str = ""):
        self.returncode, self.stdout, self.stderr = code, stdout, error


def cli(*args, columns=200):
    """The CLI in-process (MLflow imports once, not per call); a UserError is exit 2 + its line,
    as `stapoctl.cli.main` turns it (tests/test_tracking.py checks that through a subprocess)."""
    from typer.testing import CliRunner

    from stapoctl import cli as stapoctl_cli
    from stapoctl.cli import app
    from stapoctl.errors import UserError

    # the CLI's console took its width from COLUMNS when `stapoctl.cli` was first imported in this
    # process (by whichever test that was): pin it for this call
    width, stapoctl_cli.console.width = stapoctl_cli.console.width, columns
    try:
        res = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(columns)})
    finally:
        stapoctl_cli.console.width = width
    if isinstance(res.exception, UserError):
        return Result(2, res.stdout, f"error: {res.exception}")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return Result(res.exit_code, res.stdout)


def cell(values, scale=100.0):
    mean = statistics.fmean(values) * scale
    return f"{mean:.2f} ± {statistics.stdev(values) * scale:.2f} ({len(values)})"


# -- compare a sweep --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compared(store):
    out = store["root"] / "cmp_sweep"
    res = cli("compare", store["sweep"][:8], "--uri", store["uri"], "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    return res, out


def test_compare_sweep_prints_the_table_by_value(compared):
    res, _ = compared
    lines = res.stdout.splitlines()
    assert any("loss.tau_p" in line and "Toy T=1.0" in line for line in lines)
    expected = {
        "0.002": cell([0.70, 0.74]),
        "0.02": cell([0.60, 0.66]),
        "0.2": cell([0.40, EVAL_OVERRIDE]),  # the nested eval run wins over the last validation
    }
    for tau, text in expected.items():
        row = next(line for line in lines if line.strip().startswith(tau + " "))
        assert text in row, (tau, row)
    assert "eval run avg@4" in res.stdout and "val avg@4" in res.stdout  # says where numbers come from


def test_compare_sweep_writes_table_and_figures(compared, store):
    import mlflow

    _, out = compared
    names = {p.name for p in out.iterdir()}
    assert {"table.md", "table.csv", "table.json", "accuracy_vs_loss.tau_p.png", "training_curves.png",
            "grad_norms.png"} <= names
    for png in out.glob("*.png"):
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 15_000, png
    data = json.loads((out / "table.json").read_text())
    row = next(r for r in data["rows"] if r["group"] == "0.02" and r["column"] == "toy/train")
    assert row["n"] == 2 and row["mean"] == pytest.approx(0.63) and row["std"] == pytest.approx(0.0424264, rel=1e-5)
    assert len(data["runs"]) == 6 and data["key"] == "loss.tau_p"
    assert "| 0.002 | " + cell([0.70, 0.74]) + " |" in (out / "table.md").read_text()
    # the same files are artifacts of the sweep's parent run
    client = mlflow.MlflowClient(store["uri"])
    logged = {Path(a.path).name for a in client.list_artifacts(store["sweep"], "compare")}
    assert names <= logged


def test_compare_groups_plain_runs_by_method(store):
    out = store["root"] / "cmp_plain"
    ids = [v[:7] for v in store["plain"].values()]
    res = cli("compare", *ids, "--uri", store["uri"], "--out", out)
    assert res.returncode == 0, res.stderr
    rows = {name: next(line for line in res.stdout.splitlines() if line.strip().startswith(name + " "))
            for name in METHODS}
    for name, finals in METHODS.items():
        assert cell(list(finals)) in rows[name]
    assert (out / "accuracy_by_loss.name.png").is_file() and (out / "training_curves.png").is_file()


def test_compare_unknown_and_ambiguous_ids_are_one_line(store):
    res = cli("compare", "0" * 32, "--uri", store["uri"])
    assert res.returncode == 2 and "no such MLflow run" in res.stderr and "Traceback" not in res.stderr
    res = cli("compare", "xyz", "--uri", store["uri"])
    assert res.returncode == 2 and "not a run id" in res.stderr


# -- runs ---------------------------------------------------------------------------------------
def test_runs_fits_80_columns_as_a_tree(store):
    from stapoctl.tracking.run_ids import short_ids

    res = cli("runs", "--uri", store["uri"], columns=80)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert "…" not in res.stdout  # nothing cut ("na…", "ki…")
    all_ids = [store["sweep"], *store["trials"].values(), *store["plain"].values()]
    short = short_ids(all_ids + [r for r in _all_run_ids(store["uri"])])
    for run_id in all_ids:
        assert short[run_id] in res.stdout and run_id not in res.stdout
    for name in ("tiny-grpo-seed0", "tiny-stapo-seed1", "sweep tau_p"):
        assert name in res.stdout
    # the trials sit indented under their sweep, in order, with value and seed
    at = next(i for i, line in enumerate(lines) if short[store["sweep"]] in line)
    kids = lines[at + 1 : at + 1 + 7]
    assert all(re.search(r"[├└]", k) for k in kids), "\n".join(kids)
    assert "0.002" in kids[0] and "seed 0" in kids[0] and "eval" in "\n".join(kids)


def _all_run_ids(uri):
    import mlflow

    client = mlflow.MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return [r.info.run_id for r in client.search_runs(exps, max_results=1000)]


def test_short_ids_are_git_like():
    from stapoctl.tracking.run_ids import short_ids

    ids = ["abcdef0123", "abcdef0999", "1234567890"]
    assert short_ids(ids) == {"abcdef0123": "abcdef01", "abcdef0999": "abcdef09", "1234567890": "1234567"}


# -- ui in a real browser ---------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chromium(tmp_path, url: str, *args: str) -> str:
    cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1900,1000",
           "--virtual-time-budget=15000", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'chrome'}", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (Debian packages chromium, "
                    "chromium-driver; .ci/run installs them)")
def test_ui_shows_the_sweep_trials_side_by_side(store, tmp_path):
    """`stapoctl ui` as a new user meets it: open the printed URLs in headless Chromium."""
    import urllib.request

    port = _free_port()
    log = tmp_path / "ui.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stapoctl.cli", "ui", "--port", str(port), "--uri", store["uri"]],
            stdout=fh, stderr=subprocess.STDOUT, cwd=store["root"], start_new_session=True,
            env={**os.environ, "COLUMNS": "200",
                 "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)})
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(1)
        urls = re.findall(r"http://127\.0\.0\.1:\d+/\S+", log.read_text())
        runs_url, sweep_url = urls[0], urls[1]
        # the runs table (not the GenAI overview), in the saved view plain runs share with sweeps
        assert runs_url.endswith("/#/experiments/1/runs?viewStateShareKey=stapoctl-runs")
        assert "viewStateShareKey=" in sweep_url
        import mlflow

        exp = mlflow.MlflowClient(store["uri"]).get_experiment("1")
        assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # a model-training experiment
        page = _chromium(tmp_path, runs_url, "--dump-dom")
        assert "sweep-tau_p" in page and "tiny-grpo-seed0" in page
        for column in ("val/toy/train/avg_at_4", "reward/accuracy", "actor/entropy", "stapo/spurious_ratio",
                       "loss.name"):
            assert column in page, column  # a plain run shows metric columns
        shot = tmp_path / "sweep_view.png"
        page = _chromium(tmp_path, sweep_url, "--dump-dom", f"--screenshot={shot}")
        for tau in TAUS:
            for seed in SEEDS:
                assert f"tau_p={tau}-seed{seed}" in page, (tau, seed)
        assert "val/toy/train/avg_at_4" in page and "loss.tau_p" in page  # metric and param columns
        assert shot.read_bytes()[:4] == b"\x89PNG"
        print(f"screenshot: {shot}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
