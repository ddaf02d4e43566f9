"""Where a dataset's rows come from (a file, a data root, the prep output, the hub) and how they
are normalized, de-duplicated and templated: shared by `load_rows` (training, evaluation) and
`stapoctl data prep`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console

from stapoctl import paths
from stapoctl.data import sources as S
from stapoctl.data.templates import render_prompt
from stapoctl.errors import UserError


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


def prep_progress(console: Console):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed} rows"),
        TimeElapsedColumn(), console=console, transient=True,
    )
