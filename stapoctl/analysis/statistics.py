"""Seed-level statistics for `stapoctl compare` (numpy/scipy only, no MLflow).

A few seeds per method cannot separate a real gain from seed noise by eye; this module says,
per row, how sure the comparison is: the mean with a bootstrap 95% CI over seeds, the
difference to a baseline row with its CI, an exact (when small) unpaired permutation p-value,
Holm-adjusted across rows, a verdict, the smallest p these seed counts can reach, and how many
seeds a given difference would need. Higher is better for the verdict.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

ALPHA = 0.05
POWER = 0.80
MIN_CI_SEEDS = 3  # below this a bootstrap CI is meaningless (2 values give 3 distinct resamples)
N_RESAMPLES = 9999  # permutation_test is exact when the distinct splits are at most this many
RANDOM_STATE = 0  # fixed: the same runs always print the same CIs and p-values


@dataclass
class Sample:
    """One row's per-seed values of the tested metric."""

    group: str
    values: list[float]
    seeds: list[str] = field(default_factory=list)


@dataclass
class RowStats:
    group: str
    n_seeds: int
    mean: Optional[float]
    ci95: Optional[list[float]]
    ci_method: Optional[str]
    diff: Optional[float] = None
    diff_ci95: Optional[list[float]] = None
    p_value: Optional[float] = None
    p_holm: Optional[float] = None
    p_paired: Optional[float] = None
    p_floor: Optional[float] = None
    verdict: str = "baseline"
    seeds_needed: Optional[int] = None

    def to_json(self) -> dict:
        return asdict(self)


def _rng() -> np.random.Generator:
    return np.random.default_rng(RANDOM_STATE)


def _bootstrap(data: tuple, statistic) -> tuple[Optional[list[float]], Optional[str]]:
    """95% CI by BCa, or percentile where BCa degenerates (all resamples equal, NaN bounds)."""
    from scipy import stats

    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                res = stats.bootstrap(data, statistic, n_resamples=N_RESAMPLES, method=method,
                                      confidence_level=1 - ALPHA, vectorized=True, random_state=_rng())
            except (ValueError, FloatingPointError):
                continue
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(lo) and math.isfinite(hi):
            return [lo, hi], method
    if all(len(set(d)) == 1 for d in data):  # constant data: the CI is the point itself
        point = float(statistic(*(np.asarray(d, float) for d in data), axis=-1))
        return [point, point], "percentile"
    return None, None


def _mean(x, axis=-1):
    return np.mean(x, axis=axis)


def _mean_diff(x, y, axis=-1):
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


def mean_ci(values: Sequence[float]) -> tuple[Optional[list[float]], Optional[str]]:
    """Bootstrap 95% CI of the mean over seeds; (None, None) below MIN_CI_SEEDS."""
    if len(values) < MIN_CI_SEEDS:
        return None, None
    return _bootstrap((list(values),), _mean)


def diff_ci(row: Sequence[float], base: Sequence[float]) -> tuple[Optional[list[float]], Optional[str]]:
    """Bootstrap 95% CI of mean(row) − mean(base), the two resampled independently."""
    if min(len(row), len(base)) < MIN_CI_SEEDS:
        return None, None
    return _bootstrap((list(row), list(base)), _mean_diff)


def permutation_p(row: Sequence[float], base: Sequence[float]) -> Optional[float]:
    """Two-sided unpaired permutation p of the difference of means (exact for small n)."""
    from scipy import stats

    if min(len(row), len(base)) < 2:  # scipy needs two observations per sample; the floor is ≥ 1/3 anyway
        return None
    res = stats.permutation_test((np.asarray(row, float), np.asarray(base, float)), _mean_diff,
                                 permutation_type="independent", vectorized=True,
                                 n_resamples=N_RESAMPLES, alternative="two-sided", random_state=_rng())
    return float(res.pvalue)


def p_floor(n_row: int, n_base: int) -> Optional[float]:
    """Smallest two-sided p an exact permutation test can give: 2 / C(n_row+n_base, n_row)."""
    if n_row < 1 or n_base < 1:
        return None
    return min(1.0, 2.0 / math.comb(n_row + n_base, n_row))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values (statsmodels' `holm`), in the input order."""
    m = len(pvalues)
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda j: pvalues[j])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def paired(row: Sample, base: Sample) -> Optional[tuple[list[float], list[float]]]:
    """Values aligned by seed when both rows ran exactly the same (named, distinct) seeds."""
    if (len(row.seeds) != len(row.values) or len(base.seeds) != len(base.values) or not all(row.seeds)
            or len(set(row.seeds)) != len(row.seeds) or set(row.seeds) != set(base.seeds) or len(row.seeds) < 2):
        return None
    b = dict(zip(base.seeds, base.values))
    return list(row.values), [b[s] for s in row.seeds]


