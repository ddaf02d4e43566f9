"""The console during training: a rich Live panel with a progress bar and the last steps'
numbers, so a collapse (reward to -1, entropy to 0) or a broken sync (logprob Δ) shows at once."""

from __future__ import annotations

from collections import deque
from typing import Optional

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

VAL_KEY = "val"  # the latest val/<bench>/<decoding>/avg@k, whatever k is

# (header, metric key, format)
COLUMNS = [
    ("step", None, "{}"),
    ("reward", "critic/score/mean", "{:+.2f}"),
    ("acc", "reward/accuracy", "{:.0%}"),
    ("val", VAL_KEY, "{:.1%}"),
    ("H", "actor/entropy", "{:.3f}"),
    ("spur", "stapo/spurious_ratio", "{:.2%}"),
    ("len", "response_length/mean", "{:.1f}"),
    ("Δlogp", "rollout/logprob_diff_max", "{:.0e}"),
    ("step s", "timing_s/step", "{:.2f}"),
]


def detail_line(step: int, m: dict) -> str:
    """The last step's time split and throughput (too wide for a table column)."""
    def g(key: str, fmt: str) -> str:
        return fmt.format(m[key]) if key in m else "-"

    return (
        f"step {step}: gen {g('timing_s/gen', '{:.2f}')} s ({g('perf/gen_tokens_per_s', '{:.0f}')} tok/s) · "
        f"reward {g('timing_s/reward', '{:.2f}')} s · ref {g('timing_s/ref', '{:.2f}')} s · "
        f"update {g('timing_s/update', '{:.2f}')} s ({g('perf/train_tokens_per_s', '{:.0f}')} tok/s) · "
        f"sync {g('timing_s/sync', '{:.3f}')} s"
    )


class LiveView:
    def __init__(self, console: Console, total_steps: int, start_step: int = 0, rows: int = 12, title: str = "train"):
        self.console = console
        self.rows: deque = deque(maxlen=rows)
        self.title = title
        self.last_val: Optional[float] = None
        self.detail = ""
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        # the title names the experiment, the status its phase: both rendered as markup by rich, so escaped
        self.task = self.progress.add_task(escape(title), total=total_steps, completed=start_step, info="")
        self.live = Live(self._render(), console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> "LiveView":
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.update(self._render())
        self.live.__exit__(*exc)

    def status(self, text: str) -> None:
        """A phase message (generating, updating, validating) next to the bar."""
        self.progress.update(self.task, info=escape(text))
        self.live.update(self._render())

    def step(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if key.startswith("val/") and "/avg_at_" in key:
                self.last_val = value
                break
        row = []
        for _, key, fmt in COLUMNS:
            if key is None:
                row.append(str(step))
                continue
            value = self.last_val if key == VAL_KEY else metrics.get(key)
            row.append(fmt.format(value) if value is not None else "-")
        if "timing_s/gen" in metrics:
            self.detail = detail_line(step, metrics)
        self.rows.append(row)
        self.progress.update(self.task, completed=step, info="")
        self.live.update(self._render())

    def _render(self):
        table = Table(title=escape(self.title), expand=False, box=box.SIMPLE_HEAD, pad_edge=False)
        for header, _, _ in COLUMNS:
            table.add_column(header, justify="right", no_wrap=True)
        for row in self.rows:
            table.add_row(*row)
        return Group(table, Text(self.detail, style="dim"), self.progress)
