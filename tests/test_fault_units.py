"""The fault-tolerance parts that need no engine: checkpoint manifests, the metric journal
against a real MLflow sqlite store, pre-flight refusals, signal handling, final statuses.
(The engine-backed faults are in test_fault_recovery.py and test_fault_signals.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stapoctl.errors import RunFailed, RunStopped, UserError


# -- checkpoints ------------------------------------------------------------------------------
def _save(run_dir: Path, step: int, payload: bytes = b"weights") -> Path:
    from stapoctl import checkpoint

    def write(tmp: Path) -> None:
        (tmp / "model").mkdir()
        (tmp / "model" / "model.safetensors").write_bytes(payload * 100)
        (tmp / "state").mkdir()
        (tmp / "state" / "optim.pt").write_bytes(b"adam" * 50)

    return checkpoint.save(run_dir, step, write, {"step": step, "sampler": {"epoch": 0, "position": step}})


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    import hashlib

    step = _save(tmp_path, 2)
    manifest = json.loads((step / "manifest.json").read_text())["files"]
    assert set(manifest) == {"model/model.safetensors", "state/optim.pt", "trainer_state.json"}
    blob = (step / "model" / "model.safetensors").read_bytes()
    assert manifest["model/model.safetensors"] == {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}


def test_resume_skips_damaged_checkpoints_and_names_them(tmp_path):
    from stapoctl import checkpoint

    _save(tmp_path, 2)
    s4 = _save(tmp_path, 4)
    s6 = _save(tmp_path, 6)
    # step 6: same size, one flipped byte (only the checksum sees it); step 4: truncated
    blob = bytearray((s6 / "model" / "model.safetensors").read_bytes())
    blob[10] ^= 0xFF
    (s6 / "model" / "model.safetensors").write_bytes(bytes(blob))
    (s4 / "state" / "optim.pt").write_bytes(b"ada")
    warnings: list[str] = []
    found = checkpoint.resolve_resume(str(tmp_path), warn=warnings.append)
    assert found.name == "step_000002"
    assert any("step_000006" in w and "sha256" in w for w in warnings), warnings
    assert any("step_000004" in w and "bytes" in w for w in warnings), warnings
    # an explicit damaged step dir is refused, not loaded
    with pytest.raises(UserError, match="damaged"):
        checkpoint.resolve_resume(str(s6))
    # the cheap lookup (sizes only) still finds step 6 plausible; the resume lookup does not
    assert checkpoint.latest_step_dir(tmp_path).name == "step_000006"


def test_a_write_cut_short_is_never_picked_and_is_cleaned_at_resume(tmp_path):
    from stapoctl import checkpoint

    _save(tmp_path, 2)
    partial = tmp_path / "checkpoints" / ".step_000004.abcd"
    (partial / "model").mkdir(parents=True)
    (partial / "model" / "model.safetensors").write_bytes(b"half")
    # a kill between the rename and the update of `latest`: the newer complete dir still wins
    s3 = _save(tmp_path, 3)
    (tmp_path / "checkpoints" / "latest").write_text("step_000002\n")
    assert checkpoint.resolve_resume(str(tmp_path)) == s3.resolve()
    said: list[str] = []
    checkpoint.remove_partial_writes(tmp_path, warn=said.append)
    assert not partial.exists() and ".step_000004.abcd" in said[0]


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    from stapoctl import checkpoint

    _save(tmp_path, 2, b"old")
    again = _save(tmp_path, 2, b"new")
    assert checkpoint.verify(again) is None
    assert (again / "model" / "model.safetensors").read_bytes().startswith(b"new")
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


# -- the metric journal ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory):
    """One MLflow sqlite store for the module (creating its tables costs seconds)."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("journal_store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    return uri, client, client.create_experiment("t", artifact_location=(root / "art").as_uri())


@pytest.fixture
def store(sqlite_store, tmp_path):
    """A fresh run in the module's store and a run dir for its journal."""
    uri, client, exp = sqlite_store
    return uri, client, client.create_run(exp).info.run_id, tmp_path / "run"


