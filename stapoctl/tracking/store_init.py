"""One MLflow store opened by several stapoctl processes at once (a sweep and its trials, `ui`
beside a run, two runs started together) never crashes one of them.

MLflow creates and migrates a sqlite store's schema the first time a process opens it; two
processes doing that at the same moment on a fresh store crash one of them with a SQLAlchemy
traceback ("no such column: spans.dimension_attributes": one migrates while the other queries
half-made tables). So a process opens a sqlite store first under an exclusive `flock` on
`<db>.lock` beside it: one process creates the schema, the others wait and then find it complete.
MLflow keeps the opened store for the rest of the process, so the lock is taken once per store.
A server store (http) creates its schema in the server: nothing to do here.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import Optional

_OPENED: set[str] = set()
_GUARD = threading.Lock()  # the driver opens its store from a set-up thread too


def sqlite_path(uri: str) -> Optional[Path]:
    """The db file of a `sqlite:///…` uri (None for other stores and in-memory sqlite)."""
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])


def lock_path(uri: str) -> Optional[Path]:
    db = sqlite_path(uri)
    return db.with_name(db.name + ".lock") if db is not None else None


def ensure(uri: str) -> None:
    """Create (or migrate) a sqlite store's schema under its lock, once per process."""
    lock = lock_path(uri)
    if lock is None or uri in _OPENED:
        return
    with _GUARD:
        if uri in _OPENED:
            return
        from mlflow import MlflowClient

        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # the schema, made or checked
        finally:
            os.close(fd)
        _OPENED.add(uri)


def client(uri: str):
    """An `MlflowClient` on `uri`, its store opened through `ensure`."""
    from mlflow import MlflowClient

    ensure(uri)
    return MlflowClient(tracking_uri=uri)
