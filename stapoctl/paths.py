"""Where stapoctl keeps things on disk; one place so every module agrees."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """User cache root: models, prepared data, the default MLflow store (env STAPOCTL_HOME)."""
    root = Path(os.environ.get("STAPOCTL_HOME") or Path.home() / ".cache" / "stapoctl")
    root.mkdir(parents=True, exist_ok=True)
    return root


def data_root(configured: str | None = None) -> Path | None:
    """Folder of `<name>.jsonl` files tried before the hub (config data.root, env STAPOCTL_DATA)."""
    value = configured or os.environ.get("STAPOCTL_DATA")
    return Path(value).expanduser().resolve() if value else None


def project_root() -> Path:
    """The source checkout (editable install): holds experiments/, sweeps/, cluster/."""
    return Path(__file__).resolve().parent.parent


def experiments_dir() -> Path:
    """Hydra experiment files; STAPOCTL_EXPERIMENTS lets a user keep their own elsewhere."""
    return Path(os.environ.get("STAPOCTL_EXPERIMENTS") or project_root() / "experiments")


def default_tracking_uri() -> str:
    """MLflow's own env var wins; otherwise a sqlite store under the cache (file stores are deprecated)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"