def test_journal_sends_everything_once_and_a_restart_sends_the_rest(store):
    from stapoctl.tracking.metric_buffer import JOURNAL, SENT, MetricBuffer

    uri, client, run_id, run_dir = store
    buf = MetricBuffer(run_dir, run_id, uri)
    for step in range(1, 4):
        buf.log_metrics({"a": step, "b": 2.0 * step, "nan": float("nan")}, step)
    buf.set_tags({"stapoctl.step": "3"})
    assert buf.close(30)
    assert [m.step for m in client.get_metric_history(run_id, "a")] == [1, 2, 3]
    assert "nan" not in client.get_run(run_id).data.metrics
    # a process killed before it sent its last lines: they are in the journal, past the marker
    sent = int((run_dir / SENT).read_text())
    with open(run_dir / JOURNAL, "a") as f:
        f.write(json.dumps({"seq": sent + 1, "t": 1_700_000_000_000, "step": 4, "metrics": {"a": 4.0}}) + "\n")
        f.write('{"seq": 99, "step": 5, "metr')  # cut short mid-line by the kill
    buf2 = MetricBuffer(run_dir, run_id, uri)
    # the restarted process sees what was logged (repeat at a logged step is dropped)
    assert buf2.log_metrics({"a": 40.0, "c": 1.0}, 4) == {"c": 1.0}
    assert buf2.close(30)
    hist = {m.step: m.value for m in client.get_metric_history(run_id, "a")}
    assert hist == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    # re-sending a line already sent (a kill between the send and the marker) adds no point
    (run_dir / SENT).write_text("0\n")
    buf3 = MetricBuffer(run_dir, run_id, uri)
    assert buf3.close(30)
    assert len(client.get_metric_history(run_id, "a")) == 4


def test_journal_survives_an_unreachable_store_and_never_blocks(tmp_path, store):
    from stapoctl.tracking.metric_buffer import MetricBuffer

    uri, client, run_id, run_dir = store
    said: list[str] = []
    dead = MetricBuffer(run_dir, run_id, "http://127.0.0.1:9", say=said.append, backoff_max_s=0.2)
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        for step in range(1, 51):
            dead.log_metrics({f"k{i}": float(step + i) for i in range(40)}, step)
        assert not dead.close(1.0)  # nothing could be sent
    finally:
        del os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    assert dead.max_log_s < 0.05, dead.max_log_s  # 40 metrics per call, all while the store was down
    assert any("not answering" in s for s in said)
    # the store is back (here: the run's real store): the journal is sent by the next process
    back = MetricBuffer(run_dir, run_id, uri)
    assert back.close(60)
    assert len(client.get_metric_history(run_id, "k7")) == 50


def test_a_refused_record_does_not_block_the_rest(store):
    from stapoctl.tracking.metric_buffer import MetricBuffer

    uri, client, run_id, run_dir = store
    said: list[str] = []
    buf = MetricBuffer(run_dir, run_id, uri, say=said.append)
    buf.log_params({"lr": "1"})
    buf.log_params({"lr": "2"})  # MLflow refuses a changed param
    buf.log_metrics({"x": 1.0}, 1)
    assert buf.close(30)
    run = client.get_run(run_id)
    assert run.data.params["lr"] == "1" and run.data.metrics["x"] == 1.0
    assert any("refused" in s for s in said)


# -- pre-flight -----------------------------------------------------------------------------
def test_preflight_refuses_before_any_compute(tmp_path):
    from stapoctl.config.compose import compose_config
    from stapoctl.preflight.run_dir import run_preflight

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    conf = compose_config([f"trainer.output_dir={blocker}/run"])
    with pytest.raises(UserError, match=r"trainer.output_dir=.*cannot write there"):
        run_preflight(conf, f"sqlite:///{tmp_path / 'm.db'}")
    conf = compose_config([f"trainer.output_dir={tmp_path}/run", "trainer.min_free_gb=1e9"])
    with pytest.raises(UserError, match=r"GB free on its disk and trainer.min_free_gb=1e\+09"):
        run_preflight(conf, f"sqlite:///{tmp_path / 'm.db'}")
    conf = compose_config([f"trainer.output_dir={tmp_path}/run"])
    with pytest.raises(UserError, match="MLflow server does not answer"):
        run_preflight(conf, "http://127.0.0.1:9")
    assert run_preflight(conf, f"sqlite:///{tmp_path / 'm.db'}") == tmp_path / "run"


