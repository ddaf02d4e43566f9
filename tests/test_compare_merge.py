"""`stapoctl compare SWEEP_A SWEEP_B`: sweeps of one key merge by swept value, on a real MLflow
sqlite store built here without training (parents and nested trials laid out as
`stapoctl.tracking.keys` documents, start and end times set by hand).

`ablation` runs grpo and stapo on seeds 0–2; `baselines` later runs grpo, stapo and dapo on
seeds 0, 3, 4. The (value, seed) pairs both have count once: grpo seed 0 keeps the newer
FINISHED run (baselines'), stapo seed 0 keeps ablation's FINISHED run over baselines' newer
FAILED one; each dropped run gets a one-line note. A trial's earlier failed attempt inside one
sweep is left out the same way; `2e-3` and `0.002` are one row; sweeps of different keys are
one clear error naming both keys.
"""

from __future__ import annotations

import json

import pytest
from mlflow.entities import Metric, Param, RunTag

from stapoctl.errors import UserError

BENCH_METRIC = "val/toy/train/avg_at_4"
STEPS = 10
T0 = 1_700_000_000_000  # ms; each run starts a minute after the one before


class Store:
    def __init__(self, root):
        import mlflow

        from stapoctl.tracking import mlflow_run

        self.uri = f"sqlite:///{root / 'mlflow.db'}"
        mlflow_run.setup(self.uri, "stapoctl")
        self.client = mlflow.MlflowClient(self.uri)
        self.exp = self.client.get_experiment_by_name("stapoctl").experiment_id
        self.clock = T0

    def tick(self) -> int:
        self.clock += 60_000
        return self.clock

    def sweep(self, name: str, key: str) -> str:
        from stapoctl.tracking import keys

        run = self.client.create_run(self.exp, run_name=f"sweep-{name}", start_time=self.tick(),
                                     tags={keys.KIND: keys.KIND_SWEEP, keys.SWEEP_NAME: name})
        self.client.log_batch(run.info.run_id, params=[Param(keys.SWEEP_KEY, key)],
                              tags=[RunTag(keys.SWEEP_ID, run.info.run_id)])
        return run.info.run_id

    def trial(self, sweep_id: str, value: str, seed: int, acc: float, status: str = "FINISHED") -> str:
        from stapoctl.tracking import keys

        run = self.client.create_run(
            self.exp, run_name=f"{value}-seed{seed}", start_time=self.tick(),
            tags={keys.PARENT: sweep_id, keys.KIND: keys.KIND_TRAIN, keys.SWEEP_ID: sweep_id,
                  keys.SWEEP_VALUE: value, keys.SEED: str(seed)})
        rid = run.info.run_id
        self.client.log_batch(rid, params=[Param("trainer.seed", str(seed))],
                              metrics=[Metric(BENCH_METRIC, acc, self.clock, STEPS)])
        self.client.set_terminated(rid, status, end_time=self.tick())
        return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    import os

    root = tmp_path_factory.mktemp("merge_store")
    cwd = os.getcwd()
    os.chdir(root)  # nothing may land in the caller's cwd
    try:
        s = Store(root)
        ids: dict = {}
        ablation = s.sweep("ablation", "loss")
        for value, base in (("grpo", 0.30), ("stapo", 0.50)):
            for seed in (0, 1, 2):
                ids[("ablation", value, seed)] = s.trial(ablation, value, seed, base + 0.01 * seed)
        baselines = s.sweep("baselines", "loss")
        ids[("baselines", "grpo", 0)] = s.trial(baselines, "grpo", 0, 0.40)  # newer, FINISHED: replaces
        ids[("baselines", "stapo", 0)] = s.trial(baselines, "stapo", 0, 0.90, status="FAILED")  # newer, FAILED
        for seed in (3, 4):
            ids[("baselines", "grpo", seed)] = s.trial(baselines, "grpo", seed, 0.30 + 0.01 * seed)
            ids[("baselines", "stapo", seed)] = s.trial(baselines, "stapo", seed, 0.50 + 0.01 * seed)
        ids[("baselines", "dapo", 0)] = s.trial(baselines, "dapo", 0, 0.45)
        tau_a, tau_b = s.sweep("tau_p", "loss.tau_p"), s.sweep("tau_p", "loss.tau_p")
        ids[("tau_a", "2e-3", 0, "failed")] = s.trial(tau_a, "2e-3", 0, 0.10, status="FAILED")  # earlier attempt
        ids[("tau_a", "2e-3", 0)] = s.trial(tau_a, "2e-3", 0, 0.60)
        ids[("tau_a", "2e-2", 0)] = s.trial(tau_a, "2e-2", 0, 0.55)
        ids[("tau_b", "0.002", 1)] = s.trial(tau_b, "0.002", 1, 0.62)
    finally:
        os.chdir(cwd)
    return {"uri": s.uri, "ids": ids, "ablation": ablation, "baselines": baselines, "tau_a": tau_a,
            "tau_b": tau_b, "root": root}


def seeds_of(comp, group: str) -> dict[str, str]:
    return {t.seed: t.id for t in comp.groups[group]}


