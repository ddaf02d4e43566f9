"""The sweep's line above each trial's live view: trial i of N, its value and seed, and an ETA
from the trials finished so far. A rich Live of its own; the trainer's LiveView nests under it
(rich ≥ 14 stacks nested Live displays), so the two compose without redrawing each other."""

from __future__ import annotations

import time
from typing import Optional

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class SweepView:
    def __init__(self, console: Console, name: str, total: int, done: int):
        self.console, self.total = console, total
        self.durations: list[float] = []
        self.started: Optional[float] = None
        self.progress = Progress(
            TextColumn("[bold magenta]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task(escape(f"sweep {name}"), total=total, completed=done, info="")
        self.live = Live(self.progress, console=console, refresh_per_second=2, transient=False)

    def __enter__(self) -> "SweepView":
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)
        if not self.console.is_terminal:
            self.console.line()  # rich leaves a nesting Live's last line open when not on a terminal

    def eta(self, remaining: int) -> str:
        if not self.durations:
            return "ETA after the first trial"
        return f"ETA {_duration(sum(self.durations) / len(self.durations) * remaining)}"

    def start(self, index: int, label: str, remaining: int) -> None:
        """`remaining`: trials still to run, this one included."""
        self.started = time.perf_counter()
        info = f"trial {index + 1}/{self.total} · [bold]{escape(label)}[/] · {self.eta(remaining)}"  # a run name
        self.progress.update(self.task, info=info)
        self.console.rule(f"[bold magenta]trial {index + 1}/{self.total}[/] · {escape(label)}", style="magenta")

    def finish(self, line: str) -> float:
        """The trial ended (any status): one summary line (markup: its run names and errors escaped by
        the caller); returns its duration."""
        seconds = time.perf_counter() - (self.started or time.perf_counter())
        self.durations.append(seconds)
        self.progress.advance(self.task)
        self.progress.update(self.task, info="")
        self.console.print(line, highlight=False)
        return seconds
