"""Process checks the process-tree tests share."""

from __future__ import annotations

import psutil


def alive(pid: int) -> bool:
    """Running and not a zombie; a process may exit between psutil's two questions (NoSuchProcess)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
