"""Table cells over seeds: mean ± sample std with the seed count, per row and column."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from stapoctl.analysis.collect import Comparison
from stapoctl.tracking import keys


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
    from stapoctl.data.benches import PAPER_BENCHES

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


def column_header(col: str) -> str:
    from stapoctl.data.benches import TITLES

    bench, dec = col.split("/")
    name = "Avg" if bench == "avg" else TITLES.get(bench, bench)
    return f"{name} {keys.DECODING_LABEL.get(dec, dec)}"
