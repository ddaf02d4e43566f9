"""The token grid (`stapoctl sweep token_grid`, sweeps/token_grid.yaml; analysis/grid_figures.py): the
file expands to 9 rows × 6 seeds whose trials compose to DAPO with one of 000 Table 1's cells masked
(the same bands `loss.shadow=[table1]` measures), and `compare` on a synthetic store gives the verdicts
against the base row, the Δaccuracy heatmap and the gradient-share figure, logged to the sweep."""

from __future__ import annotations

import json
import os

import pytest
from mlflow.entities import Metric, Param
from omegaconf import OmegaConf
from test_compare_merge import BENCH_METRIC, STEPS, Store

from stapoctl.config.shadow_rules import CELLS, SPURIOUS_CELL, cell_rules
from stapoctl.config.token_rules import parse_rules
from stapoctl.sweep.definition import load_definition
from stapoctl.sweep.plan import check_plan, compose_trial, plan_trials
from stapoctl.tracking import keys

NAMES = [c[0] for c in CELLS]


def test_the_grid_expands_to_nine_rows_of_six_seeds_each_masking_one_cell():
    d = load_definition("token_grid")
    assert d.key == "loss.token_rules" and d.values == ("base", *NAMES) and d.seeds == (0, 1, 2, 3, 4, 5)
    trials = plan_trials(d, "s")
    assert len(trials) == 54 and trials[0].run_name == "token_rules=base-seed0"
    check_plan(d)  # every value composes and passes the trainer's checks
    expected = dict(zip(NAMES, cell_rules(2e-3, 0.2)))
    for t in trials[::6]:
        conf = compose_trial(t)
        assert conf.loss.name == "dapo" and list(conf.loss.shadow) == ["table1"]
        rules = parse_rules(OmegaConf.to_container(conf.loss.token_rules))
        assert rules == (() if t.value == "base" else (expected[t.value],))


def test_a_cell_trial_masks_exactly_the_tokens_its_shadow_measures():
    from stapoctl.losses import compute_policy_loss
    from test_losses_rules import random_batch

    trial = next(t for t in plan_trials(load_definition("token_grid"), "s") if t.value == SPURIOUS_CELL)
    loss_cfg = dict(OmegaConf.to_container(compose_trial(trial).loss, resolve=True))
    _, m = compute_policy_loss("dapo", **random_batch(3), **{**loss_cfg, "tau_p": 2e-3})
    assert m[f"rules/{SPURIOUS_CELL}/token_ratio"] == m[f"shadow/{SPURIOUS_CELL}/token_share"] > 0
    assert m["loss/active_token_ratio"] == pytest.approx(1 - m[f"shadow/{SPURIOUS_CELL}/token_share"])


ACC = {"base": 0.30, SPURIOUS_CELL: 0.36, "neg_highp_lowh": 0.20}  # other cells: base + 0.01


def _trial(s: Store, sweep: str, value: str, seed: int) -> str:
    run = s.client.create_run(s.exp, run_name=f"{value}-seed{seed}", start_time=s.tick(),
                              tags={keys.PARENT: sweep, keys.KIND: keys.KIND_TRAIN, keys.SWEEP_ID: sweep,
                                    keys.SWEEP_VALUE: value, keys.SEED: str(seed)})
    rid = run.info.run_id
    acc = ACC.get(value, 0.31) + 0.002 * seed
    metrics = [Metric(BENCH_METRIC, acc, s.clock, STEPS)]
    for step in range(1, 4):  # the spurious cell: 2% of the tokens, 10 → 30% of the gradient
        for name in NAMES:
            grad, tokens = ((0.1 * step, 0.02) if name == SPURIOUS_CELL else ((1 - 0.1 * step) / 7, 0.98 / 7))
            metrics += [Metric(f"shadow/{name}/grad_share", grad, s.clock, step),
                        Metric(f"shadow/{name}/token_share", tokens, s.clock, step)]
    s.client.log_batch(rid, params=[Param("trainer.seed", str(seed))], metrics=metrics)
    s.client.set_terminated(rid, "FINISHED", end_time=s.tick())
    return rid


@pytest.fixture(scope="module")
def grid_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid_store")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        s = Store(root)
        sid = s.sweep("token_grid", "loss.token_rules")
        for value in ("base", *NAMES):
            for seed in range(3):
                _trial(s, sid, value, seed)
    finally:
        os.chdir(cwd)
    return {"uri": s.uri, "sweep": sid, "root": root, "client": s.client}


def test_deltas_per_cell_by_hand(grid_store):
    from stapoctl.analysis import grid_figures
    from stapoctl.analysis.collect import collect

    comp = collect(grid_store["uri"], [grid_store["sweep"]])
    assert grid_figures.is_grid(comp) and grid_figures.base_row(comp) == "base"
    (col, by_cell), = grid_figures.deltas(comp).items()
    assert by_cell[SPURIOUS_CELL] == pytest.approx(6.0) and by_cell["neg_highp_lowh"] == pytest.approx(-10.0)
    assert by_cell["pos_highp_highh"] == pytest.approx(1.0)


def test_compare_gives_verdicts_and_logs_the_grid_figures_to_the_sweep(grid_store, tmp_path):
    from rich.console import Console

    from stapoctl.analysis.compare import compare

    console = Console(width=200, record=True)
    written = compare(grid_store["uri"], [grid_store["sweep"]], console, out=str(tmp_path / "out"))
    for name in ("token_grid_delta.png", "token_grid_grad_share.png"):
        assert written[name].stat().st_size > 20_000, name
    table = written["table.md"].read_text()
    assert "base" in table and all(name in table for name in NAMES)
    stats = [r for r in json.loads(written["table.json"].read_text())["rows"] if r.get("baseline")]
    assert {r["group"] for r in stats} == {"base", *NAMES} and all(r["baseline"] == "base" for r in stats)
    verdicts = {r["group"]: r["verdict"] for r in stats}
    assert verdicts["base"] == "baseline" and verdicts[SPURIOUS_CELL] == "too few seeds"  # 3 seeds: p floor 0.8
    logged = {a.path for a in grid_store["client"].list_artifacts(grid_store["sweep"], keys.COMPARE_DIR)}
    assert {f"{keys.COMPARE_DIR}/token_grid_delta.png", f"{keys.COMPARE_DIR}/token_grid_grad_share.png"} <= logged


def test_other_sweeps_get_no_grid_figures(grid_store, tmp_path):
    """Rows that are no cell of the grid (methods, values) draw neither grid figure."""
    from stapoctl.analysis import grid_figures
    from stapoctl.analysis.collect import collect

    comp = collect(grid_store["uri"], [grid_store["sweep"]])
    comp.groups = {("grpo" if g == "base" else f"m{i}"): ts for i, (g, ts) in enumerate(comp.groups.items())}
    assert not grid_figures.is_grid(comp)
    assert grid_figures.delta_heatmap(comp, tmp_path / "d.png") is None
