"""One fresh sqlite MLflow store opened by several stapoctl processes at the same moment: none
crashes (MLflow's schema creation and migration runs under a lock beside the store, in one of
them; without it two of three such processes died here with SQLAlchemy / alembic tracebacks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# what `stapoctl train` / `sweep` do first with the store (mlflow_run.setup), then a read through
# the client `runs` and the sweep's store use; all start at the same instant
OPENER = r"""
import os, sys, time
uri, go, name = sys.argv[1], sys.argv[2], sys.argv[3]
from mlflow import MlflowClient  # the import is slow: done before the start line
from stapoctl.sweep import store
from stapoctl.tracking import mlflow_run
open(f"{go}.{name}", "w").close()  # imported; the test creates `go` once every opener has said so
while not os.path.exists(go):
    time.sleep(0.005)
mlflow_run.setup(uri, "shared")
c = store.client(uri)
run = c.create_run(c.get_experiment_by_name("shared").experiment_id, run_name=name)
print("opened", run.info.run_id)
"""


def test_processes_opening_one_fresh_store_at_once_all_succeed(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("MLFLOW_TRACKING_URI", None)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, uri, str(go), f"opener-{i}"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    deadline = time.monotonic() + 300
    while not all(tmp_path.joinpath(f"go.opener-{i}").exists() for i in range(3)):  # every one has imported MLflow
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate()[1][-3000:] for p in procs if p.poll() is not None]
        time.sleep(0.05)
    go.touch()
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and out.startswith("opened "), err[-3000:]
    assert (tmp_path / "fresh" / "mlflow.db.lock").is_file()
    runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("shared").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["opener-0", "opener-1", "opener-2"]


def test_ui_creates_the_store_through_the_lock_before_its_server(tmp_path, monkeypatch):
    import sqlite3

    from stapoctl.tracking import runs

    db = tmp_path / "ui" / "mlflow.db"
    seen = {}

    def fake_server(cmd, env, grace_s=5.0):
        with sqlite3.connect(db) as conn:
            seen["tables"] = {r[0] for r in conn.execute("select name from sqlite_master where type='table'")}
        seen["lock"] = db.with_name("mlflow.db.lock").is_file()
        seen["cmd"] = cmd
        return 0

    monkeypatch.setattr(runs, "run_process_group", fake_server)
    assert runs.serve_ui(f"sqlite:///{db}", "127.0.0.1", 5999) == 0
    assert seen["lock"] and {"experiments", "runs", "alembic_version"} <= seen["tables"], seen
    assert f"sqlite:///{db}" in seen["cmd"]