def test_two_sweeps_of_one_key_merge_by_value_and_each_value_seed_counts_once(store):
    from stapoctl.analysis.cells import accuracy_cells
    from stapoctl.analysis.collect import collect

    ids = store["ids"]
    comp = collect(store["uri"], [store["ablation"], store["baselines"]])
    assert comp.key == "loss" and list(comp.groups) == ["grpo", "stapo", "dapo"]
    grpo, stapo = seeds_of(comp, "grpo"), seeds_of(comp, "stapo")
    assert sorted(grpo) == sorted(stapo) == ["0", "1", "2", "3", "4"]
    assert grpo["0"] == ids[("baselines", "grpo", 0)]  # the newer FINISHED run
    assert stapo["0"] == ids[("ablation", "stapo", 0)]  # a newer FAILED run does not replace a FINISHED one
    cells = accuracy_cells(comp)
    grpo_cell = next(iter(cells["grpo"].values()))
    assert grpo_cell.n == 5 and grpo_cell.mean == pytest.approx((0.40 + 0.31 + 0.32 + 0.33 + 0.34) / 5)
    assert len(comp.notes) == 2 and all("\n" not in n for n in comp.notes)
    short = comp.short
    grpo_note, stapo_note = comp.notes
    assert grpo_note == (f"compare: loss=grpo seed 0 appears twice: dropped run {short[ids[('ablation', 'grpo', 0)]]} "
                         f"(FINISHED, sweep {short[store['ablation']]}), kept the newer finished run "
                         f"{short[ids[('baselines', 'grpo', 0)]]} (FINISHED, sweep {short[store['baselines']]})")
    assert stapo_note.startswith(f"compare: loss=stapo seed 0 appears twice: dropped run "
                                 f"{short[ids[('baselines', 'stapo', 0)]]} (FAILED, sweep {short[store['baselines']]})")
    assert {s.info.run_id for s in comp.sweeps} == {store["ablation"], store["baselines"]}
    # the order the sweeps are given in does not change what counts
    again = collect(store["uri"], [store["baselines"], store["ablation"]])
    assert seeds_of(again, "grpo") == grpo and seeds_of(again, "stapo") == stapo


def test_an_earlier_attempt_counts_once_and_equal_numbers_are_one_row(store):
    from stapoctl.analysis.collect import collect

    ids = store["ids"]
    comp = collect(store["uri"], [store["tau_a"], store["tau_b"]])
    assert comp.key == "loss.tau_p" and comp.numeric and list(comp.groups) == ["2e-3", "2e-2"]
    assert seeds_of(comp, "2e-3") == {"0": ids[("tau_a", "2e-3", 0)], "1": ids[("tau_b", "0.002", 1)]}
    (note,) = comp.notes
    assert f"dropped run {comp.short[ids[('tau_a', '2e-3', 0, 'failed')]]} (FAILED" in note


def test_sweeps_of_different_keys_are_one_line_naming_both_keys(store):
    from stapoctl.analysis.collect import collect

    with pytest.raises(UserError) as exc:
        collect(store["uri"], [store["ablation"], store["tau_a"]])
    text = str(exc.value)
    assert "\n" not in text
    assert "varies loss and sweep" in text and "varies loss.tau_p" in text
    assert text.startswith(f"compare: sweep {store['ablation'][:7]}")


def test_the_command_prints_the_note_and_the_merged_table(store, tmp_path):
    from rich.console import Console

    from stapoctl.analysis.compare import compare

    console = Console(width=250, record=True)
    out = tmp_path / "merged"
    compare(store["uri"], [store["ablation"][:8], store["baselines"][:8]], console, out=str(out))
    text = console.export_text()
    assert "compare: loss=grpo seed 0 appears twice: dropped run" in text
    data = json.loads((out / "table.json").read_text())
    assert len(data["notes"]) == 2 and sorted(data["sweeps"]) == sorted([store["ablation"], store["baselines"]])
    assert sorted(r["run_id"] for r in data["runs"] if r["group"] == "grpo") == sorted(
        [store["ids"][("baselines", "grpo", 0)]] + [store["ids"][("ablation", "grpo", s)] for s in (1, 2)]
        + [store["ids"][("baselines", "grpo", s)] for s in (3, 4)])
    assert "(5)" in text  # grpo and stapo cells: five seeds each


def test_a_sweep_under_way_compares_its_finished_trials_only(tmp_path):
    import os

    from stapoctl.analysis.collect import collect

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        s = Store(tmp_path)
        sweep = s.sweep("baselines", "loss")
        for seed in (0, 1, 2):
            s.trial(sweep, "grpo", seed, 0.60)
        running = s.trial(sweep, "tr_grpo", 0, 0.20, status="RUNNING")  # only its step-0 validation so far
    finally:
        os.chdir(cwd)
    comp = collect(s.uri, [sweep])
    assert list(comp.groups) == ["grpo"]
    (note,) = comp.notes
    assert note == f"compare: left out 1 trial(s) still RUNNING ({comp.short[running]})"


def test_rows_keeps_the_family_a_question_is_about(store, tmp_path):
    from rich.console import Console

    from stapoctl.analysis.compare import compare

    console = Console(width=250, record=True)
    compare(store["uri"], [store["ablation"], store["baselines"]], console, out=str(tmp_path / "two"),
            rows=["stapo", "grpo"])
    data = json.loads((tmp_path / "two" / "table.json").read_text())
    assert {r["group"] for r in data["runs"]} == {"stapo", "grpo"}
    assert data["statistics"]["baseline"] == "grpo"
    with pytest.raises(UserError, match="compare --rows: no row nope"):
        compare(store["uri"], [store["ablation"]], console, out=str(tmp_path / "x"), rows=["nope"])
