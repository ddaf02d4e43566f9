"""The doctor's rows: one per check, PASS / FAIL / N/A with a detail and, when it fails, the
one line that fixes it; the rich table they print as, their JSON form (what a Ray or SLURM job
sends back) and the exit code. Pure: nothing here touches the machine."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence

from rich.markup import escape
from rich.table import Table

PASS, FAIL, NA = "PASS", "FAIL", "N/A"
STATUSES = (PASS, FAIL, NA)
JSON_MARKER = "STAPOCTL-DOCTOR-ROWS "  # the line of a job's log that carries its rows
_STYLE = {PASS: "bold green", FAIL: "bold red", NA: "dim"}


@dataclass
class Row:
    check: str
    status: str
    detail: str = ""
    fix: str = ""  # one line; shown for a FAIL row only

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}: one of {', '.join(STATUSES)}")


def passed(check: str, detail: str = "") -> Row:
    return Row(check, PASS, detail)


def failed(check: str, detail: str, fix: str) -> Row:
    return Row(check, FAIL, detail, fix)


def not_applicable(check: str, detail: str = "") -> Row:
    return Row(check, NA, detail)


# how the fix of the project's one-line messages starts ("…: raise it, e.g. rollout.kv_cache_gb=1")
FIX_VERBS = frozenset("add check choose download drop fix free give install lower pick point raise re-save "
                      "remove resume run save set start turn use write".split())


def split_fix(message: str, fallback: str = "") -> tuple[str, str]:
    """(what is wrong, its fix) of a one-line `UserError` message.

    The project's messages read `what: problem: fix`, the fix an imperative (`set …`, `raise it`);
    a message whose last part is not one is all problem, and `fallback` is the fix."""
    message = " ".join(str(message).split())
    what, sep, tail = message.rpartition(": ")
    if sep and tail.split(" ", 1)[0].rstrip(",").lower() in FIX_VERBS:
        return what, tail
    return message, fallback


def from_error(check: str, exc: BaseException, fallback_fix: str) -> Row:
    """A FAIL row from an exception: a `UserError`'s own fix, else the check's."""
    from stapoctl.errors import UserError

    if isinstance(exc, UserError):
        what, fix = split_fix(str(exc), fallback_fix)
        return failed(check, what, fix or fallback_fix)
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return failed(check, f"{type(exc).__name__}: {first}" if first else type(exc).__name__, fallback_fix)


def exit_code(rows: Sequence[Row]) -> int:
    """0 when every applicable row passes (and there is one), else 1."""
    applicable = [r for r in rows if r.status != NA]
    return 0 if applicable and all(r.status == PASS for r in applicable) else 1


def table(rows: Iterable[Row], title: Optional[str] = None) -> Table:
    """One rich table, a row per check; a failing row's detail ends with its fix on its own line."""
    out = Table(title=escape(title) if title else title, title_justify="left", show_lines=False)  # a host name
    out.add_column("check", style="bold", no_wrap=True)
    out.add_column("status", no_wrap=True)
    out.add_column("detail", overflow="fold")
    for r in rows:
        detail = escape(r.detail)  # exceptions, paths, versions: text, never markup
        if r.status == FAIL and r.fix:
            detail = f"{detail}\n[yellow]fix:[/] {escape(r.fix)}" if detail else f"[yellow]fix:[/] {escape(r.fix)}"
        out.add_row(escape(r.check), f"[{_STYLE[r.status]}]{r.status}[/]", detail)
    return out


def summary(rows: Sequence[Row]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    verdict = "all applicable checks pass" if exit_code(rows) == 0 else f"{counts[FAIL]} check(s) FAIL"
    return f"{verdict} ({counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[NA]} N/A)"


def to_json(rows: Sequence[Row], **extra) -> str:
    return json.dumps({"rows": [asdict(r) for r in rows], **extra})


def from_json(text: str) -> tuple[list[Row], dict]:
    """(rows, the other fields) of `to_json`'s text."""
    data = json.loads(text)
    rows = [Row(**r) for r in data.pop("rows")]
    return rows, data


def find_json(log: str) -> Optional[str]:
    """The rows' JSON from a job's log: the last line that starts with JSON_MARKER."""
    for line in reversed(log.splitlines()):
        if line.startswith(JSON_MARKER):
            return line[len(JSON_MARKER):]
    return None
