"""`stapoctl compare SWEEP_ID | RUN_ID...`: runs grouped by method or swept value, seeds
aggregated, in the layout of 000 Table 2, plus the figures of 000 Figs. 3–5.

Rows are the sweep's values (tag `stapoctl.sweep_value`) or, for plain runs, the config values
that differ between them (seeds and bookkeeping keys aside), so three seeds of GRPO and three
of STAPO give two rows. Cells are mean ± sample std over seeds with the seed count; the
final accuracy of a run is read as `keys` documents (own eval/… metric, nested eval run, last
validation). A last table tests each row against a baseline row over seeds
(`analysis/statistics.py`). Everything shown is also written as table.md / table.csv / table.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.markup import escape

from stapoctl.analysis import figures, protocols
from stapoctl.analysis.cells import accuracy_cells, default_test_metric, is_accuracy, seed_values
from stapoctl.analysis.collect import TRAINING_COLUMNS, Comparison, collect, mlflow_client, where
from stapoctl.analysis.inert_rows import row_lines
from stapoctl.analysis.statistics import (ALPHA, EXACT_SPLITS, N_RESAMPLES, POWER, RANDOM_STATE, RTOL, RowStats,
                                          Sample, against)
from stapoctl.analysis.protocols import ProtocolCheck
from stapoctl.analysis.tables import (STATS_TABLE, confirm_markdown, confirm_table, csv_text, markdown, records,
                                      stats_heading, stats_markdown, stats_table, tables)
from stapoctl.errors import UserError
from stapoctl.tracking import keys


def default_out(comp: Comparison) -> Path:
    ids = [s.info.run_id for s in comp.sweeps] or [t.id for t in comp.trials]
    tail = "_".join(comp.short[i] for i in ids[:3]) + ("_etc" if len(ids) > 3 else "")
    return Path(f"compare-{tail}")


@dataclass
class Tested:
    """The statistics of the "Against" table and what they were computed on."""

    metric: str
    baseline: str
    scale: float  # the table shows value × scale (100 for accuracy)
    delta: Optional[float]  # --seeds-needed, in table units
    rows: list[RowStats]

    @property
    def heading(self) -> str:
        return stats_heading(self.baseline, self.metric, self.scale)


def only_rows(comp: Comparison, rows: Sequence[str]) -> Comparison:
    """Keep the named rows (e.g. an ablation's four out of two merged sweeps); one line if one is unknown."""
    if not rows:
        return comp
    unknown = [r for r in rows if r not in comp.groups]
    if unknown:
        raise UserError(f"compare --rows: no row {', '.join(unknown)} (rows: {', '.join(comp.groups)})")
    comp.groups = {r: comp.groups[r] for r in rows}
    return comp


def pick_baseline(groups: Sequence[str], baseline: Optional[str]) -> str:
    """--baseline, else `grpo` when it is a row, else the first row."""
    if baseline is None:
        return "grpo" if "grpo" in groups else groups[0]
    if baseline not in groups:
        raise UserError(f"compare: --baseline {baseline!r} is not a row; rows: " + ", ".join(groups))
    return baseline


def test_rows(comp: Comparison, test_metric: Optional[str], baseline: Optional[str],
              delta: Optional[float]) -> Optional[Tested]:
    """Statistics of the tested metric per row against the baseline; None with nothing to test."""
    base = pick_baseline(list(comp.groups), baseline)
    metric = test_metric or default_test_metric(comp)
    if metric is None:
        return None
    values, missing = seed_values(comp, metric)
    if not any(values.values()):
        cols = list(next(iter(accuracy_cells(comp).values()), {}).keys())
        raise UserError(f"compare: --test-metric {metric!r}: no run has it (a finite value); accuracy columns: "
                        + (", ".join(cols) or "none") + ", or a logged metric name")
    if missing:
        gone = [(t, why) for ts in missing.values() for t, why in ts]
        comp.notes.append(f"compare: {metric}: left out {len(gone)} trial(s) without a final value: " + ", ".join(
            f"{comp.short.get(t.id, t.id[:8])} ({where(comp.key, t.group, t.seed)}, {why})" for t, why in gone))
    scale = 100.0 if is_accuracy(comp, metric) else 1.0
    samples = [Sample(g, [v for _, v in sv], [s for s, _ in sv]) for g, sv in values.items()]
    rows = against(samples, base, None if delta is None else delta / scale)
    for r in rows:
        r.trials_lost = len(comp.lost.get(r.group, [])) + len(missing.get(r.group, []))
        r.alarm_stopped = sum(1 for t in comp.groups[r.group] if t.alarms)
    return Tested(metric, base, scale, delta, rows)


def compare(uri: Optional[str], ids: Sequence[str], console: Console, metrics: Sequence[str] = (),
            out: Optional[str] = None, test_metric: Optional[str] = None, baseline: Optional[str] = None,
            seeds_delta: Optional[float] = None, rows: Sequence[str] = (),
            mixed_protocols: bool = False) -> dict[str, Path]:
    """Print the tables (the last: statistics against a baseline row); write table.{md,csv,json}
    and the figures to out (a dir; a .png path names the training-curves file, as before); log
    them to each compared sweep under compare/. `rows`: only these rows, in this order (the family
    a question is about: Holm adjusts over the rows tested). Rows evaluated under different
    protocols are refused unless mixed_protocols (`analysis/protocols.py`); a confirmatory sweep
    is tested on its own seeds, its pilot's estimate beside it (`pilot_view`)."""
    comp = only_rows(collect(uri, ids), rows)
    client = mlflow_client(uri)
    protocol = protocols.check(comp, client, mixed_protocols)
    columns = tuple((m, m) for m in metrics) if metrics else TRAINING_COLUMNS
    tested = test_rows(comp, test_metric, baseline, seeds_delta)
    pilot = pilot_view(uri, comp, tested)
    _print(console, comp, columns, tested, protocol, pilot)
    beside = row_lines(comp, client)  # inert knobs per row; flip rates when rows differ in dtype or transport
    for line in beside:
        console.print(line, style="yellow", markup=False, highlight=False, soft_wrap=True)
    curves_name = "training_curves.png"
    out_dir = Path(out) if out else default_out(comp)
    if out and out.endswith(".png"):
        out_dir, curves_name = Path(out).parent, Path(out).name
    out_dir.mkdir(parents=True, exist_ok=True)
    written = _write(out_dir, comp, columns, tested, protocol, pilot, beside)
    written.update(figures.draw_all(client, comp, out_dir, curves_name=curves_name, panels=list(metrics) or None))
    for sweep in comp.sweeps:
        for path in written.values():
            client.log_artifact(sweep.info.run_id, str(path), keys.COMPARE_DIR)
    console.print(f"written to [bold]{escape(str(out_dir))}[/]: " + escape(", ".join(p.name for p in written.values())),
                  highlight=False)
    if comp.sweeps:
        console.print("logged to the sweep run" + ("s " if len(comp.sweeps) > 1 else " ")
                      + ", ".join(comp.short[s.info.run_id] for s in comp.sweeps) + f" under {keys.COMPARE_DIR}/",
                      highlight=False)
    return written


def _print(console: Console, comp: Comparison, columns, tested: Optional[Tested], protocol: ProtocolCheck,
           pilot: Optional[Pilot]) -> None:
    for note in comp.notes:  # what was left out, or counted once, and why
        console.print(f"[yellow]{escape(note)}[/]", highlight=False, soft_wrap=True)
    console.print(f"[bold red]{escape(protocol.text)}[/]" if protocol.mixed else escape(protocol.text),
                  highlight=False, soft_wrap=True)
    for heading, table in tables(comp, columns):
        console.print(f"[bold]{escape(heading)}[/]", highlight=False)
        console.print(table)
    if tested:
        console.print(f"[bold]{escape(tested.heading)}[/]", highlight=False)
        console.print(stats_table(tested.rows, tested.scale, tested.delta))
    if tested and pilot:
        console.print(f"[bold]{escape(pilot.heading)}[/]", highlight=False)
        console.print(confirm_table(tested.rows, pilot.rows, tested.scale))


def _write(out_dir: Path, comp: Comparison, columns, tested: Optional[Tested], protocol: ProtocolCheck,
           pilot: Optional[Pilot], beside: Sequence[str] = ()) -> dict[str, Path]:
    """table.md / table.csv / table.json in out_dir."""
    written = {"table.md": out_dir / "table.md", "table.csv": out_dir / "table.csv",
               "table.json": out_dir / "table.json"}
    md = markdown(comp, columns) + stats_md(tested)
    if tested and pilot:
        md += confirm_markdown(tested.rows, pilot.rows, tested.scale, pilot.heading)
    if beside:
        md += "\n## Beside the rows\n\n" + "".join(f"- {line}\n" for line in beside)
    written["table.md"].write_text(f"{'**' + protocol.text + '**' if protocol.mixed else protocol.text}\n\n{md}")
    rows = records(comp, columns) + stats_records(comp, tested)
    written["table.csv"].write_text(csv_text(rows))
    written["table.json"].write_text(json.dumps(
        {"key": comp.key, "sweeps": [s.info.run_id for s in comp.sweeps], "notes": comp.notes, "rows": rows,
         "protocol": protocol.to_json(), "statistics": stats_summary(tested), "beside_rows": list(beside),
         "confirmatory": pilot.to_json() if pilot else None,
         "runs": [{"run_id": t.id, "group": t.group, "seed": t.seed, "name": t.run.info.run_name,
                   "protocols": {src: sha for src, (sha, _) in t.protocols.items()},
                   "finals": {f"{b}/{d}": {"value": v, "k": k, "source": s} for (b, d), (v, k, s) in t.finals.items()}}
                  for t in comp.trials]}, indent=1) + "\n")
    return written


@dataclass
class Pilot:
    """The pilot sweep a confirmatory sweep was sized from, and its (exploratory) statistics."""

    sweep_id: str
    seeds: list[str]  # the confirmatory sweep's own seeds
    rows: list[RowStats]  # the pilot's rows, tested as compare would, on the pilot's seeds

    @property
    def heading(self) -> str:
        return (f"Confirmatory on seeds {', '.join(self.seeds)} (fresh), beside its pilot {self.sweep_id[:8]}: "
                "the pilot chose the design, so its estimate is exploratory, not evidence")

    def to_json(self) -> dict:
        return {"pilot": self.sweep_id, "seeds": self.seeds, "pilot_rows": [r.to_json() for r in self.rows]}


def pilot_view(uri: Optional[str], comp: Comparison, tested: Optional[Tested]) -> Optional[Pilot]:
    """For a confirmatory sweep (`sweep NAME confirm=PILOT`), compared alone: the pilot's rows
    tested as compare would, on the pilot's seeds. A confirmatory sweep merged with others is
    refused: its test is on its own seeds only."""
    confirm = [s for s in comp.sweeps if s.data.tags.get(keys.SWEEP_ROLE) == keys.ROLE_CONFIRMATORY]
    if not confirm:
        return None
    sweep = confirm[0]
    if len(comp.sweeps) > 1 or any(t.run.data.tags.get(keys.SWEEP_ID) != sweep.info.run_id for t in comp.trials):
        raise UserError(f"compare: sweep {comp.short.get(sweep.info.run_id, sweep.info.run_id)} is confirmatory: "
                        "it is tested on its own seeds only; compare it alone (its pilot's estimate is shown beside it)")
    pilot_id = sweep.data.tags.get(keys.CONFIRMS, "")
    if tested is None or not pilot_id:
        return None
    pilot = collect(uri, [pilot_id])
    shared = [g for g in comp.groups if g in pilot.groups]
    if tested.baseline not in shared:
        comp.notes.append(f"compare: the pilot {pilot_id[:8]} has no row {tested.baseline}: no pilot estimate shown")
        return None
    seeds = sorted({t.seed for t in comp.trials}, key=lambda x: (len(x), x))
    pilot_tested = test_rows(only_rows(pilot, shared), tested.metric, tested.baseline, None)
    return Pilot(pilot_id, seeds, pilot_tested.rows if pilot_tested else [])


def stats_md(tested: Optional[Tested]) -> str:
    if tested is None:
        return ""
    return stats_markdown(tested.rows, tested.heading, tested.scale, tested.delta)


def stats_records(comp: Comparison, tested: Optional[Tested]) -> list[dict]:
    """table.json rows of the "Against" table (values in metric units; the table shows × scale)."""
    if tested is None:
        return []
    return [{"table": STATS_TABLE, "group": r.group, "column": tested.metric, "baseline": tested.baseline,
             "scale": tested.scale, **r.to_json(), "runs": [t.id for t in comp.groups[r.group]]}
            for r in tested.rows]


def stats_summary(tested: Optional[Tested]) -> Optional[dict]:
    """How the statistics rows were computed, so table.json reads without the docs."""
    if tested is None:
        return None
    return {"metric": tested.metric, "baseline": tested.baseline, "scale": tested.scale, "alpha": ALPHA,
            "power": POWER, "seeds_needed_delta": tested.delta, "bootstrap_resamples": N_RESAMPLES,
            "random_state": RANDOM_STATE, "exact_splits": EXACT_SPLITS, "tie_rtol": RTOL,
            "test": "unpaired permutation of the difference of means, two-sided (twice the smaller one-sided p), "
            "every split enumerated up to exact_splits (else bootstrap_resamples random ones), sums within "
            "tie_rtol of the data's size tie; Holm across the non-baseline rows"}
