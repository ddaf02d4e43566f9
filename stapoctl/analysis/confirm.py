"""Pilot → confirm: a pilot sweep's per-row spread sizes a confirmatory sweep, which is then
tested on its own fresh seeds while the pilot's estimate is shown beside it as exploratory.

A pilot that picks the claims to test cannot also be their evidence (its p-values were read
before the question was fixed). So each row's seeds are sized for POWER at the pilot's observed
difference (or a given delta) with the pilot's pooled sd, two-sided at ALPHA / m (Bonferroni
over the m rows tested: conservative for the Holm that compare applies), by the unpaired t-test
(fresh seeds share no pairing with the baseline's), and never below the seed count at which the
exact permutation test can reach ALPHA / m at all.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from stapoctl.analysis.statistics import ALPHA, POWER, Sample, p_floor, pooled_sd, power

MAX_SEEDS = 10  # max_seeds= when not given
SEARCH_CAP = 100_000  # seeds; a row needing more is reported as needing more than this


@dataclass
class RowSize:
    """One tested row's pilot numbers and the seeds it needs (metric units)."""

    group: str
    n_pilot: int
    diff: Optional[float]  # pilot mean(row) − mean(baseline)
    sd: Optional[float]  # pooled sd of the row and the baseline in the pilot
    delta: Optional[float]  # the difference powered for: delta= or |diff|
    needed: Optional[int] = None  # seeds per row (baseline too); None: cannot be sized
    why: str = ""  # why not, in words


@dataclass
class Sizing:
    metric: str
    baseline: str
    scale: float  # table units = metric × scale (100 for accuracy)
    m: int  # rows tested against the baseline
    alpha: float  # per test: ALPHA / m
    max_seeds: int
    delta: Optional[float]  # delta= in table units, None: each row's pilot difference
    n_baseline_pilot: int
    rows: list[RowSize] = field(default_factory=list)

    @property
    def floor_seeds(self) -> int:
        """Fewest seeds per row at which the permutation test's smallest p is below alpha."""
        return next(n for n in range(2, 200) if p_floor(n, n) < self.alpha)

    @property
    def seeds(self) -> int:
        """Seeds every row (and the baseline) runs: the most any row needs."""
        return max([r.needed for r in self.rows if r.needed] + [self.floor_seeds])

    def refusal(self) -> Optional[str]:
        """One line when a row cannot be sized or needs more than max_seeds; None when it fits."""
        bad = [r for r in self.rows if r.needed is None or r.needed > self.max_seeds]
        if not bad:
            return None
        scale = self.scale
        parts = [f"{r.group} ({r.why})" if r.needed is None else
                 f"{r.group} needs {r.needed} seeds (pilot diff {r.diff * scale:+.2f}, sd {r.sd * scale:.2f})"
                 for r in bad]
        return (f"confirm: {POWER:.0%} power at α = {ALPHA:g}/{self.m} needs more than max_seeds={self.max_seeds}: "
                + "; ".join(parts) + ": raise max_seeds, drop the row from values=[…], or power for a larger "
                "difference with delta=D (points)")

    def to_json(self) -> dict:
        return {**asdict(self), "seeds_per_row": self.seeds, "floor_seeds": self.floor_seeds, "power": POWER,
                "family_alpha": ALPHA, "test": "two-sided unpaired t-test power (noncentral t), Bonferroni α/m"}


def seeds_for(delta: float, sd: float, alpha: float) -> Optional[int]:
    """Smallest n per group with t-test power ≥ POWER at two-sided alpha, None past SEARCH_CAP.
    The normal approximation 2(z₁₋α/₂ + z_power)²/d² is a lower bound: the search starts there."""
    from scipy import stats

    if sd == 0:
        return 2
    effect = abs(delta) / sd
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(POWER)
    n = max(2, math.floor(2 * (z / effect) ** 2))
    while n <= SEARCH_CAP:
        if power(n, effect, alpha=alpha) >= POWER:
            return n
        n += 1
    return None


def size(samples: Sequence[Sample], baseline: str, metric: str, scale: float, max_seeds: int,
         delta: Optional[float] = None) -> Sizing:
    """The seeds each non-baseline row needs; delta in table units (points for accuracy)."""
    base = next(s for s in samples if s.group == baseline)
    rows = [s for s in samples if s.group != baseline]
    m = max(1, len(rows))
    out = Sizing(metric, baseline, scale, m, ALPHA / m, max_seeds, delta, len(base.values))
    for s in rows:
        diff = (sum(s.values) / len(s.values) - sum(base.values) / len(base.values)) if s.values and base.values \
            else None
        sd = pooled_sd(s.values, base.values)
        want = abs(delta / scale) if delta is not None else (abs(diff) if diff is not None else None)
        r = RowSize(s.group, len(s.values), diff, sd, want)
        if sd is None:
            r.why = f"the pilot has {len(s.values)} and {len(base.values)} seeds of it and {baseline}: no spread to size from"
        elif not want:
            r.why = "its pilot difference is 0: no seed count has power for it; give delta=D"
        else:
            n = seeds_for(want, sd, out.alpha)
            r.needed = None if n is None else max(n, out.floor_seeds)
            r.why = "" if n is not None else f"more than {SEARCH_CAP} seeds"
        out.rows.append(r)
    return out


def fresh_seeds(used: set[int], n: int) -> tuple[int, ...]:
    """The n smallest non-negative seeds not in used: never a pilot's (its seeds chose the design)."""
    out: list[int] = []
    seed = 0
    while len(out) < n:
        if seed not in used:
            out.append(seed)
        seed += 1
    return tuple(out)
