"""`stapoctl submit cluster=ray`: the run as a Ray job, through the job server of a Ray cluster's
dashboard (`ray.job_submission.JobSubmissionClient`), and the `jobs` verbs for Ray job ids.

The job's entrypoint is the ordinary `stapoctl train <overrides> cluster.address=auto`: inside a
Ray job the driver joins the cluster the job runs on. How the code gets there
(`cluster.ship_code`): `path` puts this checkout on the job's PYTHONPATH and ships nothing (the
cluster runs on this machine or shares its filesystem, so the job uses this very code and
environment); `upload` ships the checkout as the job's working_dir, without .venv, .git, run
stores and caches; `auto` picks `path` for a loopback address and `upload` otherwise.

Token authentication (Ray >= 2.5x) stays on: the client sends the cluster's token, read the way
Ray reads it (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), unless RAY_AUTH_MODE is
`disabled`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence
from urllib.parse import urlparse

from rich.console import Console

from stapoctl import paths
from stapoctl.config import overrides as ov
from stapoctl.errors import UserError
from stapoctl.launch import engine_log

UPLOAD_EXCLUDES = [".venv", ".git", "mlruns", "mlartifacts", "*.db", "__pycache__", "*.pyc", ".pytest_cache",
                   "slurm_logs", "outputs", "multirun", ".hypothesis", "*.egg-info", "build", "dist"]
_clients: dict[str, Any] = {}  # address → its JobSubmissionClient, for the process's life


def normalize_address(address: Optional[str]) -> str:
    """cluster.address (or RAY_API_SERVER_ADDRESS) as the job server's http URL."""
    value = (address or os.environ.get("RAY_API_SERVER_ADDRESS") or "").strip()
    if not value:
        raise UserError(
            "cluster=ray needs cluster.address=http://HOST:8265 (the Ray dashboard's job server; "
            "`ray start --head` prints it)"
        )
    if value.startswith("ray://") or value == "auto":
        raise UserError(
            f"cluster.address={value}: submit talks to the job server, not the Ray client port; "
            "use the dashboard's http://HOST:8265"
        )
    if "://" not in value:
        value = f"http://{value}"
    url = urlparse(value)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise UserError(f"cluster.address={value}: expected http://HOST:PORT of the Ray job server")
    return value.rstrip("/")


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A quick TCP connect, so a wrong address fails in seconds with one line, not a stack."""
    url = urlparse(address)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise UserError(
            f"cluster.address={address}: no Ray job server answers there ({exc.strerror or exc}); "
            "start one with `ray start --head --dashboard-host 127.0.0.1` or fix the address"
        ) from exc


def is_loopback(address: str) -> bool:
    host = urlparse(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auth_headers() -> dict[str, str]:
    """The cluster token as an Authorization header, found where Ray itself looks for it."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return {}
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        for candidate in (os.environ.get("RAY_AUTH_TOKEN_PATH"), Path.home() / ".ray" / "auth_token"):
            if candidate and Path(candidate).is_file():
                token = Path(candidate).read_text().strip()
                break
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_terminal(state: str) -> bool:
    """Whether a job in this state (`status(...)["state"]`) is over, as Ray's JobStatus says."""
    from ray.job_submission import JobStatus

    return JobStatus(state).is_terminal()


def client(address: str):
    """One client per address: a poll every few seconds (`jobs`, the doctor, a sweep's Ray trials)
    would otherwise redo the connect check and the client's version request each time."""
    if address in _clients:
        return _clients[address]
    from ray.job_submission import JobSubmissionClient

    check_reachable(address)
    try:
        _clients[address] = JobSubmissionClient(address, headers=auth_headers())
        return _clients[address]
    except Exception as exc:  # ConnectionError, or a 401/403 wrapped in RuntimeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ""
        if "401" in str(exc) or "403" in str(exc) or "uthentication" in str(exc):
            hint = "; the cluster wants its token: set RAY_AUTH_TOKEN_PATH (or RAY_AUTH_TOKEN) to it"
        raise UserError(f"cluster.address={address}: {first}{hint}") from exc


@dataclass
class RayJobSpec:
    """What `submit_job` receives; printed as is by `--dry-run`."""

    address: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str] = field(default_factory=dict)
    entrypoint_num_cpus: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"address": self.address, "entrypoint": self.entrypoint, "runtime_env": self.runtime_env,
                "metadata": self.metadata, "entrypoint_num_cpus": self.entrypoint_num_cpus}


