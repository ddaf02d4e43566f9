"""Table cells over seeds: mean ± sample std with the seed count, per row and column."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from stapoctl.analysis.collect import Comparison, Trial
from stapoctl.tracking import keys


@dataclass
class Cell:
    """The finite values of one cell: a NaN (a run that diverged) is no number to average."""

    values: list[float]

    def __post_init__(self):
        self.values = [v for v in self.values if math.isfinite(v)]

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
    from stapoctl.data.benches import PAPER_BENCHES

    cols = comp.columns()
    out: dict[str, dict[str, Cell]] = {}
    for g, trials in comp.groups.items():
        row = {f"{b}/{d}": Cell([t.finals[(b, d)][0] for t in trials if (b, d) in t.finals]) for b, d in cols}
        for dec in dict.fromkeys(d for _, d in cols):
            paper = [b for b, d in cols if d == dec and b in PAPER_BENCHES]
            if len(paper) > 1:
                row[f"avg/{dec}"] = Cell([v for v in (_avg(t, paper, dec) for t in trials) if v is not None])
        out[g] = row
    return out


def _avg(trial: Trial, paper: list[str], dec: str) -> Optional[float]:
    """A run's mean final accuracy over the paper benchmarks, None unless it has all of them."""
    if not all((b, dec) in trial.finals for b in paper):
        return None
    return statistics.fmean(trial.finals[(b, dec)][0] for b in paper)


def default_test_metric(comp: Comparison) -> Optional[str]:
    """What the statistics test: `avg/<first decoding>`, else the first accuracy column."""
    cols = list(next(iter(accuracy_cells(comp).values()), {}).keys())
    first = [c for c in cols if c.split("/")[1] == cols[0].split("/")[1]] if cols else []
    return next((c for c in first if c.startswith("avg/")), first[0] if first else None)


def trial_value(comp: Comparison, trial: Trial, name: str) -> Optional[float]:
    """One run's value of an accuracy column (`bench/dec`, `avg/dec`) or a last-step metric."""
    from stapoctl.data.benches import PAPER_BENCHES

    bench, _, dec = name.partition("/")
    if bench == "avg" and dec:
        paper = [b for b, d in comp.columns() if d == dec and b in PAPER_BENCHES]
        return _avg(trial, paper, dec) if len(paper) > 1 else None
    if (bench, dec) in trial.finals:
        return trial.finals[(bench, dec)][0]
    return trial.last(name)


def is_accuracy(comp: Comparison, name: str) -> bool:
    """Accuracy columns are shown in % (scale 100), last-step metrics as logged."""
    bench, _, dec = name.partition("/")
    return (bench == "avg" and dec in {d for _, d in comp.columns()}) or (bench, dec) in comp.columns()


def seed_values(comp: Comparison, name: str) -> tuple[dict[str, list[tuple[str, float]]],
                                                      dict[str, list[tuple[Trial, str]]]]:
    """(group → [(seed, value)] of the runs with a finite value, in row order; group → [(run, "NaN"
    or "missing")] of the runs without one, which the statistics leave out and name)."""
    out: dict[str, list[tuple[str, float]]] = {}
    missing: dict[str, list[tuple[Trial, str]]] = {}
    for g, trials in comp.groups.items():
        out[g] = []
        for t in trials:
            v = trial_value(comp, t, name)
            if v is not None and math.isfinite(v):
                out[g].append((t.seed, v))
            else:
                missing.setdefault(g, []).append((t, "missing" if v is None else "NaN" if math.isnan(v) else str(v)))
    return out, missing


def training_cells(comp: Comparison, metrics: Sequence[tuple[str, str]]) -> dict[str, dict[str, Cell]]:
    return {g: {m: Cell([t.last(m) for t in ts if t.last(m) is not None]) for m, _ in metrics}
            for g, ts in comp.groups.items()}


def column_header(col: str) -> str:
    from stapoctl.data.benches import TITLES

    bench, dec = col.split("/")
    name = "Avg" if bench == "avg" else TITLES.get(bench, bench)
    return f"{name} {keys.DECODING_LABEL.get(dec, dec)}"
