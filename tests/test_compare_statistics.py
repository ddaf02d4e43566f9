"""The statistics of `stapoctl compare` (analysis/statistics.py) on hand-computed cases, and the
"Against" table / table.json rows built from a Comparison of stand-in runs (no MLflow, no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stapoctl.analysis import statistics as st
from stapoctl.analysis.collect import Comparison, Trial

LOW = [0.40, 0.42, 0.41, 0.43, 0.39, 0.44]  # mean 0.415
HIGH = [0.60, 0.62, 0.61, 0.63, 0.59, 0.64]  # mean 0.615
SEEDS = ["1", "2", "3", "4", "5", "6"]


def test_bootstrap_ci_covers_the_mean_and_is_reproducible():
    ci, method = st.mean_ci(LOW)
    assert method == "BCa"
    assert ci[0] < sum(LOW) / len(LOW) < ci[1]
    assert min(LOW) <= ci[0] and ci[1] <= max(LOW)
    assert st.mean_ci(LOW) == (ci, method)  # fixed random state


def test_constant_values_fall_back_to_percentile_and_few_seeds_have_no_ci():
    assert st.mean_ci([0.5] * 6) == ([0.5, 0.5], "percentile")
    assert st.mean_ci([0.5, 0.6]) == (None, None)


def test_identical_rows_are_within_noise():
    rows = st.against([st.Sample("grpo", LOW, SEEDS), st.Sample("same", list(LOW), SEEDS)], "grpo")
    same = rows[1]
    assert same.p_value == 1.0 and same.p_holm == 1.0
    assert same.diff == 0.0
    assert same.verdict == "within noise"
    assert same.p_paired is None  # all paired differences 0: no t statistic


def test_separated_rows_are_better_and_worse():
    rows = st.against([st.Sample("grpo", LOW, SEEDS), st.Sample("up", HIGH, SEEDS),
                       st.Sample("down", [v - 0.2 for v in LOW], SEEDS)], "grpo")
    base, up, down = rows
    assert base.verdict == "baseline" and base.diff is None and base.ci95
    # 6 vs 6: 924 splits, the observed one the most extreme either way → exact p = 2/924
    # p floor after Holm over the 2 tested rows: 2 x 2/924
    assert up.p_value == pytest.approx(2 / 924) and up.p_floor == pytest.approx(2 * 2 / 924)
    assert up.p_holm == pytest.approx(2 * 2 / 924)
    assert up.verdict == "better" and down.verdict == "worse"
    assert up.diff == pytest.approx(0.2)
    assert up.diff_ci95[0] < 0.2 < up.diff_ci95[1] and up.diff_ci95[0] > 0
    # HIGH is LOW + 0.2 seed by seed: the differences have no spread (only ~1e-17 of float rounding),
    # so the paired t-test has no noise estimate and says nothing, rather than p = 0
    assert up.p_paired is None


def test_holm_on_a_hand_example():
    assert st.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert st.holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert st.holm([0.4, 0.9]) == pytest.approx([0.8, 0.9])


def test_three_seeds_against_three_cannot_reach_significance():
    rows = st.against([st.Sample("grpo", [0.1, 0.11, 0.12]), st.Sample("stapo", [0.9, 0.91, 0.92])], "grpo")
    assert rows[1].p_floor == pytest.approx(0.1)  # 2 / C(6, 3)
    assert rows[1].p_value == pytest.approx(0.1)
    assert rows[1].verdict == "too few seeds"
    assert st.p_floor(5, 5) == pytest.approx(2 / 252)


def test_holm_over_many_rows_raises_the_floor_to_too_few_seeds():
    """5 vs 5 seeds reach p = 2/252 = 0.0079 at best; Holm over 8 rows multiplies it to 0.063: even
    rows far apart cannot be called better/worse, and the verdict says so instead of 'within noise'."""
    base = [0.60, 0.61, 0.62, 0.63, 0.64]
    samples = [st.Sample("grpo", base)] + [st.Sample(f"m{i}", [v - 0.1 - 0.01 * i for v in base]) for i in range(8)]
    rows = st.against(samples, "grpo")
    far = rows[1]
    assert far.p_value == pytest.approx(2 / 252)
    assert far.p_floor == pytest.approx(8 * 2 / 252) and far.p_holm == pytest.approx(8 * 2 / 252)
    assert far.verdict == "too few seeds"
    assert st.seeds_for_a_verdict(8) == 6  # 2 / C(12, 6) x 8 = 0.017 < 0.05; 5 seeds: 0.063
    assert st.seeds_for_a_verdict(1) == 4  # 2 / C(8, 4) = 0.029; 3 vs 3: 0.1
    three = st.against(samples[:4], "grpo")  # Holm over 3 rows: 3 x 0.0079 = 0.024 < 0.05
    assert three[1].verdict == "worse"


def test_one_seed_per_row_is_too_few_not_an_error():
    """A sweep with seeds=[0] (the end-to-end sweep tests run one): no test is possible."""
    rows = st.against([st.Sample("a", [0.5], ["0"]), st.Sample("b", [0.6], ["0"])], "a", delta=0.02)
    assert rows[1].verdict == "too few seeds" and rows[1].p_value is None
    assert rows[1].p_floor == 1.0 and rows[1].ci95 is None  # 2 / C(2, 1)


def test_seeds_needed_matches_the_textbook_value():
    # Cohen's d = 1, two-sample two-sided α = .05, power .8 → 17 per group (G*Power, pwr.t.test)
    assert st.seeds_needed(1.0, 1.0) == 17
    assert st.seeds_needed(0.5, 1.0) == 64
    assert st.power(17, 1.0) >= 0.8 > st.power(16, 1.0)
    assert st.seeds_needed(1.0, 0.0) is None


def test_seeds_needed_uses_pooled_or_paired_sd():
    unpaired = st.against([st.Sample("grpo", LOW), st.Sample("up", HIGH)], "grpo", delta=0.02)[1]
    sd = st.pooled_sd(LOW, HIGH)
    assert unpaired.seeds_needed == st.seeds_needed(0.02, sd)
    jitter = [v + d for v, d in zip(HIGH, [0.001, -0.001, 0.002, 0.0, -0.002, 0.001])]
    paired = st.against([st.Sample("grpo", HIGH, SEEDS), st.Sample("j", jitter, SEEDS)], "grpo", delta=0.02)[1]
    assert paired.seeds_needed < unpaired.seeds_needed  # seed-matched noise cancels


# -- the table and table.json rows from a Comparison of stand-in runs ---------------------------
def _trial(group: str, seed: str, acc: dict) -> Trial:
    run = SimpleNamespace(info=SimpleNamespace(run_id=f"{group}{seed}".ljust(32, "0"), run_name=f"{group}-{seed}",
                                               status="FINISHED"),
                          data=SimpleNamespace(metrics={"actor/entropy": 0.5 + 0.01 * int(seed)}, params={}, tags={}))
    return Trial(run, group, seed, {(b, "train"): (v, 8, "eval") for b, v in acc.items()})


def _comparison(groups: dict[str, list[float]]) -> Comparison:
    from stapoctl.data.benches import PAPER_BENCHES

    b1, b2 = PAPER_BENCHES[:2]
    trials = {g: [_trial(g, str(i + 1), {b1: v - 0.01, b2: v + 0.01}) for i, v in enumerate(vs)]
              for g, vs in groups.items()}
    ids = [t.id for ts in trials.values() for t in ts]
    return Comparison("loss.name", trials, [], False, {i: i[:8] for i in ids})


def test_against_table_and_json_rows_from_a_comparison():
    from rich.console import Console

    from stapoctl.analysis.compare import stats_records, stats_summary, test_rows
    from stapoctl.analysis.tables import csv_text, records, stats_table

    comp = _comparison({"stapo": HIGH[::-1], "grpo": LOW, "dapo": LOW[:2]})
    tested = test_rows(comp, None, None, 5.0)
    assert tested.baseline == "grpo" and tested.metric == "avg/train" and tested.scale == 100.0
    rows = {r["group"]: r for r in stats_records(comp, tested)}
    for key in ("n_seeds", "mean", "ci95", "diff", "diff_ci95", "p_value", "p_holm", "p_paired", "verdict",
                "p_floor", "ci_method", "seeds_needed"):
        assert key in rows["stapo"]
    assert rows["stapo"]["mean"] == pytest.approx(0.615) and rows["stapo"]["verdict"] == "better"
    assert rows["stapo"]["p_paired"] is not None and rows["stapo"]["seeds_needed"] >= 2
    assert rows["dapo"]["ci95"] is None and rows["dapo"]["verdict"] == "too few seeds"
    assert stats_summary(tested)["seeds_needed_delta"] == 5.0
    console = Console(width=200, record=True)
    console.print(stats_table(tested.rows, tested.scale, 5.0))
    text = console.export_text()
    assert "61.50 [" in text and "+20.00 [" in text and "n<3: no CI" in text and "better" in text
    csv = csv_text(records(comp) + list(rows.values()))
    assert "statistics" not in csv  # the CSV keeps its layout


def test_test_metric_and_baseline_options():
    from stapoctl.analysis.compare import test_rows
    from stapoctl.errors import UserError

    comp = _comparison({"stapo": HIGH, "grpo": LOW})
    tested = test_rows(comp, "actor/entropy", "stapo", None)
    assert tested.scale == 1.0 and tested.baseline == "stapo" and tested.rows[1].seeds_needed is None
    with pytest.raises(UserError, match="rows: stapo, grpo"):
        test_rows(comp, None, "ppo", None)
    with pytest.raises(UserError, match="no run has it"):
        test_rows(comp, "nope/metric", None, None)
    assert test_rows(_comparison({"a": LOW, "b": HIGH}), None, None, None).baseline == "a"


def test_figure_error_bars_are_the_ci_from_three_seeds_and_std_below(tmp_path):
    from stapoctl.analysis import figures
    from stapoctl.analysis.cells import accuracy_cells

    comp = _comparison({"grpo": LOW, "dapo": LOW[:2]})
    cells = accuracy_cells(comp)
    many, few = cells["grpo"]["avg/train"], cells["dapo"]["avg/train"]
    err = figures._yerr([many, few])
    lo, hi = st.mean_ci(many.values)[0]
    assert list(err[:, 0]) == pytest.approx([100 * (many.mean - lo), 100 * (hi - many.mean)])
    assert list(err[:, 1]) == pytest.approx([100 * few.std, 100 * few.std])
    assert figures.accuracy_by_group(comp, tmp_path / "acc.png").stat().st_size > 10_000