def paired_p(pair: Optional[tuple[list[float], list[float]]]) -> Optional[float]:
    """Paired t-test p (informational); None when the differences have no spread."""
    from scipy import stats

    if pair is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = float(stats.ttest_rel(pair[0], pair[1]).pvalue)
    return p if math.isfinite(p) else None


def power(n: int, effect: float, paired_test: bool = False) -> float:
    """Power of the two-sided t-test (two samples of n, or n pairs) at standardized effect."""
    from scipy import stats

    df = n - 1 if paired_test else 2 * n - 2
    ncp = effect * math.sqrt(n if paired_test else n / 2)
    crit = stats.t.ppf(1 - ALPHA / 2, df)
    return float(stats.nct.sf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp))


def seeds_needed(delta: float, sd: Optional[float], paired_test: bool = False, cap: int = 100_000) -> Optional[int]:
    """Smallest n per row for POWER at two-sided ALPHA to detect a difference delta given sd."""
    if sd is None or not math.isfinite(sd) or sd <= 0 or delta == 0:
        return None
    effect = abs(delta) / sd
    n = 2
    while n <= cap:
        if power(n, effect, paired_test) >= POWER:
            return n
        n += 1
    return None


def pooled_sd(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = np.var(a, ddof=1), np.var(b, ddof=1)
    return float(math.sqrt(((len(a) - 1) * va + (len(b) - 1) * vb) / (len(a) + len(b) - 2)))


def _verdict(diff: Optional[float], p_holm: Optional[float], floor: Optional[float]) -> str:
    if floor is None or floor >= ALPHA or p_holm is None:
        return "too few seeds"
    if p_holm < ALPHA:
        return "better" if diff > 0 else "worse"
    return "within noise"


def _against(row: Sample, base: Sample, delta: Optional[float]) -> RowStats:
    """Everything about one row but the Holm adjustment, which needs all rows."""
    mean = float(np.mean(row.values)) if row.values else None
    ci, method = mean_ci(row.values)
    st = RowStats(row.group, len(row.values), mean, ci, method, p_floor=p_floor(len(row.values), len(base.values)))
    if not row.values or not base.values:
        return st
    st.diff = mean - float(np.mean(base.values))
    st.diff_ci95, diff_method = diff_ci(row.values, base.values)
    if diff_method and diff_method != method:
        st.ci_method = f"{method}, diff {diff_method}" if method else f"diff {diff_method}"
    st.p_value = permutation_p(row.values, base.values)
    pair = paired(row, base)
    st.p_paired = paired_p(pair)
    if delta is not None:
        sd = (float(np.std(np.subtract(*pair), ddof=1)) if pair else pooled_sd(row.values, base.values))
        st.seeds_needed = seeds_needed(delta, sd, paired_test=pair is not None)
    return st


def against(samples: Sequence[Sample], baseline: str, delta: Optional[float] = None) -> list[RowStats]:
    """Per row (in order): mean ± CI, and against the baseline row its difference, p-values
    (Holm across the non-baseline rows) and verdict; delta (metric units) asks for seeds_needed."""
    base = next(s for s in samples if s.group == baseline)
    out = []
    for s in samples:
        if s.group == baseline:
            ci, method = mean_ci(s.values)
            out.append(RowStats(s.group, len(s.values), float(np.mean(s.values)) if s.values else None, ci, method))
        else:
            out.append(_against(s, base, delta))
    tested = [r for r in out if r.group != baseline and r.p_value is not None]
    for r, p in zip(tested, holm([r.p_value for r in tested])):
        r.p_holm = p
    for r in out:
        if r.group != baseline:
            r.p_floor = holm_floor(r.p_floor, len(tested))
            r.verdict = _verdict(r.diff, r.p_holm, r.p_floor)
    return out


def holm_floor(floor: Optional[float], rows: int) -> Optional[float]:
    """The smallest Holm-adjusted p a row can reach among `rows` tests: Holm multiplies the
    smallest p by the number of rows, so 5 vs 5 seeds (floor 0.0079) can never pass 0.05 against
    seven or more other rows, however far apart they are."""
    return None if floor is None else min(1.0, floor * max(1, rows))


def seeds_for_a_verdict(rows: int, cap: int = 50) -> Optional[int]:
    """Seeds per row (all rows equal) for which Holm over `rows` tests can reach p < ALPHA."""
    return next((n for n in range(2, cap) if holm_floor(p_floor(n, n), rows) < ALPHA), None)
