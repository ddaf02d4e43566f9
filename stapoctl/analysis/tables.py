"""The two tables of `stapoctl compare` (000 Table 2's accuracy layout, last-step training
metrics) as rich tables, records, markdown and CSV."""

from __future__ import annotations

import csv
import io
from typing import Optional, Sequence

from rich.markup import escape
from rich.table import Table

from stapoctl.analysis.cells import accuracy_cells, column_header, training_cells
from stapoctl.analysis.collect import TRAINING_COLUMNS, Comparison, raised
from stapoctl.analysis.statistics import ALPHA, RowStats
from stapoctl.tracking import keys
from stapoctl.tracking.runs import run_inert

STATS_TABLE = "statistics"


def _sources(comp: Comparison) -> str:
    found = sorted({(v[2], v[1]) for t in comp.trials for v in t.finals.values()})
    return ", ".join(f"{s} avg@{k}" for s, k in found) or "none"


def _present(comp: Comparison, metrics: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The metrics some run logged; the mean score only when reward accuracy is missing (±1
    rewards make it 2·accuracy − 1)."""
    out = [(m, h) for m, h in metrics if any(t.last(m) is not None for t in comp.trials)]
    if metrics is TRAINING_COLUMNS and any(m == keys.ACCURACY for m, _ in out):
        out = [(m, h) for m, h in out if m != keys.SCORE]
    return out


def tables(comp: Comparison, metrics: Sequence[tuple[str, str]] = TRAINING_COLUMNS) -> list[tuple[str, Table]]:
    """(heading, table): the Table-2 layout (accuracy %, mean ± std (n seeds)) and the last
    logged step's training metrics (mean ± std, seeds in the n column)."""
    from rich import box

    acc = accuracy_cells(comp)
    cols = list(next(iter(acc.values()), {}).keys())
    t2 = Table(box=box.SIMPLE_HEAD)
    t2.add_column(escape(comp.key), style="bold", no_wrap=True)
    for col in cols:
        t2.add_column(column_header(col), justify="right", no_wrap=True, style="bold" if col.startswith("avg/") else None)
    for g, row in acc.items():
        t2.add_row(escape(g), *(row[c].text(100.0) for c in cols))  # a swept value or run name: text
    if not cols:
        t2.caption = "no val/… or eval/… accuracy in these runs"
    present = _present(comp, metrics)
    tr = training_cells(comp, present)
    t3 = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
    t3.add_column(escape(comp.key), style="bold", no_wrap=True)
    t3.add_column("n", justify="right")
    for m, h in present:
        t3.add_column(h, justify="right")
    for g, row in tr.items():
        t3.add_row(escape(g), str(len(comp.groups[g])),
                   *(row[m].text(fmt=".3g", std_fmt=".2g", n=False) for m, _ in present))
    return [
        (f"Accuracy (%) by {comp.key}: mean ± std over seeds (n seeds); from {_sources(comp)}", t2),
        ("Last logged step: mean ± std over seeds", t3),
    ]


def records(comp: Comparison, metrics: Sequence[tuple[str, str]] = TRAINING_COLUMNS) -> list[dict]:
    """One flat record per (group, column): what table.csv / table.json hold."""
    out = []
    for kind, cells in (("accuracy", accuracy_cells(comp)), ("last_step", training_cells(comp, metrics))):
        for g, row in cells.items():
            for col, cell in row.items():
                if cell.n:
                    out.append({"table": kind, "group": g, "column": col, **cell.to_json(),
                                "runs": [t.id for t in comp.groups[g]]})
    return out


def markdown(comp: Comparison, metrics: Sequence[tuple[str, str]] = TRAINING_COLUMNS) -> str:
    acc = accuracy_cells(comp)
    cols = list(next(iter(acc.values()), {}).keys())
    lines = [f"## Accuracy (%) by {comp.key}", "",
             f"mean ± sample std over seeds (n seeds); final accuracy from {_sources(comp)}.", ""]
    lines += ["| " + " | ".join([comp.key] + [column_header(c) for c in cols]) + " |",
              "|" + "---|" * (len(cols) + 1)]
    lines += ["| " + " | ".join([g] + [row[c].text(100.0) for c in cols]) + " |" for g, row in acc.items()]
    present = _present(comp, metrics)
    tr = training_cells(comp, present)
    lines += ["", "## Last logged step", "", "| " + " | ".join([comp.key] + [m for m, _ in present]) + " |",
              "|" + "---|" * (len(present) + 1)]
    lines += ["| " + " | ".join([g] + [row[m].text(fmt=".4g", std_fmt=".2g") for m, _ in present]) + " |"
              for g, row in tr.items()]
    lines += ["", "## Runs", "", "| group | seed | run | status |", "|---|---|---|---|"]
    lines += [f"| {t.group} | {t.seed} | {comp.short[t.id]} ({t.run.info.run_name}) | {t.run.info.status.lower()}"
              + (f" (alarm: {', '.join(raised(t.run))})" if raised(t.run) else "")
              + (f" (inert: {', '.join(run_inert(t.run))})" if run_inert(t.run) else "") + " |" for t in comp.trials]
    return "\n".join(lines) + "\n"


def csv_text(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["table", "group", "column", "mean", "std", "n"])
    for r in rows:
        if r["table"] == STATS_TABLE:  # table.json only: the CSV keeps its six columns
            continue
        w.writerow([r["table"], r["group"], r["column"], r["mean"], "" if r["std"] is None else r["std"], r["n"]])
    return buf.getvalue()


# -- against a baseline ----------------------------------------------------------------------------
def _num(x, scale: float, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x * scale, fmt)


def _ci(ci, scale: float) -> str:
    return "" if ci is None else f" [{ci[0] * scale:.2f}, {ci[1] * scale:.2f}]"


def _p(p) -> str:
    return "—" if p is None else format(p, ".3g")


def stats_cells(st: RowStats, scale: float, seeds: bool) -> list[str]:
    """One row of the "Against" table as text: n, mean [CI], diff [CI], p's, floor, verdict."""
    mean = _num(st.mean, scale) + (_ci(st.ci95, scale) if st.ci95 else (" (n<3: no CI)" if st.n_seeds else ""))
    diff = "" if st.diff is None else format(st.diff * scale, "+.2f") + _ci(st.diff_ci95, scale)
    out = [st.group, str(st.n_seeds), mean, diff or "—", _p(st.p_value), _p(st.p_holm), _p(st.p_paired),
           _p(st.p_floor), st.verdict_text, st.ci_method or "—"]
    return out + ([str(st.seeds_needed) if st.seeds_needed else "—"] if seeds else [])


STATS_HEADERS = ("n", "mean [95% CI]", "diff [95% CI]", "p", "p Holm", "p paired", "p floor", "verdict",
                 "CI method", "seeds needed")


def stats_heading(baseline: str, metric: str, scale: float) -> str:
    unit = " (%)" if scale == 100 else ""
    return (f"Against {baseline}: {metric}{unit} over seeds, mean [bootstrap 95% CI]; diff = row − {baseline}; "
            f"p = unpaired permutation test, two-sided, Holm across rows; better/worse when p Holm < {ALPHA:g}")


def stats_caption(scale: float, delta: Optional[float]) -> str:
    """What the less obvious columns mean, under the table."""
    need = (f"; seeds needed: per row, to detect a {delta:g}{' point' if scale == 100 else ''} difference "
            f"at 80% power (t-test, paired when the seeds match)" if delta is not None else "")
    return ("p floor: the smallest Holm-adjusted p this row can reach given every tested row's seed count "
            f"(too few seeds when ≥ {ALPHA:g}); p paired: t-test over matched seeds, informational, — when every "
            f"seed moved by the same amount{need}")


def stats_table(stats: Sequence[RowStats], scale: float, delta: Optional[float]) -> Table:
    from rich import box

    seeds = delta is not None
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, caption=stats_caption(scale, delta),
              caption_justify="left")
    t.add_column("row", style="bold", no_wrap=True)
    for h in STATS_HEADERS[:len(STATS_HEADERS) - (0 if seeds else 1)]:
        t.add_column(h, justify="left" if h in ("verdict", "CI method") else "right")
    colors = {"better": "green", "worse": "red"}
    for st in stats:
        cells = [escape(c) for c in stats_cells(st, scale, seeds)]  # the row's name is a swept value: text
        cells[8] = f"[{colors[st.verdict]}]{cells[8]}[/]" if st.verdict in colors else cells[8]
        t.add_row(*cells)
    return t