def job_spec(conf, overrides: list[str], run_name: str, tracking_uri: str,
             command: Sequence[str] = ("-m", "stapoctl.cli", "train")) -> RayJobSpec:
    """The Ray job for `train` (or another `command` of the interpreter, e.g. `stapoctl doctor`'s
    job body) with these overrides: entrypoint, runtime env, metadata."""
    address = normalize_address(conf.cluster.address)
    mode = str(conf.cluster.ship_code or "auto")
    if mode not in ("auto", "path", "upload"):
        raise UserError(f"cluster.ship_code='{mode}': use auto, path or upload")
    if mode == "auto":
        mode = "path" if is_loopback(address) else "upload"
    args = ov.drop(overrides, ("cluster.address", "tracking.run_name"))
    args += ["cluster.address=auto", f"tracking.run_name={_hydra_string(run_name)}"]
    # A driver's own ray.init(runtime_env=...) may set env vars the job also sets: let it win.
    env_vars = {"RAY_OVERRIDE_JOB_RUNTIME_ENV": "1", "PYTHONUNBUFFERED": "1"}
    if mode == "path":
        root = str(paths.project_root())
        pythonpath = [root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        env_vars.update(PYTHONPATH=os.pathsep.join(dict.fromkeys(pythonpath)), STAPOCTL_HOME=str(paths.home()))
        env_vars.update(engine_log.forwarded())  # tests only, this machine's file (launch/engine_log.py)
        args.append(f"tracking.uri={tracking_uri}")
        python = conf.cluster.python or sys.executable
        runtime_env: dict[str, Any] = {"env_vars": env_vars}
    else:
        if conf.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI"):
            args.append(f"tracking.uri={tracking_uri}")  # a server both sides reach; else the cluster's own
        python = conf.cluster.python or "python"
        runtime_env = {"working_dir": str(paths.project_root()), "excludes": list(UPLOAD_EXCLUDES),
                       "env_vars": env_vars}
    entrypoint = shlex.join([python, *command, *args])
    metadata = {"stapoctl.run_name": run_name, "stapoctl.experiment": str(conf.experiment),
                "stapoctl.ship_code": mode}
    return RayJobSpec(address, entrypoint, runtime_env, metadata)


def _hydra_string(text: str) -> str:
    """A value Hydra reads back as is: quoted when it holds `=`, `,`, spaces or brackets (a
    sweep trial's run name `tau_p=2e-3-seed0`)."""
    import re

    if re.fullmatch(r"[\w.\-/:@+]*", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def submit(spec: RayJobSpec) -> str:
    c = client(spec.address)
    try:
        return c.submit_job(entrypoint=spec.entrypoint, runtime_env=spec.runtime_env, metadata=spec.metadata,
                            entrypoint_num_cpus=spec.entrypoint_num_cpus)
    except RuntimeError as exc:
        raise UserError(f"the Ray job server at {spec.address} refused the job: {str(exc).splitlines()[0]}") from exc


def status(address: str, job_id: str) -> dict[str, Any]:
    info = _info(client(address), job_id, address)
    return {"state": str(info.status), "message": info.message or "", "start": info.start_time,
            "end": info.end_time, "entrypoint": info.entrypoint, "metadata": info.metadata or {}}


def _info(c, job_id: str, address: str):
    try:
        return c.get_job_info(job_id)
    except RuntimeError as exc:
        raise UserError(f"no Ray job '{job_id}' on {address} ({str(exc).splitlines()[0]})") from exc
    except OSError as exc:  # requests' errors: the server went away after its client was made
        _clients.pop(address, None)
        raise UserError(f"cluster.address={address}: the Ray job server stopped answering "
                        f"({type(exc).__name__}); check it (`ray status`) or wait and ask again") from exc


def logs(address: str, job_id: str) -> str:
    c = client(address)
    _info(c, job_id, address)
    return c.get_job_logs(job_id)


def stop(address: str, job_id: str) -> bool:
    c = client(address)
    _info(c, job_id, address)
    return bool(c.stop_job(job_id))


def list_jobs(address: str) -> list[dict[str, Any]]:
    return [{"job_id": j.submission_id, "state": str(j.status), "entrypoint": j.entrypoint,
             "metadata": j.metadata or {}} for j in client(address).list_jobs() if j.submission_id]


def follow(address: str, job_id: str, console: Console, poll_s: float = 2.0) -> str:
    """Stream the job's logs until it ends; returns its final state."""
    import logging

    c = client(address)
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)  # "WebSocket closed" notes

    async def tail() -> None:
        async for chunk in c.tail_job_logs(job_id):
            console.out(chunk, end="", highlight=False)

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        console.print(f"\n[yellow]stopped following; job {job_id} keeps running[/] "
                      f"(stapoctl jobs logs {job_id} --follow · stapoctl jobs stop {job_id})")
        raise
    except Exception as exc:  # the log stream broke (server restart): fall back to polling the state
        console.print(f"[yellow]log stream ended early ({type(exc).__name__}); waiting for the job's state[/]")
    while True:
        info = _info(c, job_id, address)
        if info.status.is_terminal():
            return str(info.status)
        time.sleep(poll_s)
