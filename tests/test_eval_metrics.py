"""Eval metrics against brute force and hand-computed numbers."""

from __future__ import annotations

import math
from itertools import combinations

import pytest

from stapoctl.eval.metrics import avg_at_k, maj_at_k, mean_ci95, pass_at_k, summarize


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Enumerate every k-subset of n samples (the first c correct): fraction with a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 = c/n
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(32, 0, 32) == 0.0
    assert pass_at_k(32, 1, 32) == 1.0
    # large n stays finite and exact enough: 1 - C(900,16)/C(1000,16)
    expected = 1 - math.comb(900, 16) / math.comb(1000, 16)
    assert pass_at_k(1000, 100, 16) == pytest.approx(expected, rel=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_avg_at_k_hand_built():
    # problem 1: 3/4, problem 2: 0/4, problem 3: 4/4 -> (0.75 + 0 + 1) / 3
    correct = [[True, True, True, False], [False] * 4, [True] * 4]
    assert avg_at_k(correct) == pytest.approx(1.75 / 3)
    # mean of per-problem means, not the pooled sample mean: (1/2 + 1/4)/2 = 0.375, pooled 2/6
    assert avg_at_k([[True, False], [True, False, False, False]]) == pytest.approx(0.375)
    assert avg_at_k([]) == 0.0


def test_maj_at_k_votes_by_normalized_answer():
    answers = [
        ["5", "5", "6", None],  # majority "5" (correct)
        ["1,000", "1000", "7", "7"],  # "1,000" and "1000" are one vote block of 2, tie with "7": first seen wins
        [None, None, None, None],  # nobody answered: 0
        ["3", "4", "4", "4"],  # majority "4" is wrong
    ]
    correct = [
        [True, True, False, False],
        [True, True, False, False],
        [False] * 4,
        [True, False, False, False],
    ]
    assert maj_at_k(answers, correct) == pytest.approx(2 / 4)


def test_mean_ci95_hand_computed():
    # values 0, 1, 1, 0: mean 0.5, sample std sqrt(1/3), half-width t(0.975, 3) * sqrt(1/3)/2,
    # t(0.975, 3) = 3.1824 from a t table (the normal's 1.96 would be 38% too narrow here)
    mean, half = mean_ci95([0.0, 1.0, 1.0, 0.0])
    assert mean == 0.5
    assert half == pytest.approx(3.182446305284263 * math.sqrt(1 / 3) / 2)
    assert mean_ci95([0.3]) == (0.3, 0.0)
    # AIME's 30 problems, half solved: t(0.975, 29) = 2.0452, 4.4% wider than z = 1.96
    values = [1.0] * 15 + [0.0] * 15
    assert mean_ci95(values)[1] == pytest.approx(2.045229642132703 * math.sqrt(30 / 29 * 0.25 / 30))


def test_summarize_from_records():
    def rec(pid, i, correct, extracted, length, truncated=False, skipped=False):
        return {"id": pid, "sample_index": i, "correct": correct, "extracted": extracted,
                "length": length, "truncated": truncated, "skipped": skipped}

    records = [
        rec("a", 1, False, "3", 10), rec("a", 0, True, "2", 20),  # out of order on purpose
        rec("b", 0, False, None, 30, truncated=True), rec("b", 1, False, "9", 40),
        rec("c", 0, False, None, 0, skipped=True), rec("c", 1, False, None, 0, skipped=True),
    ]
    s = summarize(records, k=2)
    assert s["avg@2"] == pytest.approx(0.5 / 3)  # (1/2 + 0 + 0) / 3
    assert s["pass@2"] == pytest.approx(1 / 3)  # only "a" solved
    assert s["pass@1"] == pytest.approx(s["avg@2"])  # unbiased pass@1 = c/n per problem
    assert s["maj@2"] == pytest.approx(1 / 3)  # "a": tie 2 vs 3, "2" first by sample order -> correct
    assert s["problems"] == 3 and s["samples"] == 6 and s["skipped"] == 1
    assert s["response_length"] == pytest.approx(25.0)  # skipped prompts generate nothing
    assert s["truncation_rate"] == pytest.approx(0.25)
    assert s["no_answer_rate"] == pytest.approx(0.25)
