"""A disk that fills up while a checkpoint is written, without engines: the error recognised
through Ray's wrappers, the journal's own disk full (its records still sent).

The end-to-end chain (`stapoctl train` on a small tmpfs in an unprivileged mount namespace that
fills at a checkpoint: one line, FAILED, the previous checkpoint intact and the partial one gone,
the printed resume continuing once there is room) is one with resume × retention:
tests/test_resume_retention_e2e.py, which imports `_namespace_mounts` and `_LOG_LINE` from here.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from pathlib import Path

_LOG_LINE = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (INFO|WARNING) ")  # MLflow's own logging


def _namespace_mounts(tmp: Path) -> str:
    """Why a tmpfs cannot be mounted here (empty: it can)."""
    if shutil.which("unshare") is None:
        return "no `unshare` binary"
    (tmp / "probe").mkdir()
    res = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m none {tmp / 'probe'}"],
                         capture_output=True, text=True)
    return "" if res.returncode == 0 else f"an unprivileged mount namespace is not allowed here: {res.stderr.strip()}"


# -- without engines --------------------------------------------------------------------------
def test_disk_full_is_recognised_through_wrappers(tmp_path):
    from stapoctl.checkpoint import disk_full

    class RayLike(RuntimeError):  # Ray's task error: what the actor raised is its `cause`
        def __init__(self, cause):
            super().__init__("ray::Learner.save() ...")
            self.cause = cause

    for code in (errno.ENOSPC, errno.EDQUOT):
        found = disk_full(RayLike(OSError(code, os.strerror(code), "/x/state")))
        assert found is not None and found.errno == code and found.filename == "/x/state"
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("basic_ios::clear: iostream error")
    except RuntimeError as exc:
        assert disk_full(exc).errno == errno.ENOSPC
    assert disk_full(RuntimeError("unexpected pos 4747136 vs 4747028"), tmp_path) is None  # room: not a full disk
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None


class _FullDisk:
    """A journal file whose disk is full."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    flush = close = lambda self: None


def _fill(buf) -> None:
    buf._file.close()
    buf._file = _FullDisk()


def test_a_journal_on_a_full_disk_sends_its_records_and_says_where_they_went(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from stapoctl.tracking.metric_buffer import MetricBuffer

    monkeypatch.setenv("STAPOCTL_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    said: list[str] = []
    buf = MetricBuffer(tmp_path / "run", run_id, uri, say=said.append)
    buf.log_metrics({"a": 1.0}, 1)
    _fill(buf)
    buf.log_metrics({"a": 2.0}, 2)
    buf.end("FAILED")
    done = buf.close(30)
    assert done and client.get_run(run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run_id, "a")] == [1, 2]
    assert any("cannot be written (No space left on device)" in s for s in said)
    assert buf.close_note(done, 30) == (f"{buf.path} could not be written (No space left on device), so its last 2 "
                                        "records are not in it; they were sent to MLflow")

    # MLflow unreachable as well: the records go to a file elsewhere, and the note names it
    dead = MetricBuffer(tmp_path / "run2", run_id, "http://127.0.0.1:9", backoff_max_s=0.2)
    _fill(dead)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    dead.log_metrics({"b": 1.0}, 1)
    assert not dead.close(0.5)
    assert dead.spilled == tmp_path / "home" / "unsent" / f"{run_id}.mlflow_journal.jsonl"
    assert '"b":1.0' in dead.spilled.read_text()
    assert f"they are in {dead.spilled} (not sent by a resume)" in dead.close_note(False, 0.5)
