"""Which trials `stapoctl compare` counts, on a real MLflow sqlite store built without training
(the `Store` of test_compare_merge): a FINISHED trial counts; one a run-health alarm stopped
(KILLED with the tag `stapoctl.alarm_stopped`) counts at its last validation, marked; one that
FAILED or a person KILLED is left out, named in a note and counted against its row; a NaN or
missing final value leaves the trial out with a note, and never crashes the table.

One sweep of `loss`, baseline grpo on seeds 0–4 with the tied values of test_compare_exact:
- tied:  the tied row (exact p 125/126) plus seed 5 FINISHED without any validation (missing);
- stapo: 0.80–0.84 on seeds 0–4, seed 5 FAILED at 0.99: n 5, mean 0.82 (0.848 if it counted);
- dapo:  0.20, 0.21, 0.23, 0.24, 0.25 on seeds 0, 1, 3, 4, 5, seed 2 NaN;
- ppo:   0.90, 0.91, 0.92, 0.93 on seeds 0, 2, 4, 5, seed 1 stopped by an alarm at 0.10 (counts),
         seed 3 KILLED by a person at 0.95 after that alarm had only warned (left out).
"""

from __future__ import annotations

import json
import math
import os

import pytest
from mlflow.entities import Metric, Param, RunTag
from test_compare_exact import TIED_BASE, TIED_ROW, exact_p
from test_compare_merge import BENCH_METRIC, STEPS, Store

from stapoctl.tracking import keys

ALARM = keys.ALARM_PREFIX + "entropy_collapse"


def trial(s: Store, sweep: str, value: str, seed: int, acc, status: str = "FINISHED", tags=()) -> str:
    """A trial as Store.trial lays it out; acc None logs no validation at all."""
    run = s.client.create_run(s.exp, run_name=f"{value}-seed{seed}", start_time=s.tick(),
                              tags={keys.PARENT: sweep, keys.KIND: keys.KIND_TRAIN, keys.SWEEP_ID: sweep,
                                    keys.SWEEP_VALUE: value, keys.SEED: str(seed)})
    rid = run.info.run_id
    s.client.log_batch(rid, params=[Param("trainer.seed", str(seed))],
                       metrics=[] if acc is None else [Metric(BENCH_METRIC, acc, s.clock, STEPS)],
                       tags=[RunTag(k, v) for k, v in tags])
    s.client.set_terminated(rid, status, end_time=s.tick())
    return rid


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("trials_store")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        s = Store(root)
        sid = s.sweep("baselines", "loss")
        ids = {}
        for seed, v in enumerate(TIED_BASE):
            ids["grpo", seed] = trial(s, sid, "grpo", seed, v)
        for seed, v in enumerate(TIED_ROW + [None]):
            ids["tied", seed] = trial(s, sid, "tied", seed, v)
        for seed, v in enumerate([0.80, 0.81, 0.82, 0.83, 0.84, 0.99]):
            ids["stapo", seed] = trial(s, sid, "stapo", seed, v, status="FAILED" if seed == 5 else "FINISHED")
        for seed, v in enumerate([0.20, 0.21, math.nan, 0.23, 0.24, 0.25]):
            ids["dapo", seed] = trial(s, sid, "dapo", seed, v)
        for seed, v in enumerate([0.90, 0.10, 0.91, 0.95, 0.92, 0.93]):
            status = "KILLED" if seed in (1, 3) else "FINISHED"
            # seed 1: stopped by the alarm; seed 3: a person stopped it after the alarm had only warned
            tags = {1: [(ALARM, "7"), (keys.ALARM_STOPPED, "entropy_collapse")], 3: [(ALARM, "7")]}.get(seed, [])
            ids["ppo", seed] = trial(s, sid, "ppo", seed, v, status, tags)
    finally:
        os.chdir(cwd)
    return {"uri": s.uri, "sweep": sid, "ids": ids}


