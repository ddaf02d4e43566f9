"""`compare`'s statistics where they claim to be exact (analysis/statistics.py), each against a
value worked out here independently: the permutation p by enumerating every split in exact
fractions, the p floor by brute force over Holm, the paired p with no spread, a NaN seed."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from stapoctl.analysis import statistics as st


def exact_p(row: list[float], base: list[float]) -> Fraction:
    """Two-sided permutation p (twice the smaller one-sided p) over every split, in exact
    decimal fractions: no float ever decides a tie."""
    pool = [Fraction(str(v)) for v in row + base]
    observed = sum(pool[:len(row)])
    sums = [sum(pool[i] for i in split) for split in itertools.combinations(range(len(pool)), len(row))]
    ge, le = sum(s >= observed for s in sums), sum(s <= observed for s in sums)
    return min(Fraction(1), 2 * Fraction(min(ge, le), len(sums)))


# 5 vs 5, sums 2.60 and 2.58: many splits tie the observed 2.60 exactly, but in floats they land
# ~1e-16 either side, within no tolerance relative to the tiny difference of means (0.004)
TIED_ROW = [0.45, 0.45, 0.43, 0.66, 0.61]
TIED_BASE = [0.47, 0.43, 0.41, 0.66, 0.61]


def test_ties_count_in_the_permutation_p():
    exact = exact_p(TIED_ROW, TIED_BASE)
    assert exact == Fraction(125, 126)  # 125 of 252 splits reach a sum ≤ 2.60: p = 2 x 125/252
    assert st.permutation_p(TIED_ROW, TIED_BASE) == pytest.approx(float(exact), abs=1e-12)
    # the case really is about float rounding: splits equal in exact arithmetic are unequal in floats
    pool = np.array(TIED_ROW + TIED_BASE)
    diffs = [pool[list(s)].mean() - np.delete(pool, list(s)).mean()
             for s in itertools.combinations(range(10), 5)]
    observed = diffs[0]
    assert any(0 < abs(d - observed) < 1e-15 for d in diffs)


@pytest.mark.parametrize("row, base", [
    ([0.1, 0.2, 0.3], [0.3, 0.1, 0.2, 0.6, 0.7]),  # 3 vs 5, ties inside each row
    ([0.25, 0.5, 0.75, 0.5], [0.5, 0.5, 0.25, 0.75]),  # equal sums: p = 1
    ([0.61, 0.62, 0.6], [0.41, 0.4, 0.42, 0.44]),  # separated: the floor 2/C(7, 3) = 2/35
])
def test_permutation_p_is_the_exact_enumeration(row, base):
    assert st.permutation_p(row, base) == pytest.approx(float(exact_p(row, base)), abs=1e-12)


def test_permutation_p_on_the_separated_case_is_its_floor():
    assert st.permutation_p([0.61, 0.62, 0.6], [0.41, 0.4, 0.42, 0.44]) == pytest.approx(2 / 35)


def test_too_many_splits_are_sampled_and_the_floor_says_so():
    """11 vs 11 seeds: 705,432 splits, more than EXACT_SPLITS; 9999 random ones plus the observed
    split give at best 2/10000, which is also the floor (not 2/705432)."""
    row, base = [1.0 + 0.01 * i for i in range(11)], [0.01 * i for i in range(11)]
    assert math.comb(22, 11) > st.EXACT_SPLITS
    assert st.permutation_p(row, base) == pytest.approx(2 / 10000)
    assert st.p_floor(11, 11) == pytest.approx(2 / 10000)
    assert st.p_floor(10, 10) == pytest.approx(2 / math.comb(20, 10))  # still enumerated


# -- the p floor -----------------------------------------------------------------------------------
BASE5 = [0.40, 0.41, 0.42, 0.43, 0.44]


def test_three_seeds_against_five_among_four_rows_is_better_not_too_few():
    """The issue's case: 3 seeds (raw floor 2/C(8, 3) = 1/28) among three 5-seed rows (2/252 = 1/126),
    all far from a 5-seed baseline. Holm: 1/126 three times → 4/126, 4/126, 4/126; the 3-seed row
    last: max(1 x 1/28, 4/126) = 1/28 = 0.036 < 0.05. Its floor is 1/28 too (placed last), not
    4 x 1/28 = 0.143; a 5-seed row's floor is 4 x 1/126 = 0.032 (placed first)."""
    samples = [st.Sample("grpo", BASE5), st.Sample("three", [0.60, 0.61, 0.62]),
               st.Sample("up", [v + 0.3 for v in BASE5]), st.Sample("down", [v - 0.2 for v in BASE5]),
               st.Sample("up2", [v + 0.4 for v in BASE5])]
    rows = {r.group: r for r in st.against(samples, "grpo")}
    three = rows["three"]
    assert three.p_value == pytest.approx(1 / 28)
    assert three.p_holm == pytest.approx(1 / 28) and round(three.p_holm, 3) == 0.036
    assert three.p_floor == pytest.approx(1 / 28)
    assert three.verdict == "better"
    for name in ("up", "down", "up2"):
        assert rows[name].p_value == pytest.approx(1 / 126)
        assert rows[name].p_holm == pytest.approx(4 / 126) and rows[name].p_floor == pytest.approx(4 / 126)
    assert rows["down"].verdict == "worse"


