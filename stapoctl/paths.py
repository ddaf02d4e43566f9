"""Where stapoctl keeps things on disk; one place so every module agrees."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator


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


@contextlib.contextmanager
def atomic_path(path: Path, *, durable: bool = False) -> Iterator[Path]:
    """A fresh temp path beside `path` for the block to write (a name no other writer, process or
    thread, gets); when the block ends it replaces `path` whole (`os.replace`), so a reader sees
    the old file or the new one, never half of one; when the block raises it is removed.
    `durable`: the file and the directory entry fsynced too (a machine crash keeps it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: Path, text: str, *, durable: bool = False) -> None:
    """`path` holds `text` (UTF-8) whole or keeps what it held: `atomic_path`."""
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_text(text, encoding="utf-8")


def fsync_dir(path: Path) -> None:
    """The directory's entries (a rename, a new file) on disk; best effort where a filesystem
    cannot fsync a directory."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
