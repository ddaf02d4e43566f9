"""`stapoctl ui` ended by a signal leaves no MLflow server or worker behind (no engines)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from stapoctl.tracking.runs import run_process_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_signal_ends_the_whole_group(sig):
    """A child that forks a grandchild (as mlflow server forks uvicorn): both end on the signal."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    cmd = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '301']); time.sleep(300)"]
    seen: list[psutil.Process] = []

    def send_later():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            seen[:] = [p for p in me.children(recursive=True) if p.pid not in before]
            try:
                if any(p.name() == "sleep" for p in seen):
                    break
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.1)
        os.kill(os.getpid(), sig)

    threading.Thread(target=send_later, daemon=True).start()
    start = time.monotonic()
    code = run_process_group(cmd, dict(os.environ), grace_s=2.0)
    assert code == 128 + sig and time.monotonic() - start < 25
    assert len(seen) >= 2, seen
    assert not _gone(seen, timeout=3)


@pytest.mark.engine  # ~15 s: MLflow's server start
def test_ui_sigterm_frees_the_port(tmp_path):
    port = _free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "STAPOCTL_HOME": str(tmp_path / "home")}
    ui = subprocess.Popen([sys.executable, "-m", "stapoctl.cli", "ui", "--port", str(port),
                           "--uri", f"sqlite:///{tmp_path / 'mlflow.db'}"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not _port_answers(port):
            assert ui.poll() is None, f"stapoctl ui exited with {ui.returncode}"
            assert time.monotonic() < deadline, "the MLflow UI never answered"
            time.sleep(0.3)
        children = psutil.Process(ui.pid).children(recursive=True)
        assert children
        ui.send_signal(signal.SIGTERM)
        ui.wait(timeout=10)
        assert not _gone(children, timeout=5), "MLflow processes outlived stapoctl ui"
        assert not _port_answers(port)
    finally:
        if ui.poll() is None:
            ui.kill()
