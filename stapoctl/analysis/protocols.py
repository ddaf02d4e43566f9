"""One evaluation protocol per table: `compare` refuses rows whose accuracies were measured under
different protocols (`eval/protocol.py`: benchmarks, k, decoding, max tokens, prompt, verifier,
answer extraction). A decoding or a system prompt moves accuracy by whole points, more than the
method differences a table is read for, so such a table is not evidence. `--mixed-protocols`
shows it anyway and the table says so. A run recorded before protocols were is "unknown": a
table of unknown runs only is shown as before, unknown beside tagged runs is refused."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from stapoctl.analysis.collect import Comparison
from stapoctl.errors import UserError
from stapoctl.tracking import keys

SHOWN_FIELDS = 6  # the refusal names this many differing fields, then "and N more"


@dataclass
class ProtocolCheck:
    """The protocols a table's runs were evaluated under, and whether they were mixed on request."""

    runs: dict[str, list[str]]  # protocol sha256 (or "unknown") → the run ids evaluated under it
    fields: list[str]  # the protocol fields that differ between them (empty: one protocol)
    mixed: bool = False  # shown together anyway (--mixed-protocols)

    @property
    def text(self) -> str:
        """`evaluation protocol 1a2b3c4d5e6f (12 runs)`, or the mixed warning."""
        if self.mixed:
            return (f"MIXED evaluation protocols (--mixed-protocols): {len(self.runs)} protocols, "
                    f"{_fields_text(self.fields, self.runs)}: these rows are not evidence against each other")
        if not self.runs:
            return "evaluation protocol: none (no accuracy in these runs)"
        (sha, ids), = self.runs.items()
        return f"evaluation protocol {_short(sha)} ({len(ids)} runs)"

    def to_json(self) -> dict:
        return {"mixed": self.mixed, "fields": self.fields, "runs": self.runs, "tag": keys.PROTOCOL,
                "artifact": keys.PROTOCOL_ARTIFACT}


def _short(sha: str) -> str:
    return sha if sha == keys.PROTOCOL_UNKNOWN else sha[:12]


def _fields_text(fields: list[str], runs: dict[str, list[str]]) -> str:
    unknown = len(runs.get(keys.PROTOCOL_UNKNOWN, []))
    parts = [f"{unknown} run(s) recorded before protocols were (unknown)"] if unknown else []
    if fields:
        more = f" and {len(fields) - SHOWN_FIELDS} more" if len(fields) > SHOWN_FIELDS else ""
        parts.append("fields that differ: " + ", ".join(fields[:SHOWN_FIELDS]) + more)
    elif len(runs) - (1 if unknown else 0) > 1:
        parts.append("fields that differ: not readable (a protocol artifact is missing)")
    return "; ".join(parts)


def _read(client, run_id: str) -> Optional[dict]:
    """A run's protocol JSON, None when its artifact cannot be read."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return json.loads(Path(client.download_artifacts(run_id, keys.PROTOCOL_ARTIFACT, tmp)).read_text())
    except Exception:
        return None


def protocol_runs(comp: Comparison) -> tuple[dict[str, list[str]], dict[str, str]]:
    """(protocol → the trial ids measured under it, protocol → a run holding its artifact), over
    the sources each trial's accuracies came from (a trial may mix its validation and an eval)."""
    runs: dict[str, list[str]] = {}
    holder: dict[str, str] = {}
    for t in comp.trials:
        for sha, rid in t.protocols.values():
            ids = runs.setdefault(sha, [])
            ids += [] if t.id in ids else [t.id]
            holder.setdefault(sha, rid)
    return runs, holder


def _where(comp: Comparison, runs: dict[str, list[str]]) -> str:
    """`1a2b3c4d5e6f: grpo ×3, wapo ×3; unknown: dapo ×2`."""
    group = {t.id: t.group for t in comp.trials}
    out = []
    for sha, ids in runs.items():
        counts: dict[str, int] = {}
        for rid in ids:
            counts[group[rid]] = counts.get(group[rid], 0) + 1
        out.append(f"{_short(sha)}: " + ", ".join(f"{g} ×{n}" for g, n in counts.items()))
    return "; ".join(out)


def check(comp: Comparison, client, mixed_ok: bool = False) -> ProtocolCheck:
    """One protocol (or unknown only): fine. Several: a one-line refusal naming the fields that
    differ and where each protocol is, unless mixed_ok (then a note says the same)."""
    runs, holder = protocol_runs(comp)
    if len(runs) <= 1:
        return ProtocolCheck(runs, [])
    from stapoctl.eval.protocol import differing_fields

    read = [_read(client, holder[sha]) for sha in runs if sha != keys.PROTOCOL_UNKNOWN]
    fields = differing_fields([p for p in read if p is not None]) if all(p is not None for p in read) else []
    what = f"{_fields_text(fields, runs)} ({_where(comp, runs)})"
    if not mixed_ok:
        raise UserError(f"compare: these runs were evaluated under {len(runs)} different protocols: {what}; "
                        "accuracy measured another way is not comparable: compare runs of one protocol, or pass "
                        "--mixed-protocols to show them together (the table then says so)")
    comp.notes.append(f"compare: MIXED evaluation protocols (--mixed-protocols): {what}")
    return ProtocolCheck(runs, fields, mixed=True)
