"""`stapoctl data prep`: any supported source → one normalized jsonl per dataset.

Rows come out as {id, prompt, answer, problem, <source fields>} with the STAPO instruction
applied through the chosen template. Every row read is accounted for: kept, duplicate or
malformed (reported with its line number; `--strict` stops at the first one instead).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.table import Table

from stapoctl import paths
from stapoctl.data import sources as S
from stapoctl.data.templates import render_prompt, tokenizer_for_template
from stapoctl.errors import UserError

MAX_REPORTED = 10  # malformed rows printed one by one; the rest are counted


@dataclass
class PrepStats:
    name: str
    origin: str  # the file or hub id the rows came from
    read: int = 0
    kept: int = 0
    duplicates: int = 0
    conflicting_duplicates: int = 0  # duplicates whose answer differs from the kept row's
    malformed: int = 0
    problems: list[str] = field(default_factory=list)  # "file:line: reason" for malformed rows
    out: str = ""
    seconds: float = 0.0


@dataclass
class Origin:
    label: str
    rows: Callable[[], Iterator[tuple[int, object]]]
    where: str  # how a line is named in messages: "file.jsonl:12" or "hub row 12"


def find_origin(name: str, data_cfg, source: str | None = None, split: str | None = None,
                *, include_prepped: bool = False) -> Origin:
    """--source FILE, else <data root>/<name>.jsonl, else (loading, not prepping) the prep
    output dir, else the hub."""
    spec = S.SOURCES[name]
    if source:
        path = Path(source).expanduser()
        if not path.is_file():
            raise UserError(f"--source {source}: no such file (give a .jsonl or .parquet path)")
        return Origin(str(path), lambda: S.read_file(path), str(path))
    roots = [paths.data_root(getattr(data_cfg, "root", None))]
    if include_prepped:
        roots.append(paths.home() / "data")
    for root in roots:
        found = S.local_file(name, root) if root is not None and root.is_dir() else None
        if found is not None:
            return Origin(str(found), lambda f=found: S.read_file(f), str(found))
    return Origin(f"hub:{spec.hub_id}", lambda: S.read_hub(spec, split), f"{spec.hub_id} row")


def normalized_rows(
    name: str,
    origin: Origin,
    *,
    strict: bool,
    on_row: Callable[[], None] | None = None,
) -> tuple[list[dict], PrepStats]:
    """Read, normalize, validate and (for DAPO) de-duplicate; counts everything it drops."""
    spec = S.SOURCES[name]
    stats = PrepStats(name=name, origin=origin.label)
    kept: list[dict] = []
    seen: dict[str, dict] = {}
    for index, raw in origin.rows():
        stats.read += 1
        if on_row is not None:
            on_row()
        try:
            row = S.normalize(spec, raw, index - 1)
        except S.MalformedRow as exc:
            where = f"{origin.where}:{index}" if origin.where.endswith((".jsonl", ".json", ".parquet")) else f"{origin.where} {index}"
            message = f"{where}: {exc}"
            if strict:
                raise UserError(f"{message} (fix the row, or drop --strict to skip malformed rows)") from None
            stats.malformed += 1
            stats.problems.append(message)
            continue
        if spec.dedupe:
            key = S.dedupe_key(row["problem"])
            first = seen.get(key)
            if first is not None:
                stats.duplicates += 1
                first.setdefault("duplicate_ids", []).append(row["id"])
                if row["answer"] != first["answer"]:
                    stats.conflicting_duplicates += 1
                continue
            seen[key] = row
        kept.append(row)
    stats.kept = len(kept)
    return kept, stats


def apply_template(rows: list[dict], *, template: str, instruction: str, tokenizer) -> list[dict]:
    """Put `prompt` first after `id`: the field the engines consume."""
    label = template if tokenizer is None else f"{template}:{Path(getattr(tokenizer, 'name_or_path', '')).name}"
    out = []
    for row in rows:
        prompt = render_prompt(row["problem"], template=template, instruction=instruction, tokenizer=tokenizer)
        rest = {k: v for k, v in row.items() if k not in ("id", "prompt", "answer")}
        out.append({"id": row["id"], "prompt": prompt, "answer": row["answer"], **rest, S.PREPPED: label})
    return out


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Atomic: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)


def chat_tokenizer_path(conf, template: str) -> str | None:
    """The tokenizer whose chat template frames the prompts: model.path's, or the tiny model's."""
    if template == "plain":
        return None
    if conf.model.path:
        from stapoctl.models.resolve import resolve_model

        return resolve_model(conf.model.path, conf)
    from stapoctl.models.tiny import ensure_tokenizer

    return str(ensure_tokenizer(conf.model, conf.data))


def prep_progress(console: Console):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed} rows"),
        TimeElapsedColumn(), console=console, transient=True,
    )


def prep_dataset(
    name: str,
    conf,
    *,
    source: str | None,
    out_dir: Path,
    strict: bool,
    template: str,
    console: Console,
) -> PrepStats:
    from stapoctl.data.registry import toy_source_rows

    started = time.perf_counter()
    name = S.canonical_name(name)
    tokenizer = tokenizer_for_template(template, chat_tokenizer_path(conf, template))
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
        console.print(f"[yellow]skipped malformed row[/] {message}", highlight=False)
    if len(stats.problems) > MAX_REPORTED:
        console.print(f"[yellow]… and {len(stats.problems) - MAX_REPORTED} more malformed rows[/]")
    return stats


def stats_table(all_stats: list[PrepStats], out_dir: Path) -> Table:
    table = Table(title="Prepared datasets", caption=f"written to {out_dir}/<dataset>.jsonl")
    table.add_column("dataset", no_wrap=True)
    table.add_column("source", overflow="fold")
    for col in ("read", "kept", "duplicates", "malformed"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in all_stats:
        dup = f"{s.duplicates}" + (f" ({s.conflicting_duplicates} conflicting)" if s.conflicting_duplicates else "")
        origin = Path(s.origin).name if os.path.sep in s.origin and not s.origin.startswith("hub:") else s.origin
        table.add_row(s.name, origin, str(s.read), str(s.kept), dup, str(s.malformed))
    return table


def prep_command(conf, *, name: str, source: str | None, out: str | None, strict: bool,
                 template: str, console: Console) -> list[PrepStats]:
    """What `stapoctl data prep NAME` runs: one dataset or `all`, then the counts table."""
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
        prep_dataset(n, conf, source=source, out_dir=out_dir, strict=strict, template=template, console=console)
        for n in names
    ]
    console.print(stats_table(all_stats, out_dir))
    return all_stats