def test_failed_and_killed_trials_are_left_out_and_named_an_alarm_stop_counts(sweep):
    from stapoctl.analysis.collect import collect

    comp = collect(sweep["uri"], [sweep["sweep"]])
    ids, short = sweep["ids"], comp.short
    seeds = {g: sorted(t.seed for t in ts) for g, ts in comp.groups.items()}
    assert seeds["stapo"] == ["0", "1", "2", "3", "4"] and seeds["ppo"] == ["0", "1", "2", "4", "5"]
    assert seeds["dapo"] == seeds["tied"] == ["0", "1", "2", "3", "4", "5"]  # still runs; their value is missing
    assert comp.lost == {"stapo": [short[ids["stapo", 5]]], "ppo": [short[ids["ppo", 3]]]}
    (alarmed,) = [t for t in comp.groups["ppo"] if t.alarms]
    assert alarmed.id == ids["ppo", 1] and alarmed.alarms == ["entropy_collapse"]
    failed, stopped = comp.notes
    assert failed == (f"compare: left out 2 trial(s) that FAILED or were KILLED: {short[ids['stapo', 5]]} "
                      f"(loss=stapo seed 5, FAILED), {short[ids['ppo', 3]]} (loss=ppo seed 3, KILLED)")
    assert stopped == (f"compare: counted 1 trial(s) stopped by a run-health alarm, at their last validation: "
                       f"{short[ids['ppo', 1]]} (loss=ppo seed 1, alarm entropy_collapse)")


def test_the_command_prints_right_p_values_and_verdicts_and_names_what_it_left_out(sweep, tmp_path):
    from rich.console import Console

    from stapoctl.analysis.compare import compare

    console = Console(width=300, record=True)
    out = tmp_path / "table"
    compare(sweep["uri"], [sweep["sweep"]], console, out=str(out))  # a NaN final value: no crash
    data = json.loads((out / "table.json").read_text())
    rows = {r["group"]: r for r in data["rows"] if r["table"] == "statistics"}
    assert rows["stapo"]["n_seeds"] == 5 and rows["stapo"]["mean"] == pytest.approx(0.82)  # not 0.848
    assert rows["dapo"]["n_seeds"] == 5 and rows["dapo"]["mean"] == pytest.approx(0.226)
    assert rows["ppo"]["n_seeds"] == 5 and rows["ppo"]["mean"] == pytest.approx((0.90 + 0.10 + 0.91 + 0.92 + 0.93) / 5)
    assert rows["tied"]["n_seeds"] == 5
    # exact p: 5 vs 5 beyond the baseline's range 2/252; ppo's 0.10 lets 33 of 252 splits reach its sum
    assert rows["stapo"]["p_value"] == pytest.approx(1 / 126) and rows["dapo"]["p_value"] == pytest.approx(1 / 126)
    assert rows["ppo"]["p_value"] == pytest.approx(float(exact_p([0.90, 0.10, 0.91, 0.92, 0.93], TIED_BASE)))
    assert rows["ppo"]["p_value"] == pytest.approx(11 / 42)
    assert rows["tied"]["p_value"] == pytest.approx(125 / 126)
    # Holm over 4 rows: 1/126, 1/126, 11/42, 125/126 → 4/126, 4/126, 2 x 11/42, 125/126
    assert rows["stapo"]["p_holm"] == pytest.approx(4 / 126) and rows["ppo"]["p_holm"] == pytest.approx(11 / 21)
    assert rows["tied"]["p_holm"] == pytest.approx(125 / 126)
    assert [rows[g]["verdict"] for g in ("tied", "stapo", "dapo", "ppo")] == ["within noise", "better", "worse",
                                                                             "within noise"]
    assert {g: (rows[g]["trials_lost"], rows[g]["alarm_stopped"]) for g in rows} == {
        "grpo": (0, 0), "tied": (1, 0), "stapo": (1, 0), "dapo": (1, 0), "ppo": (1, 1)}
    notes = data["notes"]
    assert len(notes) == 3 and notes[2].startswith("compare: toy/train: left out 2 trial(s) without a final value: ")
    assert "(loss=tied seed 5, missing)" in notes[2] and "(loss=dapo seed 2, NaN)" in notes[2]
    text = " ".join(console.export_text().split())
    assert all(" ".join(n.split()) in text for n in notes)
    assert "better (lost 1 of 6 trials)" in text and "worse (lost 1 of 6 trials)" in text
    assert "within noise (lost 1 of 6 trials; 1 stopped by an alarm)" in text
    assert "killed (alarm: entropy_collapse)" in (out / "table.md").read_text()