def test_cli_refuses_in_one_line_without_building_anything(tmp_path):
    home = tmp_path / "home"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "stapoctl.cli", "train", "trainer.output_dir=/proc/stapoctl-run",
                          f"tracking.uri=sqlite:///{tmp_path / 'm.db'}"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "STAPOCTL_HOME": str(home), "COLUMNS": "300"})
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in res.stderr, res.stderr
    assert not (home / "models").exists(), "the model was built before the refusal"
    assert not (tmp_path / "m.db").exists() or _no_runs(f"sqlite:///{tmp_path / 'm.db'}")
    assert time.monotonic() - t0 < 60


def _no_runs(uri: str) -> bool:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return not any(client.search_runs([e.experiment_id]) for e in client.search_experiments())


# -- signals and statuses ---------------------------------------------------------------------
def test_first_signal_waits_for_the_step_second_aborts():
    from stapoctl.trainer.signals import GracefulStop

    before = signal.getsignal(signal.SIGINT)  # whatever an earlier test or Ray left installed
    with GracefulStop() as stop:
        stop.in_loop, stop.step = True, 3
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert stop.requested == signal.SIGUSR1 and not stop.aborted
        with pytest.raises(RunStopped) as err:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        assert err.value.exit_code == 128 + signal.SIGUSR1 and "aborted during step 4" in str(err.value)
        # during the clean-up a further signal does not interrupt it
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is before  # the handler in place before is back


def test_the_same_signal_again_at_once_is_the_same_stop():
    """A burst (a dying sweep's parent-death signals) is one stop; the same signal later aborts."""
    from stapoctl.trainer.signals import SAME_STOP_S, GracefulStop

    with GracefulStop() as stop:
        stop.in_loop, stop.step = True, 3
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        assert stop.requested == signal.SIGTERM and not stop.aborted
        stop.received_at -= SAME_STOP_S  # a person's second SIGTERM, a second later
        with pytest.raises(RunStopped, match="aborted during step 4"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)


def test_before_the_loop_a_signal_aborts_at_once():
    from stapoctl.trainer.signals import GracefulStop

    with GracefulStop() as stop, pytest.raises(RunStopped, match="before the first step"):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
    assert stop.aborted


def test_final_status_names_the_reason():
    from stapoctl.trainer.run_status import final_status

    assert final_status(None) == ("FINISHED", {})
    assert final_status(RunStopped("SIGTERM: stopped after step 4", 15)) == (
        "KILLED", {"stapoctl.stop_reason": "SIGTERM: stopped after step 4"})
    assert final_status(KeyboardInterrupt())[0] == "KILLED"
    status, tags = final_status(RunFailed("learner rank 0 died (x): the run is FAILED"))
    assert status == "FAILED" and tags["stapoctl.error"].startswith("learner rank 0 died")
    assert final_status(ValueError("bad\nthing"))[1]["stapoctl.error"] == "ValueError: bad thing"


def test_a_run_dir_trains_in_one_process_at_a_time(tmp_path):
    from stapoctl.trainer.run_status import run_dir_lock

    with run_dir_lock(tmp_path):
        child = subprocess.run(
            [sys.executable, "-c", "import sys; from pathlib import Path; from stapoctl.trainer.run_status import "
             "run_dir_lock\nwith run_dir_lock(Path(sys.argv[1])): pass", str(tmp_path)],
            capture_output=True, text=True, timeout=60)
        assert child.returncode != 0 and f"in use by another stapoctl process (pid {os.getpid()})" in child.stderr
    with run_dir_lock(tmp_path):  # released on exit
        pass
