"""A disk that fills up while a checkpoint is written ends the run cleanly: one line (the dir,
its free space, the step, the resume command), the MLflow run FAILED, the previous checkpoint
intact and the partial one gone, and the printed `resume=` continues once there is room.

The end-to-end test runs `stapoctl train` on a small tmpfs mounted in an unprivileged mount
namespace (`unshare -rm`), sized so that the step-1 checkpoint fits and the step-2 one does not;
the tmpfs is then grown (`mount -o remount`: the space freed) and the printed command is run as
it stands. The journal's own part (its disk full, the records still sent) is tested without engines.
"""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_LOG_LINE = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (INFO|WARNING) ")  # MLflow's own logging

# Inside the namespace: train on a small tmpfs, keep what the test checks, grow the tmpfs, then run
# the resume command the error line printed (its leading `stapoctl` as `python -m stapoctl.cli`).
SCRIPT = r"""
set -u
mount -t tmpfs -o size="$SMALL" none "$MNT" || exit 90
"$PY" -m stapoctl.cli train "$@" trainer.output_dir="$MNT/run" >"$OUT/fail.out" 2>"$OUT/fail.err"
echo $? >"$OUT/fail.rc"
cp -a "$MNT/run" "$OUT/after_fail" && cp "$DB" "$OUT/after_fail.db"
mount -o remount,size="$BIG" none "$MNT" || exit 91
cmd=$(sed -n 's/.*`\(stapoctl train resume=[^`]*\)`.*/\1/p' "$OUT/fail.err" | head -n 1)
[ -n "$cmd" ] || exit 92
eval "\"\$PY\" -m stapoctl.cli ${cmd#stapoctl }" >"$OUT/resume.out" 2>"$OUT/resume.err"
echo $? >"$OUT/resume.rc"
cp -a "$MNT/run" "$OUT/after_resume"
"""


def _namespace_mounts(tmp: Path) -> str:
    """Why a tmpfs cannot be mounted here (empty: it can)."""
    if shutil.which("unshare") is None:
        return "no `unshare` binary"
    (tmp / "probe").mkdir()
    res = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m none {tmp / 'probe'}"],
                         capture_output=True, text=True)
    return "" if res.returncode == 0 else f"an unprivileged mount namespace is not allowed here: {res.stderr.strip()}"


def _plan_off() -> list[str]:
    """The checkpoint-space plan (where the config has one) refuses this run on purpose: it is off."""
    from stapoctl.config.compose import compose_config

    try:
        compose_config(["plan.enforce=false"])
    except Exception:
        return []
    return ["plan.enforce=false"]


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory, shared_home):
    tmp = tmp_path_factory.mktemp("disk_full")
    why = _namespace_mounts(tmp)
    if why:
        pytest.skip(f"needs a small tmpfs in a user mount namespace: {why}")
    # a checkpoint is ~3.7x the model's safetensors (7.7 MB for the tiny model: model/ plus
    # DeepSpeed's fp32 weights and two Adam moments): 1.55 of one fits, two do not
    ckpt = 3.7 * (shared_home.model_dir / "model.safetensors").stat().st_size
    db, out, mnt = tmp / "mlflow.db", tmp / "out", tmp / "mnt"
    out.mkdir()
    mnt.mkdir()
    args = [f"model.path={shared_home.model_dir}", "trainer.total_steps=2", "trainer.save_freq=1",
            "trainer.keep_checkpoints=0", "trainer.min_free_gb=0", "eval.every_n_steps=0",
            "trainer.val_before_train=false", f"tracking.uri=sqlite:///{db}", *_plan_off()]
    env = {**os.environ, "STAPOCTL_HOME": str(shared_home.home), "HF_HUB_OFFLINE": "1", "PY": sys.executable,
           "SMALL": f"{math.ceil(1.55 * ckpt / 2**20)}m", "BIG": f"{math.ceil(4 * ckpt / 2**20)}m",
           "MNT": str(mnt), "OUT": str(out), "DB": str(db),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("MLFLOW_TRACKING_URI", None)
    res = subprocess.run(["unshare", "-rm", "sh", "-c", SCRIPT, "sh", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"script exit {res.returncode}: {res.stderr[-3000:]}"
    text = {p.name: p.read_text() for p in out.glob("*.*") if p.is_file() and p.suffix in (".out", ".err", ".rc")}
    return {"kept": out, "store": f"sqlite:///{db}", "mnt": str(mnt), **text}


@pytest.mark.e2e
def test_disk_full_ends_in_one_line_failed_and_resumable(full_disk):
    from mlflow import MlflowClient

    from stapoctl import checkpoint

    kept, out, err = full_disk["kept"], full_disk["fail.out"], full_disk["fail.err"]
    assert full_disk["fail.rc"].strip() == "1", out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    said = [line for line in err.splitlines() if line.strip() and not _LOG_LINE.match(line)]
    assert len(said) == 1, said
    line = said[0]
    assert line.startswith("failed: disk full: the step-2 checkpoint could not be written to "
                           f"{full_disk['mnt']}/run/checkpoints (No space left on device; "), line
    assert re.search(r"; \d+(\.\d)? [kM]?B free there, step_000001 took \d+\.\d MB\)", line), line
    run_id = re.search(r"`stapoctl train resume=([0-9a-f]{32}) tracking\.uri=sqlite:///\S+`$", line).group(1)

    # the run is FAILED with that line; step 1 is whole, step 2's partial write is gone
    run = MlflowClient(f"sqlite:///{kept / 'after_fail.db'}").get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["stapoctl.error"] == line.removeprefix("failed: ")
    failed = kept / "after_fail"
    assert [p.name for p in checkpoint.step_dirs(failed)] == ["step_000001"]
    assert checkpoint.verify(failed / "checkpoints" / "step_000001", checksums=True) is None
    assert not checkpoint.partial_writes(failed)

    # the printed command, once there is room: continues from step 1 and finishes the run
    assert full_disk["resume.rc"].strip() == "0", full_disk["resume.out"][-3000:] + full_disk["resume.err"][-3000:]
    assert re.search(r"resuming from \S+/checkpoints/step_000001 \(step 1, MLflow run " + run_id,
                     " ".join(full_disk["resume.out"].split()))
    done = kept / "after_resume"
    assert [p.name for p in checkpoint.step_dirs(done)] == ["step_000002", "step_000001"]
    assert checkpoint.read_trainer_state(checkpoint.latest_step_dir(done, checksums=True))["step"] == 2
    assert MlflowClient(full_disk["store"]).get_run(run_id).info.status == "FINISHED"


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
