"""`stapoctl data prep`: any supported source → one normalized jsonl per dataset.

Rows come out as {id, prompt, answer, problem, <source fields>} with the STAPO instruction
applied through the chosen template. Every row read is accounted for: kept, duplicate or
malformed (reported with its line number; `--strict` stops at the first one instead).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stapoctl import paths
from stapoctl.data import sources as S
from stapoctl.data.origin import PrepStats, apply_template, find_origin, normalized_rows, prep_progress
from stapoctl.data.registry import toy_source_rows
from stapoctl.data.templates import tokenizer_for_template
from stapoctl.errors import UserError, labelled

MAX_REPORTED = 10  # malformed rows printed one by one; the rest are counted


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Atomic: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with paths.atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")


def prep_dataset(
    name: str,
    conf,
    *,
    source: str | None,
    out_dir: Path,
    strict: bool,
    template: str,
    console: Console,
    tokenizer_path: Callable[[], str | None] | None = None,
) -> PrepStats:
    started = time.perf_counter()
    name = S.canonical_name(name)
    tokenizer = tokenizer_for_template(template, tokenizer_path() if tokenizer_path and template != "plain" else None)
    with prep_progress(console) as progress:
        task = progress.add_task(f"prep {name}", total=None)
        if S.SOURCES[name].kind == "toy":
            if source:
                raise UserError(f"--source does not apply to '{name}': the toy task is generated (data.toy.*)")
            rows = toy_source_rows(name, conf.data)
            stats = PrepStats(name=name, origin=f"generated (data.toy.seed={conf.data.toy.seed})",
                              read=len(rows), kept=len(rows))
            progress.update(task, completed=len(rows))
        else:
            origin = find_origin(name, conf.data, source)
            rows, stats = normalized_rows(name, origin, strict=strict,
                                          on_row=lambda: progress.advance(task))
        rows = apply_template(rows, template=template, instruction=conf.data.instruction, tokenizer=tokenizer)
    path = out_dir / f"{name}.jsonl"
    write_jsonl(rows, path)
    stats.out, stats.seconds = str(path), time.perf_counter() - started
    for message in stats.problems[:MAX_REPORTED]:
        console.print(labelled("skipped malformed row", message, "yellow"), highlight=False)  # the row's text
    if len(stats.problems) > MAX_REPORTED:
        console.print(f"[yellow]… and {len(stats.problems) - MAX_REPORTED} more malformed rows[/]")
    return stats


def stats_table(all_stats: list[PrepStats], out_dir: Path) -> Table:
    table = Table(title="Prepared datasets", caption=escape(f"written to {out_dir}/<dataset>.jsonl"))
    table.add_column("dataset", no_wrap=True)
    table.add_column("source", overflow="fold")
    for col in ("read", "kept", "duplicates", "malformed"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in all_stats:
        dup = f"{s.duplicates}" + (f" ({s.conflicting_duplicates} conflicting)" if s.conflicting_duplicates else "")
        origin = Path(s.origin).name if os.path.sep in s.origin and not s.origin.startswith("hub:") else s.origin
        table.add_row(s.name, escape(origin), str(s.read), str(s.kept), dup, str(s.malformed))
    return table


def prep_command(conf, *, name: str, source: str | None, out: str | None, strict: bool,
                 template: str, console: Console,
                 tokenizer_path: Callable[[], str | None] | None = None) -> list[PrepStats]:
    """What `stapoctl data prep NAME` runs: one dataset or `all`, then the counts table.
    `tokenizer_path()` gives the tokenizer whose chat template frames the prompts: the caller
    resolves the model (data/ sits below models/), only once a dataset is about to be written."""
    if template not in ("chat", "plain"):
        raise UserError(f"--template '{template}': use chat or plain")
    if name.strip().lower() == "all":
        names = list(S.SOURCES)
    else:
        names = [S.canonical_name(name)]
        if names == ["toy"]:
            names.append("toy-train")  # the toy task is one thing to the user: both splits
    if source and len(names) > 1:
        raise UserError("--source names one file: use it with a single dataset, not 'all'")
    out_dir = Path(out).expanduser() if out else paths.home() / "data"
    all_stats = [
        prep_dataset(n, conf, source=source, out_dir=out_dir, strict=strict, template=template, console=console,
                     tokenizer_path=tokenizer_path)
        for n in names
    ]
    console.print(stats_table(all_stats, out_dir))
    return all_stats
