"""Ray's actor failures as one line: which process died and why, the `UserError` an actor's
constructor raised (Ray reports it only as the remote traceback's text), and what an actor's
method raised (`remote_error`: its name, the cause in one line, the remote stack kept apart)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from stapoctl.errors import UserError, exception_chain


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


@dataclass(frozen=True)
class RemoteError:
    """What an engine actor's method raised, from Ray's task error."""

    method: str  # "save", "train_step", … (the actor method's name)
    actor_id: str  # hex; "" when Ray did not say
    cause: str  # one line: the exception's type and first words
    stack: str  # the remote traceback, for the run's log file


def remote_error(exc: BaseException) -> Optional[RemoteError]:
    """The `RayTaskError` that `exc` is or was raised from (`raise … from`: an exception raised
    inside an actor method), else None. An error raised while merely handling one is not it."""
    from ray.exceptions import RayTaskError

    for e in exception_chain(exc, lambda e: (e.__cause__,)):
        if isinstance(e, RayTaskError):  # what ray.get raises is a copy that keeps only the cause and text
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
            named = re.findall(r"\w+", str(getattr(e, "function_name", None) or ""))
            head = re.search(r"ray::\w+\.(\w+)\(", text)
            actor = getattr(e, "_actor_id", None) or re.search(r"actor_id=([0-9a-f]+)", text)
            cause = getattr(e, "cause", None)
            return RemoteError(method=named[-1] if named else head.group(1) if head else "?",
                               actor_id=actor if isinstance(actor, str) else actor.group(1) if actor else "",
                               cause=one_line(cause if isinstance(cause, BaseException) else e),
                               stack=text)
    return None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first words` of an exception, whitespace folded into one line."""
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
