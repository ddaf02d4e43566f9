"""Security: servers bind loopback unless asked (and warn when asked otherwise), secrets never reach
the MLflow store, and no shell is ever handed a string built from config values."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("stapoctl", "cluster", "benchmarks")
# (pattern, why it is refused, folders): a shell parses whatever a config string holds
FORBIDDEN = [
    (re.compile(r"shell\s*=\s*True"), "shell=True: pass an argument list instead", SCANNED),
    (re.compile(r"\bos\.system\s*\("), "os.system(: use subprocess with an argument list", SCANNED),
    (re.compile(r"\bos\.popen\s*\("), "os.popen(: use subprocess with an argument list", SCANNED),
    (re.compile(r"[\"']0\.0\.0\.0[\"']"), "a server bound to every interface by default: default to 127.0.0.1",
     ("stapoctl",)),
]


def forbidden_uses(root: Path, folders=SCANNED) -> list[str]:
    """'file:line: why' for every forbidden construct in the .py and .sh files under root/folders."""
    found = []
    for folder in folders:
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(p for p in base.rglob("*") if p.suffix in (".py", ".sh") and p.is_file()):
            rel = path.relative_to(root)
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for pattern, why, where in FORBIDDEN:
                    if folder in where and pattern.search(line):
                        found.append(f"{rel}:{number}: {why}")
    return found


def test_no_shell_strings_anywhere():
    found = forbidden_uses(ROOT)
    assert not found, "\n".join(found)


def test_the_scan_names_file_and_line(tmp_path):
    (tmp_path / "stapoctl").mkdir()
    (tmp_path / "stapoctl" / "bad.py").write_text("import os\n\nsubprocess.run(cmd, shell=True)\nos.system(cmd)\n")
    assert forbidden_uses(tmp_path) == [
        "stapoctl/bad.py:3: shell=True: pass an argument list instead",
        "stapoctl/bad.py:4: os.system(: use subprocess with an argument list",
    ]


# -- secrets -----------------------------------------------------------------------------------------
SECRETS = {
    "tracking.hf_token": "hf_SECRETtokenVALUE1",
    "tracking.apiKey": "sk-SECRETapiKEY2",
    "cluster.mlflow_tracking_password": "hunter2SECRET3",
    "cluster.aws_secret_access_key": "AKIASECRET4",
    "model.credentials.api_keys": "SECRETkeys5",
}


def test_secret_key_rule():
    from stapoctl.tracking.mlflow_run import is_secret_key

    for key in ("hf_token", "HF_TOKEN", "x.access_token", "apiKey", "api_keys", "aws_secret_access_key",
                "mlflow_tracking_password", "db_passwd", "secret", "ssh-key"):
        assert is_secret_key(key), key
    # schema fields that only look alike: counts and sizes stay visible
    for key in ("reward.model_verifier_max_tokens", "model.tiny.num_kv_heads", "tokenizer", "kv_cache_gb",
                "max_tokens", "tokens"):
        assert not is_secret_key(key), key


def test_no_schema_field_is_hidden():
    """Every field of the composed config of every loss stays visible in MLflow."""
    from stapoctl.config.compose import compose_config, to_flat_dict
    from stapoctl.losses import LOSSES
    from stapoctl.tracking.mlflow_run import is_secret_key

    keys = set()
    for name in LOSSES:
        keys |= set(to_flat_dict(compose_config([f"loss={name}"])))
    hidden = sorted(k for k in keys if is_secret_key(k))
    assert not hidden, f"these fields would be redacted in MLflow: {hidden}; rename them or narrow the rule"


def test_log_config_redacts_params_and_artifact(tmp_path):
    """Through a real MLflow store: secret values appear in neither the params nor config.yaml."""
    import mlflow

    from stapoctl.config.compose import compose_config
    from stapoctl.tracking import mlflow_run

    conf = compose_config([])
    OmegaConf.set_struct(conf, False)
    for key, value in SECRETS.items():
        OmegaConf.update(conf, key, value, force_add=True)
    conf.tracking.uri = "http://alice:SECRETinURL6@mlflow.example:5000"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with mlflow_run.start_run(uri=uri, experiment="security") as run:
        mlflow_run.log_config(conf)
        mlflow.set_tags(mlflow_run.env_snapshot())
    client = mlflow.MlflowClient(tracking_uri=uri)
    data = client.get_run(run.info.run_id).data
    yaml_text = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text()
    stored = "\n".join([*map(str, data.params.values()), *map(str, data.tags.values()), yaml_text])
    for value in [*SECRETS.values(), "SECRETinURL6"]:
        assert value not in stored
    for key in SECRETS:
        assert data.params[key] == mlflow_run.REDACTED
    assert data.params["tracking.uri"] == f"http://alice:{mlflow_run.REDACTED}@mlflow.example:5000"
    # legitimate look-alikes are logged as they are
    assert data.params["reward.model_verifier_max_tokens"] == "8"
    assert data.params["model.tiny.num_kv_heads"] == "2"
    assert "hf_token: " + mlflow_run.REDACTED in yaml_text


def test_env_snapshot_carries_no_environment_secrets(monkeypatch):
    from stapoctl.tracking.mlflow_run import env_snapshot

    monkeypatch.setenv("HF_TOKEN", "hf_ENVSECRET7")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "ENVSECRET8")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ENVSECRET9")
    snapshot = env_snapshot()
    assert not any("ENVSECRET" in f"{k}={v}" for k, v in snapshot.items())
    assert "version.mlflow" in snapshot


# -- bind addresses ------------------------------------------------------------------------------------
@pytest.mark.parametrize("host,warned", [("127.0.0.1", False), ("localhost", False), ("::1", False),
                                         ("0.0.0.0", True), ("192.168.1.5", True), ("my-host", True)])
def test_ui_warns_when_binding_beyond_loopback(monkeypatch, tmp_path, host, warned):
    from stapoctl import cli
    from stapoctl.tracking import runs

    asked = {}
    monkeypatch.setattr(runs, "serve_ui", lambda uri, h, port: asked.update(host=h) or 0)
    result = CliRunner().invoke(cli.app, ["ui", "--host", host, "--uri", f"sqlite:///{tmp_path}/x.db"])
    assert result.exit_code == 0, result.output
    assert asked["host"] == host
    assert ("warning: --host" in result.stderr) is warned, result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.engine  # ~15 s: MLflow's server start (as tests/test_ui_process.py)
def test_ui_server_listens_on_loopback_only(tmp_path):
    """The real `stapoctl ui` with no --host: its listening socket is 127.0.0.1, not every interface."""
    import psutil

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STAPOCTL_HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "stapoctl.cli", "ui", "--port", str(port),
                             "--uri", f"sqlite:///{tmp_path / 'mlflow.db'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        listening: list[str] = []
        deadline = time.monotonic() + 120
        while not listening and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            listening = [c.laddr.ip for c in psutil.net_connections(kind="tcp")
                         if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listening, f"the UI did not start: {proc.stdout.read1().decode() if proc.poll() is not None else ''}"
        assert set(listening) == {"127.0.0.1"}, listening
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