def stats_markdown(stats: Sequence[RowStats], heading: str, scale: float, delta: Optional[float]) -> str:
    seeds = delta is not None
    heads = ["row", *STATS_HEADERS[:len(STATS_HEADERS) - (0 if seeds else 1)]]
    title, _, text = heading.partition(": ")
    lines = ["", f"## {title}", "", f"{text}; {stats_caption(scale, delta)}.", "",
             "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(stats_cells(st, scale, seeds)) + " |" for st in stats]
    return "\n".join(lines) + "\n"


# -- a confirmatory sweep beside its pilot -----------------------------------------------------------
CONFIRM_HEADERS = ("n", "diff [95% CI]", "p Holm", "verdict", "pilot n", "pilot diff [95% CI]",
                   "pilot p Holm (exploratory)")


def confirm_cells(st: RowStats, pilot: Optional[RowStats], scale: float) -> list[str]:
    """One row: the confirmatory test on its own seeds, then the pilot's estimate."""
    def diff(r: Optional[RowStats]) -> str:
        return "—" if r is None or r.diff is None else format(r.diff * scale, "+.2f") + _ci(r.diff_ci95, scale)

    return [st.group, str(st.n_seeds), diff(st), _p(st.p_holm), st.verdict_text,
            "—" if pilot is None else str(pilot.n_seeds), diff(pilot), _p(pilot.p_holm if pilot else None)]


def _confirm_rows(stats: Sequence[RowStats], pilot: Sequence[RowStats], scale: float) -> list[list[str]]:
    by_group = {r.group: r for r in pilot}
    return [confirm_cells(st, by_group.get(st.group), scale) for st in stats if st.verdict != "baseline"]


def confirm_table(stats: Sequence[RowStats], pilot: Sequence[RowStats], scale: float) -> Table:
    from rich import box

    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
    t.add_column("row", style="bold", no_wrap=True)
    for h in CONFIRM_HEADERS:
        t.add_column(h, justify="left" if h == "verdict" else "right")
    for cells in _confirm_rows(stats, pilot, scale):
        t.add_row(*(escape(c) for c in cells))
    return t


def confirm_markdown(stats: Sequence[RowStats], pilot: Sequence[RowStats], scale: float, heading: str) -> str:
    heads = ["row", *CONFIRM_HEADERS]
    lines = ["", f"## {heading}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(cells) + " |" for cells in _confirm_rows(stats, pilot, scale)]
    return "\n".join(lines) + "\n"
