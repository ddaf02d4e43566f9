"""`stapoctl compare SWEEP_ID | RUN_ID...`: runs grouped by method or swept value, seeds
aggregated, in the layout of 000 Table 2, plus the figures of 000 Figs. 3–5.

Rows are the sweep's values (tag `stapoctl.sweep_value`) or, for plain runs, the config values
that differ between them (seeds and bookkeeping keys aside), so three seeds of GRPO and three
of STAPO give two rows. Cells are mean ± sample std over seeds with the seed count; the
final accuracy of a run is read as `keys` documents (own eval/… metric, nested eval run, last
validation). Everything shown is also written as table.md / table.csv / table.json.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console
from rich.table import Table

from stapoctl.errors import UserError
from stapoctl.tracking import keys
from stapoctl.tracking.run_ids import resolve_run_id, short_ids

# last-step training metrics of the second table: (metric, column header)
TRAINING_COLUMNS = (
    (keys.SCORE, "score"),
    (keys.ACCURACY, "reward acc"),
    (keys.ENTROPY, "entropy"),
    (keys.SPURIOUS_RATIO, "spurious"),
    (keys.RESPONSE_LENGTH, "resp len"),
    (keys.CLIPFRAC, "clipfrac"),
)
# params that differ between seeds of one method (or are bookkeeping), never a grouping key
_NOT_A_GROUP = ("tracking.", "trainer.output_dir", "resume", "eval.output_dir", "model_path")


@dataclass
class Trial:
    """One run and what compare reads from it."""

    run: Any
    group: str
    seed: str
    finals: dict[tuple[str, str], tuple[float, int, str]] = field(default_factory=dict)  # (bench, dec) → (acc, k, source)

    @property
    def id(self) -> str:
        return self.run.info.run_id

    def last(self, metric: str) -> Optional[float]:
        return self.run.data.metrics.get(metric)


@dataclass
class Comparison:
    key: str  # what the rows are: the swept key, or the differing params
    groups: dict[str, list[Trial]]  # row label → its seeds, in row order
    sweeps: list[Any]  # the sweep parent runs compared (artifacts go there)
    numeric: bool  # row labels are numbers (accuracy vs value on an x axis)
    short: dict[str, str]  # run id → short id

    @property
    def trials(self) -> list[Trial]:
        return [t for ts in self.groups.values() for t in ts]

    def columns(self) -> list[tuple[str, str]]:
        """(bench, decoding) pairs present, paper order, T=1.0 before T=0.7."""
        from stapoctl.eval.benches import EVAL_BENCHES

        present = {bd for t in self.trials for bd in t.finals}
        order = {b: i for i, b in enumerate(EVAL_BENCHES)}
        dec_order = {d: i for i, d in enumerate(keys.DECODING_LABEL)}
        return sorted(present, key=lambda bd: (order.get(bd[0], 99), bd[0], dec_order.get(bd[1], 9), bd[1]))


# -- collecting ---------------------------------------------------------------------------------
def _client(uri: Optional[str]):
    from mlflow.tracking import MlflowClient

    from stapoctl.tracking.mlflow_run import tracking_uri

    return MlflowClient(tracking_uri=tracking_uri(uri))


def _children(client, parent) -> list:
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.`{keys.PARENT}` = '{parent.info.run_id}'",
                              order_by=["attributes.start_time ASC"], max_results=5000)
    return [r for r in runs if r.data.tags.get(keys.KIND, keys.KIND_TRAIN) == keys.KIND_TRAIN]


def _is_sweep(run, children: list) -> bool:
    return run.data.tags.get(keys.KIND) == keys.KIND_SWEEP or bool(children)


def _number(text: str) -> Optional[float]:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _seed(run) -> str:
    t, p = run.data.tags, run.data.params
    return t.get(keys.SEED) or p.get("trainer.seed") or p.get("seed") or ""


def _differing_params(runs: list) -> list[str]:
    names = sorted({k for r in runs for k in r.data.params})
    out = []
    for name in names:
        last = name.rsplit(".", 1)[-1]
        if "seed" in last or name.startswith(_NOT_A_GROUP) or name in _NOT_A_GROUP:
            continue
        if len({r.data.params.get(name) for r in runs}) > 1:
            out.append(name)
    return out


def _finals(run, evals: list) -> dict[tuple[str, str], tuple[float, int, str]]:
    """(bench, decoding) → (accuracy, k, source): own eval/ metric, newest nested eval, last val/."""
    out: dict[tuple[str, str], tuple[float, int, str]] = {}
    sources = [("eval", run.data.metrics, "eval")]
    if evals:
        sources.append(("eval", evals[0].data.metrics, "eval run"))
    sources.append(("val", run.data.metrics, "val"))
    for wanted, metrics, label in sources:
        for name, value in metrics.items():
            parsed = keys.parse_accuracy_metric(name)
            if not parsed or parsed[0] != wanted:
                continue
            _, bench, dec, k = parsed
            have = out.get((bench, dec))
            if have is None or (have[2] == label and k > have[1]):
                out[(bench, dec)] = (float(value), k, label)
    return out


def collect(uri: Optional[str], ids: Sequence[str]) -> Comparison:
    """Resolve ids (full or short), expand sweeps to their trials, group, read final accuracies."""
    if not ids:
        raise UserError("compare: give a sweep id or one or more run ids (see `stapoctl runs`)")
    client = _client(uri)
    runs, sweeps = [], []
    for spec in ids:
        run = client.get_run(resolve_run_id(spec, uri, what="compare"))
        kids = _children(client, run)
        if _is_sweep(run, kids):
            if not kids:
                raise UserError(f"compare: sweep {spec} has no trial runs yet (nested runs with "
                                f"tag {keys.PARENT}={run.info.run_id})")
            sweeps.append(run)
            runs += kids
        else:
            runs.append(run)
    seen = set()
    runs = [r for r in runs if not (r.info.run_id in seen or seen.add(r.info.run_id))]
    evals = _nested_evals(client, runs)

    sweep_keys = {s.data.params.get(keys.SWEEP_KEY, "") for s in sweeps}
    by_value = sweeps and all(keys.SWEEP_VALUE in r.data.tags for r in runs) and len(sweep_keys) == 1
    if by_value:
        key = sweep_keys.pop() or "value"
        label_of = {r.info.run_id: r.data.tags[keys.SWEEP_VALUE] for r in runs}
    else:
        diff = _differing_params(runs)
        key = ", ".join(diff) if diff else "runs"
        if len(diff) == 1:
            label_of = {r.info.run_id: r.data.params.get(diff[0], "") for r in runs}
        elif diff:
            label_of = {r.info.run_id: ", ".join(f"{d}={r.data.params.get(d, '')}" for d in diff) for r in runs}
        else:  # identical configs: one row (seeds of one method), or each run if no params at all
            any_params = any(r.data.params for r in runs)
            label_of = {r.info.run_id: ("all" if any_params else (r.info.run_name or r.info.run_id[:8])) for r in runs}
    groups: dict[str, list[Trial]] = {}
    for r in runs:
        label = label_of[r.info.run_id]
        groups.setdefault(label, []).append(Trial(r, label, _seed(r), _finals(r, evals.get(r.info.run_id, []))))
    numbers = {g: _number(g) for g in groups}
    numeric = len(groups) > 1 and all(v is not None for v in numbers.values())
    if numeric:
        groups = dict(sorted(groups.items(), key=lambda kv: numbers[kv[0]]))
    return Comparison(key, groups, sweeps, numeric, short_ids(_all_ids(client, runs)))


def _nested_evals(client, runs: list) -> dict[str, list]:
    """train run id → its eval runs, newest first."""
    exps = sorted({r.info.experiment_id for r in runs})
    found = client.search_runs(exps, filter_string=f"tags.`{keys.KIND}` = '{keys.KIND_EVAL}'",
                               order_by=["attributes.start_time DESC"], max_results=5000)
    out: dict[str, list] = {}
    for e in found:
        owner = e.data.tags.get(keys.TRAIN_RUN_ID) or e.data.tags.get(keys.PARENT)
        if owner:
            out.setdefault(owner, []).append(e)
    return out


def _all_ids(client, runs: list) -> list[str]:
    """Every run id of the experiments involved, so short ids are unique in the store."""
    from mlflow.entities import ViewType

    exps = sorted({r.info.experiment_id for r in runs})
    return [r.info.run_id for r in client.search_runs(exps, run_view_type=ViewType.ALL, max_results=50000)]


# -- aggregating ---------------------------------------------------------------------------------
@dataclass
class Cell:
    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> Optional[float]:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> Optional[float]:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    def text(self, scale: float = 1.0, fmt: str = ".2f", std_fmt: Optional[str] = None, n: bool = True) -> str:
        """`mean ± std (n)`; a single seed has no std."""
        if not self.values:
            return "—"
        mean = format(self.mean * scale, fmt)
        std = f" ± {format(self.std * scale, std_fmt or fmt)}" if self.std is not None else ""
        return f"{mean}{std}" + (f" ({self.n})" if n else "")

    def to_json(self) -> dict:
        return {"mean": self.mean, "std": self.std, "n": self.n, "values": self.values}


def accuracy_cells(comp: Comparison) -> dict[str, dict[str, Cell]]:
    """group → column → Cell; columns `bench/decoding` plus `avg/decoding` over paper benchmarks."""
    from stapoctl.eval.benches import PAPER_BENCHES

    cols = comp.columns()
    out: dict[str, dict[str, Cell]] = {}
    for g, trials in comp.groups.items():
        row = {f"{b}/{d}": Cell([t.finals[(b, d)][0] for t in trials if (b, d) in t.finals]) for b, d in cols}
        for dec in dict.fromkeys(d for _, d in cols):
            paper = [b for b, d in cols if d == dec and b in PAPER_BENCHES]
            if len(paper) > 1:
                avgs = [statistics.fmean(t.finals[(b, dec)][0] for b in paper) for t in trials
                        if all((b, dec) in t.finals for b in paper)]
                row[f"avg/{dec}"] = Cell(avgs)
        out[g] = row
    return out


def training_cells(comp: Comparison, metrics: Sequence[tuple[str, str]]) -> dict[str, dict[str, Cell]]:
    return {g: {m: Cell([t.last(m) for t in ts if t.last(m) is not None]) for m, _ in metrics}
            for g, ts in comp.groups.items()}


def _header(col: str) -> str:
    from stapoctl.eval.benches import TITLES

    bench, dec = col.split("/")
    name = "Avg" if bench == "avg" else TITLES.get(bench, bench)
    return f"{name} {keys.DECODING_LABEL.get(dec, dec)}"


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
    t2.add_column(comp.key, style="bold", no_wrap=True)
    for col in cols:
        t2.add_column(_header(col), justify="right", no_wrap=True, style="bold" if col.startswith("avg/") else None)
    for g, row in acc.items():
        t2.add_row(g, *(row[c].text(100.0) for c in cols))
    if not cols:
        t2.caption = "no val/… or eval/… accuracy in these runs"
    present = _present(comp, metrics)
    tr = training_cells(comp, present)
    t3 = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
    t3.add_column(comp.key, style="bold", no_wrap=True)
    t3.add_column("n", justify="right")
    for m, h in present:
        t3.add_column(h, justify="right")
    for g, row in tr.items():
        t3.add_row(g, str(len(comp.groups[g])), *(row[m].text(fmt=".3g", std_fmt=".2g", n=False) for m, _ in present))
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
    lines += ["| " + " | ".join([comp.key] + [_header(c) for c in cols]) + " |",
              "|" + "---|" * (len(cols) + 1)]
    lines += ["| " + " | ".join([g] + [row[c].text(100.0) for c in cols]) + " |" for g, row in acc.items()]
    present = _present(comp, metrics)
    tr = training_cells(comp, present)
    lines += ["", "## Last logged step", "", "| " + " | ".join([comp.key] + [m for m, _ in present]) + " |",
              "|" + "---|" * (len(present) + 1)]
    lines += ["| " + " | ".join([g] + [row[m].text(fmt=".4g", std_fmt=".2g") for m, _ in present]) + " |"
              for g, row in tr.items()]
    lines += ["", "## Runs", "", "| group | seed | run | status |", "|---|---|---|---|"]
    lines += [f"| {t.group} | {t.seed} | {comp.short[t.id]} ({t.run.info.run_name}) | {t.run.info.status.lower()} |"
              for t in comp.trials]
    return "\n".join(lines) + "\n"


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["table", "group", "column", "mean", "std", "n"])
    for r in rows:
        w.writerow([r["table"], r["group"], r["column"], r["mean"], "" if r["std"] is None else r["std"], r["n"]])
    return buf.getvalue()


# -- the command ---------------------------------------------------------------------------------
def default_out(comp: Comparison) -> Path:
    ids = [s.info.run_id for s in comp.sweeps] or [t.id for t in comp.trials]
    tail = "_".join(comp.short[i] for i in ids[:3]) + ("_etc" if len(ids) > 3 else "")
    return Path(f"compare-{tail}")


def compare(uri: Optional[str], ids: Sequence[str], console: Console, metrics: Sequence[str] = (),
            out: Optional[str] = None) -> dict[str, Path]:
    """Print both tables; write table.{md,csv,json} and the figures to out (a dir; a .png path
    names the training-curves file, as before); log them to each compared sweep under compare/."""
    from stapoctl.tracking import figures

    comp = collect(uri, ids)
    columns = tuple((m, m) for m in metrics) if metrics else TRAINING_COLUMNS
    for heading, table in tables(comp, columns):
        console.print(f"[bold]{heading}[/]", highlight=False)
        console.print(table)
    curves_name = "training_curves.png"
    out_dir = Path(out) if out else default_out(comp)
    if out and out.endswith(".png"):
        out_dir, curves_name = Path(out).parent, Path(out).name
    out_dir.mkdir(parents=True, exist_ok=True)
    client = _client(uri)
    written = {"table.md": out_dir / "table.md", "table.csv": out_dir / "table.csv",
               "table.json": out_dir / "table.json"}
    written["table.md"].write_text(markdown(comp, columns))
    rows = records(comp, columns)
    written["table.csv"].write_text(_csv(rows))
    written["table.json"].write_text(json.dumps(
        {"key": comp.key, "sweeps": [s.info.run_id for s in comp.sweeps], "rows": rows,
         "runs": [{"run_id": t.id, "group": t.group, "seed": t.seed, "name": t.run.info.run_name,
                   "finals": {f"{b}/{d}": {"value": v, "k": k, "source": s} for (b, d), (v, k, s) in t.finals.items()}}
                  for t in comp.trials]}, indent=1) + "\n")
    written.update(figures.draw_all(client, comp, out_dir, curves_name=curves_name, panels=list(metrics) or None))
    for sweep in comp.sweeps:
        for path in written.values():
            client.log_artifact(sweep.info.run_id, str(path), keys.COMPARE_DIR)
    console.print(f"written to [bold]{out_dir}[/]: " + ", ".join(p.name for p in written.values()), highlight=False)
    if comp.sweeps:
        console.print("logged to the sweep run" + ("s " if len(comp.sweeps) > 1 else " ")
                      + ", ".join(comp.short[s.info.run_id] for s in comp.sweeps) + f" under {keys.COMPARE_DIR}/",
                      highlight=False)
    return written
