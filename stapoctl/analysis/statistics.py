"""Seed-level statistics for `stapoctl compare` (numpy/scipy only, no MLflow).

A few seeds per method cannot separate a real gain from seed noise by eye; this module says,
per row, how sure the comparison is: the mean with a bootstrap 95% CI over seeds, the
difference to a baseline row with its CI, an exact (when small) unpaired permutation p-value,
Holm-adjusted across rows, a verdict, the smallest Holm-adjusted p these seed counts can reach,
and how many seeds a given difference would need. Higher is better for the verdict.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from itertools import chain, combinations
from typing import Optional, Sequence

import numpy as np

ALPHA = 0.05
POWER = 0.80
MIN_CI_SEEDS = 3  # below this a bootstrap CI is meaningless (2 values give 3 distinct resamples)
N_RESAMPLES = 9999  # bootstrap resamples; random splits of a permutation test too large to enumerate
EXACT_SPLITS = 200_000  # the permutation test enumerates every split up to this many (10 vs 10 seeds: 184,756)
RTOL = 1e-9  # two splits whose sums differ by less than this × the data's size are a tie, not a difference
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
    trials_lost: int = 0  # the row's trials left out: FAILED, KILLED, no finite value (set by compare)
    alarm_stopped: int = 0  # the row's trials a run-health alarm stopped, counted at their last validation

    @property
    def verdict_text(self) -> str:
        """The verdict and what it rests on: `better (lost 1 of 5 trials)`."""
        marks = ([f"lost {self.trials_lost} of {self.n_seeds + self.trials_lost} trials"] if self.trials_lost else [])
        marks += [f"{self.alarm_stopped} stopped by an alarm"] if self.alarm_stopped else []
        return self.verdict + (f" ({'; '.join(marks)})" if marks else "")

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


def _split_sums(pool: np.ndarray, n: int) -> tuple[np.ndarray, bool]:
    """The first group's sum over every split of pool into n and the rest (True: exact), or over
    N_RESAMPLES random splits when there are more than EXACT_SPLITS."""
    total = math.comb(len(pool), n)
    if total <= EXACT_SPLITS:
        idx = np.fromiter(chain.from_iterable(combinations(range(len(pool)), n)), dtype=np.intp, count=total * n)
        return pool[idx.reshape(total, n)].sum(axis=1), True
    perms = _rng().permuted(np.tile(np.arange(len(pool)), (N_RESAMPLES, 1)), axis=1)[:, :n]
    return pool[perms].sum(axis=1), False


def permutation_p(row: Sequence[float], base: Sequence[float]) -> Optional[float]:
    """Two-sided unpaired permutation p of the difference of means: twice the smaller one-sided p
    (scipy's convention), every split enumerated up to EXACT_SPLITS. Not scipy's permutation_test:
    it ties a split only within 100 eps of the observed difference, so near a small difference
    splits equal but for float rounding (~1e-16) are missed and p comes out too small. Here the
    statistic is the row's sum (the same ordering for fixed sizes) and sums within RTOL of the
    data's size tie. None below two seeds a side or with a non-finite value (never p = 0)."""
    if min(len(row), len(base)) < 2:
        return None
    pool = np.asarray([*row, *base], float)
    if not np.all(np.isfinite(pool)):
        return None
    sums, exact = _split_sums(pool, len(row))
    observed, tol = float(np.sum(pool[:len(row)])), RTOL * float(np.abs(pool).sum())
    ge, le, total = int(np.sum(sums >= observed - tol)), int(np.sum(sums <= observed + tol)), len(sums)
    if not exact:  # the observed split counts as one of the random ones (p is never 0)
        ge, le, total = ge + 1, le + 1, total + 1
    return min(1.0, 2.0 * min(ge, le) / total)


def p_floor(n_row: int, n_base: int) -> Optional[float]:
    """Smallest two-sided p the permutation test can give: 2 / C(n_row+n_base, n_row), or
    2 / (N_RESAMPLES+1) when it samples the splits."""
    if n_row < 1 or n_base < 1:
        return None
    splits = math.comb(n_row + n_base, n_row)
    return min(1.0, 2.0 / (splits if splits <= EXACT_SPLITS else N_RESAMPLES + 1))


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


def no_spread(values: Sequence[float], scale: Sequence[float]) -> bool:
    """All values equal up to float rounding (RTOL of the largest |scale|): 0.61 − 0.41 and
    0.62 − 0.42 differ by ~1e-17, which a t statistic would divide by and call certainty."""
    return float(np.ptp(values)) <= RTOL * float(np.max(np.abs(scale)))


def paired_p(pair: Optional[tuple[list[float], list[float]]]) -> Optional[float]:
    """Paired t-test p (informational); None when the differences have no spread (every seed
    moved by the same constant: no noise estimate, not certainty)."""
    from scipy import stats

    if pair is None or no_spread(np.subtract(*pair), pair):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = float(stats.ttest_rel(pair[0], pair[1]).pvalue)
    return p if math.isfinite(p) else None


def power(n: int, effect: float, paired_test: bool = False, alpha: float = ALPHA) -> float:
    """Power of the two-sided t-test (two samples of n, or n pairs) at standardized effect and
    level alpha (a confirmatory sweep sizes at ALPHA / m: Bonferroni over its m rows)."""
    from scipy import stats

    df = n - 1 if paired_test else 2 * n - 2
    ncp = effect * math.sqrt(n if paired_test else n / 2)
    crit = stats.t.ppf(1 - alpha / 2, df)
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


def _paired_sd(pair: tuple[list[float], list[float]]) -> float:
    diffs = np.subtract(*pair)
    return 0.0 if no_spread(diffs, pair) else float(np.std(diffs, ddof=1))


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
        sd = _paired_sd(pair) if pair else pooled_sd(row.values, base.values)
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
    raw = {id(r): r.p_floor for r in out}
    for r in out:
        if r.group != baseline:  # an untested row's floor is as if it joined the family
            r.p_floor = holm_floor(raw[id(r)], [raw[id(o)] for o in tested if o is not r])
            r.verdict = _verdict(r.diff, r.p_holm, r.p_floor)
    return out


def holm_floor(floor: Optional[float], others: Sequence[float]) -> Optional[float]:
    """The smallest Holm-adjusted p a row with raw floor `floor` (p_floor) can reach beside rows
    with raw floors `others`, m tests in all. Placed k-th smallest, Holm gives it
    max((m−k+1)·floor, max over the j < k rows before it of (m−j+1)·their p), those p at best
    the others' k−1 smallest floors; the floor is the least of these over k. So 3 vs 5 seeds
    (2/56) among three 5-vs-5 rows (2/252) can reach 2/56 = 0.036, not 4 × 2/56 = 0.14, while
    5 vs 5 among eight such rows cannot pass 8 × 2/252 = 0.063."""
    if floor is None:
        return None
    srt, m = sorted(others), len(others) + 1
    best, before = 1.0, 0.0
    for k in range(1, m + 1):
        best = min(best, max((m - k + 1) * floor, before))
        if k < m:
            before = max(before, (m - k + 1) * srt[k - 1])
    return min(1.0, best)


def seeds_for_a_verdict(rows: int, cap: int = 50) -> Optional[int]:
    """Seeds per row (all rows equal) for which Holm over `rows` tests can reach p < ALPHA."""
    return next((n for n in range(2, cap) if holm_floor(p_floor(n, n), [p_floor(n, n)] * (rows - 1)) < ALPHA),
                None)
