"""A hub model missing from the HF cache on an offline machine: one line before Ray (no engines)."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from stapoctl.errors import UserError
from stapoctl.preflight import hub

MODEL = "Qwen/Qwen3-8B-Base"


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    (home / "hub").mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(key, raising=False)
    hub._probe.cache_clear()
    yield home
    hub._probe.cache_clear()


@pytest.fixture
def no_network(monkeypatch):
    """Any TCP connect fails the test: the offline check must not touch the network."""
    real = socket.socket.connect

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            pytest.fail(f"network call to {address}")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


def _fake_snapshot(cache: Path, repo: str, kind: str = "models") -> None:
    root = cache / f"{kind}--{repo.replace('/', '--')}"
    (root / "snapshots" / "abc123").mkdir(parents=True)
    (root / "snapshots" / "abc123" / "config.json").write_text("{}")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("abc123")


def test_offline_missing_model_is_one_line(hf_home, no_network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as exc:
        hub.check_hub_model(MODEL, "model.path")
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"model.path={MODEL}:")
    assert str(hf_home / "hub") in message and "HF_HUB_OFFLINE is set" in message
    assert f"huggingface-cli download {MODEL}" in message and "HF_HOME" in message


def test_cached_model_passes_offline(hf_home, no_network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fake_snapshot(hf_home / "hub", MODEL)
    hub.check_hub_model(MODEL, "model.path")


def test_local_dir_and_tiny_are_not_hub_ids(tmp_path, hf_home, no_network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    hub.check_hub_model("org/name", "model.path")  # a relative local dir
    hub.check_hub_model("", "model.path")


def test_unreachable_hub_refuses(hf_home, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as s:  # a port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(UserError, match="cannot be reached"):
        hub.check_hub_model(MODEL, "reward.model_verifier")


def test_silent_hub_is_given_up_after_the_probe_limit(hf_home, monkeypatch):
    import time

    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "PROBE_S", 0.5)
    with socket.socket() as silent:  # accepts the connection (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        start = time.monotonic()
        with pytest.raises(UserError, match="did not answer within|cannot be reached"):
            hub.check_hub_model(MODEL, "model.path")
        assert time.monotonic() - start < 2


def test_reachable_hub_lets_the_download_happen(hf_home, monkeypatch):
    from huggingface_hub import constants

    asked: list[tuple[str, str]] = []

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            asked.append((self.command, self.path))
            self.send_response(404)  # any answer means reachable
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        hub.check_hub_model(MODEL, "model.path")
        assert asked == [("HEAD", "/")]  # the probe reached this server (and asked once)
    finally:
        server.shutdown()


def test_hub_dataset_offline(hf_home, no_network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match=r"^data.name dapo: the hub dataset org/ds is not in"):
        hub.check_hub_dataset("org/ds", "data.name dapo")
    (hf_home / "datasets" / "org___ds").mkdir(parents=True)  # the `datasets` library's own cache
    hub.check_hub_dataset("org/ds", "data.name dapo")
    _fake_snapshot(hf_home / "hub", "org/other", kind="datasets")
    hub.check_hub_dataset("org/other", "data.name dapo")


_NO_RAY_NO_NET = """
import socket, sys
import ray
def no_ray(*a, **k):
    sys.stderr.write("RAY-INIT-CALLED\\n"); raise SystemExit(9)
ray.init = no_ray
real = socket.socket.connect
def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        sys.stderr.write(f"NETWORK-CALL {address}\\n"); raise SystemExit(8)
    return real(self, address)
socket.socket.connect = connect
from stapoctl.cli import main
sys.argv = ["stapoctl", "train", "model=Qwen/Qwen3-8B-Base"]
main()
"""


def _ray_daemons() -> set[int]:
    found = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        text = (proc.info["name"] or "") + " " + " ".join(proc.info["cmdline"] or [])
        if "raylet" in text or "gcs_server" in text:
            found.add(proc.pid)
    return found


def test_train_offline_cli_exits_2_before_ray(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "MLFLOW_", "RAY_ADDRESS"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), STAPOCTL_HOME=str(tmp_path / "home"),
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", COLUMNS="400")
    before = _ray_daemons()  # a sweep on this machine may run its own Ray: only new ones count
    done = subprocess.run([sys.executable, "-c", _NO_RAY_NO_NET], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2, lines
    assert len(lines) == 1 and str(tmp_path / "hf" / "hub") in lines[0], lines
    assert "huggingface-cli download Qwen/Qwen3-8B-Base" in lines[0]
    assert not (_ray_daemons() - before)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "home" / "runs").exists()