def brute_floor(raw: list[float], r: int) -> float:
    """The least Holm-adjusted p of row r over p-values on a grid at or above each row's floor."""
    grids = [sorted({f, min(1.0, 1.5 * f), min(1.0, 3 * f), 0.5, 1.0}) for f in raw]
    return min(st.holm(list(ps))[r] for ps in itertools.product(*grids))


@pytest.mark.parametrize("counts", [(3, 5, 5, 5), (2, 4, 6), (3, 3), (4, 6, 2, 5), (6,), (2, 2, 3, 7)])
def test_the_floor_is_the_least_holm_p_the_seed_counts_allow(counts):
    raw = [st.p_floor(n, 5) for n in counts]
    for r, f in enumerate(raw):
        floor = st.holm_floor(f, raw[:r] + raw[r + 1:])
        assert floor == pytest.approx(brute_floor(raw, r))


def test_p_holm_is_never_below_the_floor_and_reaches_it_when_rows_are_far_apart():
    rng = np.random.default_rng(7)
    for case in range(25):
        n_base, counts = int(rng.integers(2, 7)), [int(c) for c in rng.integers(2, 7, size=rng.integers(1, 5))]
        base = list(np.round(rng.normal(0.5, 0.05, n_base), 3))
        far = case % 2 == 0  # every row beyond the baseline's range, so each p is its raw floor
        samples = [st.Sample("base", base)] + [
            st.Sample(f"r{i}", list(np.round((1.0 + i if far else 0.5) + rng.normal(0, 0.05, n), 3)))
            for i, n in enumerate(counts)]
        for row in st.against(samples, "base")[1:]:
            assert row.p_holm >= row.p_floor - 1e-12, (case, row)
            if far:
                assert row.p_holm == pytest.approx(row.p_floor), (case, row)
            if row.p_floor >= st.ALPHA:
                assert row.verdict == "too few seeds"


# -- degenerate inputs ------------------------------------------------------------------------------
def test_constant_paired_differences_have_no_paired_p():
    seeds = ["0", "1", "2", "3"]
    exact = st.against([st.Sample("b", [1.0, 2.0, 3.0, 4.0], seeds), st.Sample("r", [1.5, 2.5, 3.5, 4.5], seeds)], "b")
    assert exact[1].p_paired is None  # differences exactly 0.5 each
    base = [0.41, 0.42, 0.43, 0.47]  # + 0.2: differences 0.2 up to ~1e-17 of rounding
    rounded = st.against([st.Sample("b", base, seeds), st.Sample("r", [v + 0.2 for v in base], seeds)], "b", 0.01)
    assert np.ptp(np.subtract([v + 0.2 for v in base], base)) > 0  # float rounding does leave a spread
    assert rounded[1].p_paired is None and rounded[1].seeds_needed is None
    spread = st.against([st.Sample("b", base, seeds), st.Sample("r", [0.62, 0.61, 0.64, 0.66], seeds)], "b")
    # differences 0.21, 0.19, 0.21, 0.19: mean 0.2, sd 0.011547 → t = 0.2 / (0.011547 / 2) = 34.64, df 3
    from scipy import stats

    assert spread[1].p_paired == pytest.approx(2 * stats.t.sf(0.2 / (0.02 / math.sqrt(3) / 2), 3), rel=1e-6)


def test_a_nan_seed_never_gives_p_zero():
    assert st.permutation_p([0.5, float("nan"), 0.6], [0.4, 0.41, 0.42]) is None
