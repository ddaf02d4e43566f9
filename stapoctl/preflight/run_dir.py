"""Checks a run passes before it spends any compute: where its checkpoints go must be writable
and have room, and the MLflow store must answer. Each failure is one line naming the setting
and the fix (`UserError`, exit 2), instead of a crash at the first checkpoint an hour in."""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from stapoctl import paths
from stapoctl.errors import UserError


def output_root(conf: DictConfig, run_dir: Optional[Path] = None) -> tuple[Path, str]:
    """The directory the run writes into, and the setting that chose it (for the message)."""
    if run_dir is not None:
        return Path(run_dir), "the resumed run's dir"
    if conf.trainer.output_dir:
        return Path(str(conf.trainer.output_dir)).expanduser(), f"trainer.output_dir={conf.trainer.output_dir}"
    try:
        home = paths.home()
    except OSError as exc:
        raise UserError(f"STAPOCTL_HOME={os.environ.get('STAPOCTL_HOME', '~/.cache/stapoctl')}: cannot create it "
                        f"({exc.strerror or exc}): point STAPOCTL_HOME at a writable directory") from None
    return home / "runs", f"STAPOCTL_HOME/runs ({home / 'runs'})"


def check_writable(path: Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".stapoctl-write-probe.", dir=path)
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise UserError(f"{what}: cannot write there ({exc.strerror or exc}): choose a writable directory "
                        "(trainer.output_dir=… or STAPOCTL_HOME)") from None


def check_free_space(path: Path, what: str, min_free_gb: float) -> None:
    if min_free_gb <= 0:
        return
    free_gb = shutil.disk_usage(path).free / 1e9
    if free_gb < min_free_gb:
        raise UserError(f"{what}: only {free_gb:.2f} GB free on its disk and trainer.min_free_gb={min_free_gb:g}: "
                        "free space, write elsewhere (trainer.output_dir=…) or lower trainer.min_free_gb")


def check_tracking(uri: str, timeout_s: float = 5.0) -> None:
    """An http(s) MLflow server must answer /health; a sqlite store's directory must be writable."""
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as resp:
                if resp.status >= 400:
                    raise urllib.error.URLError(f"HTTP {resp.status}")
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UserError(f"tracking.uri={uri}: the MLflow server does not answer ({reason}): start it, or "
                            "point tracking.uri / MLFLOW_TRACKING_URI at a reachable store") from None
    elif uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        check_writable(db.parent, f"tracking.uri={uri}")


def run_preflight(conf: DictConfig, tracking_uri: str, run_dir: Optional[Path] = None) -> Path:
    """All checks; returns the directory the run writes into."""
    root, what = output_root(conf, run_dir)
    check_writable(root, what)
    check_free_space(root, what, float(conf.trainer.get("min_free_gb", 0) or 0))
    check_tracking(tracking_uri)
    return root
