"""Per-sample eval records on disk: one JSONL per (benchmark, decoding, k, settings).

Each finished problem's k records are appended (and flushed) together, so an interrupted eval
keeps every finished problem and a rerun generates only the rest. A problem with fewer than
k records (a crash mid-write) is dropped on load and generated again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from stapoctl.errors import UserError
from stapoctl.paths import atomic_path


def settings_key(settings: Mapping[str, Any]) -> str:
    """Short hash of everything that changes the samples (model, decoding, lengths, seed)."""
    return hashlib.sha256(json.dumps(dict(settings), sort_keys=True, default=str).encode()).hexdigest()[:8]


def model_slug(model_path: str) -> str:
    """A readable, collision-safe directory name for a model dir or hub id."""
    parts = [p for p in re.split(r"[\\/]+", model_path.rstrip("/")) if p]
    tail = "-".join(parts[-3:]) if len(parts) > 1 else (parts[0] if parts else "model")
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", tail)[-60:]
    return f"{tail}-{hashlib.sha256(model_path.encode()).hexdigest()[:6]}"


class SampleStore:
    """The JSONL of one (bench, decoding): finished problems and appends of new ones."""

    def __init__(self, path: Path, k: int):
        self.path = Path(path)
        self.k = k
        self.records: list[dict] = []
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        lines = [ln for ln in self.path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        rows: list[dict] = []
        for lineno, line in enumerate(lines, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if lineno == len(lines):
                    break  # a torn last line from an interrupted write: that problem is redone
                raise UserError(f"{self.path}:{lineno} is not JSON: delete the file to regenerate it")
        counts: dict[str, int] = {}
        for r in rows:
            counts[str(r["id"])] = counts.get(str(r["id"]), 0) + 1
        complete = {pid for pid, c in counts.items() if c == self.k}
        self.records = [r for r in rows if str(r["id"]) in complete]
        if len(self.records) != len(rows):  # rewrite without the partial problems
            self._rewrite()

    def _rewrite(self) -> None:
        with atomic_path(self.path) as tmp, tmp.open("w", encoding="utf-8") as fh:
            for r in self.records:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")

    def done_ids(self) -> set[str]:
        return {str(r["id"]) for r in self.records}

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Append whole problems (all k samples each) and flush them to disk."""
        records = [dict(r) for r in records]
        if not records:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            for r in records:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.records.extend(records)

    def for_ids(self, ids: Iterable[str]) -> list[dict]:
        """Records of these problems only (the current --limit), in file order."""
        wanted = set(map(str, ids))
        return [r for r in self.records if str(r["id"]) in wanted]