def test_a_row_of_failed_runs_only_is_one_line(tmp_path):
    from stapoctl.analysis.collect import collect
    from stapoctl.errors import UserError

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        s = Store(tmp_path)
        sid = s.sweep("baselines", "loss")
        trial(s, sid, "grpo", 0, 0.5, status="FAILED")
    finally:
        os.chdir(cwd)
    with pytest.raises(UserError, match=r"^compare: nothing to compare: every run FAILED or was KILLED \(") as exc:
        collect(s.uri, [sid])
    assert "\n" not in str(exc.value)


def test_a_trial_an_alarm_stopped_is_kept_over_a_newer_failed_attempt(tmp_path):
    """A resume ran seed 0 again after the alarm and it crashed: the alarm's stop is the result."""
    from stapoctl.analysis.collect import collect

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        s = Store(tmp_path)
        sid = s.sweep("baselines", "loss")
        stopped = trial(s, sid, "grpo", 0, 0.30, "KILLED", [(ALARM, "7"), (keys.ALARM_STOPPED, "entropy_collapse")])
        crashed = trial(s, sid, "grpo", 0, 0.70, "FAILED")
        trial(s, sid, "grpo", 1, 0.50)
    finally:
        os.chdir(cwd)
    comp = collect(s.uri, [sid])
    assert sorted(t.id for t in comp.groups["grpo"] if t.seed == "0") == [stopped]
    assert comp.lost == {}  # the failed attempt was a duplicate, not a lost seed
    dup, alarm = comp.notes
    assert f"dropped run {comp.short[crashed]} (FAILED" in dup and "kept the run an alarm stopped (a result)" in dup
    assert alarm.startswith("compare: counted 1 trial(s) stopped by a run-health alarm")


def test_a_finished_trial_that_raised_an_alarm_counts_and_is_shown(tmp_path):
    """trainer.alarm_action=warn: the run went on and FINISHED; compare counts it (not as stopped),
    names it in a note and its table row, and `stapoctl runs` lists the alarm with its step."""
    import io

    from rich.console import Console

    from stapoctl.analysis.collect import collect
    from stapoctl.analysis.tables import markdown
    from stapoctl.tracking.runs import list_runs

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        s = Store(tmp_path)
        sid = s.sweep("baselines", "loss")
        warned = trial(s, sid, "grpo", 0, 0.40, "FINISHED", [(ALARM, "23")])
        trial(s, sid, "grpo", 1, 0.50)
    finally:
        os.chdir(cwd)
    comp = collect(s.uri, [sid])
    assert sorted(t.id for t in comp.groups["grpo"]) == sorted(t.id for t in comp.trials) and len(comp.trials) == 2
    assert [t.alarms for t in comp.trials] == [[], []]  # not "stopped by an alarm"
    (note,) = comp.notes
    assert note == (f"compare: 1 finished trial(s) raised a run-health alarm and went on: "
                    f"{comp.short[warned]} (loss=grpo seed 0, alarm entropy_collapse)")
    assert "finished (alarm: entropy_collapse)" in markdown(comp)
    out = io.StringIO()
    list_runs(s.uri, "stapoctl", Console(file=out, width=80))
    text = out.getvalue()
    assert "done !" in text and f"! {comp.short[warned]} alarm: entropy_collapse@23" in text
