"""Ray's actor failures as one line: which process died and why, and the `UserError` an actor's
constructor raised (Ray reports it only as the remote traceback's text)."""

from __future__ import annotations

import re
from typing import Optional

from stapoctl.errors import UserError


def describe_actor_death(exc: BaseException) -> str:
    """One phrase from Ray's multi-line actor error: which process, and why it went away."""
    text = " ".join(str(exc).split())
    pid = re.search(r"pid: (\d+)", text)
    why = re.search(r"The actor is dead because ([^.]*)", text)
    exit_type = re.search(r"Worker exit type: (\S+)", text)
    parts = [f"pid {pid.group(1)}" if pid else None, why.group(1) if why else None,
             exit_type.group(1) if exit_type else None]
    parts = [p for p in parts if p]
    return ", ".join(parts) if parts else text[:160]


def user_error_in(exc: BaseException) -> Optional[UserError]:
    """The UserError an actor's constructor raised: Ray reports a failed creation task as an
    ActorDiedError carrying only the remote traceback's text."""
    found = re.search(r"stapoctl\.errors\.UserError: ([^\n]+)", str(exc))
    return UserError(found.group(1).strip()) if found else None
