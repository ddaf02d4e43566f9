"""Pilot → confirm (issue #33 item 3): `stapoctl sweep NAME confirm=PILOT [max_seeds=N] [delta=D]`
sizes each row's seeds from the pilot's spread for 80% power at α/m, runs fresh seeds (never
the pilot's), prints the sizing on --dry-run, refuses in one line past max_seeds, tags the sweep
confirmatory; `compare` tests it on its own seeds, the pilot's estimate beside it.

The pilot is a real sweep parent (`store.open_parent`, with its recorded sweep.yaml) whose
trials are logged by hand, no training:
- grpo  0.50, 0.52, 0.54 (mean 0.52, sd 0.02)
- wapo  0.52, 0.54, 0.56: diff +0.02, pooled sd 0.02, d = 1
- stapo 0.60, 0.62, 0.64: diff +0.10, d = 5
and one extra grpo trial on seed 5 (FAILED), so the pilot used seeds {0, 1, 2, 5}.

By hand (two-sided unpaired t-test, noncentral t, 80% power, Cohen's table for d = 1 at α 0.05:
17 per group): wapo alone (m = 1) needs 17; with stapo too (m = 2, α = 0.025) 21 (power at 20 is
0.793, at 21 0.815); stapo at d = 5 needs 3 by the t-test but the permutation test needs
2/C(2n, n) < α/m: n = 4 (2/70 = 0.029) at m = 1, n = 5 (2/252 = 0.0079) at m = 2 (0.029 ≥ 0.025).
delta=4 points with sd 2 points: d = 2, 6 seeds (power 0.791 at 5, 0.876 at 6).
"""

from __future__ import annotations

import json
import math
import os

import pytest
from mlflow.entities import Metric, Param, RunTag
from test_compare_merge import BENCH_METRIC, STEPS

from stapoctl.errors import UserError
from stapoctl.tracking import keys

PILOT = {"grpo": [0.50, 0.52, 0.54], "wapo": [0.52, 0.54, 0.56], "stapo": [0.60, 0.62, 0.64]}


def test_the_hand_numbers_of_the_docstring():
    """The project's own power function against the docstring's numbers (Cohen's table: d = 1 at
    α 0.05 needs 17 per group; a paired test of d = 1 needs 10 pairs, G*Power's 0.803)."""
    from stapoctl.analysis.statistics import power

    assert power(16, 1.0, alpha=0.05) < 0.8 <= power(17, 1.0, alpha=0.05)
    assert power(20, 1.0, alpha=0.025) == pytest.approx(0.793, abs=1e-3)
    assert power(21, 1.0, alpha=0.025) == pytest.approx(0.815, abs=1e-3)
    assert power(2, 5.0, alpha=0.05) < 0.8 <= power(3, 5.0, alpha=0.05)
    assert power(5, 2.0, alpha=0.05) == pytest.approx(0.791, abs=1e-3)
    assert power(6, 2.0, alpha=0.05) == pytest.approx(0.876, abs=1e-3)
    assert power(9, 1.0, paired_test=True) < 0.8 < power(10, 1.0, paired_test=True) == pytest.approx(0.803, abs=1e-3)
    assert 2 / math.comb(6, 3) >= 0.05 > 2 / math.comb(8, 4) >= 0.025 > 2 / math.comb(10, 5)


def test_sizing_by_hand():
    from stapoctl.analysis.confirm import size
    from stapoctl.analysis.statistics import Sample

    samples = [Sample(g, v) for g, v in PILOT.items()]
    one = size(samples[:2], "grpo", "avg", 100.0, max_seeds=30)
    (wapo,) = one.rows
    assert (one.m, one.alpha, one.floor_seeds) == (1, 0.05, 4)
    assert wapo.diff == pytest.approx(0.02) and wapo.sd == pytest.approx(0.02) and wapo.needed == 17
    assert one.seeds == 17 and one.refusal() is None
    two = size(samples, "grpo", "avg", 100.0, max_seeds=30)
    assert (two.m, two.alpha, two.floor_seeds) == (2, 0.025, 5)
    assert [(r.group, r.needed) for r in two.rows] == [("wapo", 21), ("stapo", 5)]
    assert two.seeds == 21
    stapo_alone = size([samples[0], samples[2]], "grpo", "avg", 100.0, max_seeds=30)
    assert stapo_alone.rows[0].needed == 4  # the t-test's 3 is below what the permutation test can reach
    powered = size(samples[:2], "grpo", "avg", 100.0, max_seeds=30, delta=4.0)
    assert powered.rows[0].delta == pytest.approx(0.04) and powered.rows[0].needed == 6


def test_rows_that_cannot_be_sized_say_why():
    from stapoctl.analysis.confirm import size
    from stapoctl.analysis.statistics import Sample

    same = size([Sample("grpo", [0.5, 0.6]), Sample("wapo", [0.5, 0.6])], "grpo", "avg", 100.0, max_seeds=10)
    assert same.rows[0].needed is None and "pilot difference is 0" in same.rows[0].why
    one_seed = size([Sample("grpo", [0.5]), Sample("wapo", [0.6])], "grpo", "avg", 100.0, max_seeds=10)
    assert one_seed.rows[0].needed is None and "no spread" in one_seed.rows[0].why
    assert one_seed.refusal().startswith("confirm: 80% power at α = 0.05/1 needs more than max_seeds=10: wapo (")


def test_fresh_seeds_skip_every_used_one():
    from stapoctl.analysis.confirm import fresh_seeds

    assert fresh_seeds({0, 1, 2, 5}, 6) == (3, 4, 6, 7, 8, 9)
    assert fresh_seeds(set(), 2) == (0, 1)


# -- on a store --------------------------------------------------------------------------------------
def _trial(client, exp: str, sweep: str, value: str, seed: int, acc: float, status: str = "FINISHED") -> str:
    run = client.create_run(exp, run_name=f"{value}-seed{seed}",
                            tags={keys.PARENT: sweep, keys.KIND: keys.KIND_TRAIN, keys.SWEEP_ID: sweep,
                                  keys.SWEEP_VALUE: value, keys.SEED: str(seed)})
    client.log_batch(run.info.run_id, params=[Param("trainer.seed", str(seed))],
                     metrics=[Metric(BENCH_METRIC, acc, 0, STEPS)])
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


@pytest.fixture(scope="module")
def pilot(tmp_path_factory):
    import mlflow

    from stapoctl.sweep import store
    from stapoctl.sweep.definition import SweepDefinition

    root = tmp_path_factory.mktemp("confirm_store")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        uri = f"sqlite:///{root / 'mlflow.db'}"
        definition = SweepDefinition(name="baselines", key="loss", values=("grpo", "wapo", "stapo"), seeds=(0, 1, 2))
        sid = store.open_parent(definition, uri, "stapoctl")
        client = mlflow.MlflowClient(uri)
        exp = client.get_run(sid).info.experiment_id
        for value, accs in PILOT.items():
            for seed, acc in enumerate(accs):
                _trial(client, exp, sid, value, seed, acc)
        _trial(client, exp, sid, "grpo", 5, 0.99, status="FAILED")
        store.end_parent(sid, uri, "FINISHED")
    finally:
        os.chdir(cwd)
    return {"uri": uri, "sweep": sid, "client": client, "exp": exp, "root": root}


def _sweep(args, console, dry_run=False):
    from stapoctl.sweep.runner import sweep_command

    return sweep_command("baselines", args, console, dry_run=dry_run)


def test_dry_run_prints_the_sizing_and_fresh_seeds(pilot):
    from rich.console import Console

    console = Console(width=250, record=True)
    args = ["values=[grpo,wapo]", f"confirm={pilot['sweep'][:8]}", "delta=4", f"tracking.uri={pilot['uri']}"]
    assert _sweep(args, console, dry_run=True) == 0
    text = console.export_text()
    assert f"confirm: sized from pilot {pilot['sweep'][:8]} on toy/train against grpo (3 pilot seeds)" in text
    (cells,) = [c for c in (ln.replace("│", " ").split() for ln in text.splitlines()) if c[:1] == ["wapo"]]
    assert cells == ["wapo", "3", "+2.00", "2.00", "4.00", "6"]  # pilot n, diff, sd, powered for (points), seeds
    assert "[3, 4, 6, 7, 8, 9]" in text and "(the pilot's: [0, 1, 2, 5])" in text
    assert "12 trials of experiment tiny" in text and "wapo-seed9" in text and "wapo-seed5" not in text


def test_more_than_max_seeds_is_refused_in_one_line(pilot):
    from rich.console import Console

    with pytest.raises(UserError) as err:
        _sweep(["values=[grpo,wapo]", f"confirm={pilot['sweep']}", "max_seeds=12", f"tracking.uri={pilot['uri']}"],
               Console(record=True))
    assert str(err.value) == (
        "confirm: 80% power at α = 0.05/1 needs more than max_seeds=12: wapo needs 17 seeds (pilot diff +2.00, "
        "sd 2.00): raise max_seeds, drop the row from values=[…], or power for a larger difference with delta=D (points)")


@pytest.mark.parametrize("args, message", [
    (["seeds=[7,8]"], "seeds= and confirm= together"),
    (["resume=abc"], "confirm= and resume= together"),
    (["values=[grpo,dapo_full]"], "the pilot has no value dapo_full (its values: grpo, wapo, stapo)"),
    (["values=[grpo]"], "give two values or more"),
    (["trainer.total_steps=5"], "trainer.total_steps=5 differs from nothing in the pilot"),
    (["delta=-1"], "delta=-1: give the difference to power for"),
    (["max_seeds=1"], "max_seeds=1: a row needs at least 2 seeds"),
])
def test_bad_confirm_input_is_one_line(pilot, args, message):
    from rich.console import Console

    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        _sweep([f"confirm={pilot['sweep'][:8]}", *args, f"tracking.uri={pilot['uri']}"], Console(), dry_run=True)
    with pytest.raises(UserError, match="max_seeds= sizes a confirmatory sweep"):
        _sweep(["max_seeds=4"], Console(), dry_run=True)


def test_the_confirmatory_sweep_is_tagged_and_never_reuses_seeds(pilot, monkeypatch):
    """A real start (the trials stubbed out): the parent carries the role, the pilot and the
    sizing; a second confirmation of the same pilot skips this one's seeds too."""
    from rich.console import Console

    from stapoctl.sweep import runner
    from stapoctl.sweep.confirm import design
    from stapoctl.sweep.definition import parse_command

    ran = []
    monkeypatch.setattr(runner, "_run_trials", lambda definition, sweep_id, trials, *a: ran.append(
        (sweep_id, [(t.value, t.seed) for t in trials])) or 0)
    monkeypatch.chdir(pilot["root"])
    args = ["values=[grpo,wapo]", f"confirm={pilot['sweep'][:8]}", "delta=4", f"tracking.uri={pilot['uri']}"]
    assert _sweep(args, Console(record=True)) == 0
    (sweep_id, trials), = ran
    assert trials == [(v, s) for v in ("grpo", "wapo") for s in (3, 4, 6, 7, 8, 9)]
    run = pilot["client"].get_run(sweep_id)
    assert run.data.tags[keys.SWEEP_ROLE] == "confirmatory" and run.data.tags[keys.CONFIRMS] == pilot["sweep"]
    sizing = json.loads(open(pilot["client"].download_artifacts(sweep_id, keys.CONFIRM_SIZING, str(pilot["root"]))).read())
    assert sizing["seeds"] == [3, 4, 6, 7, 8, 9] and sizing["pilot_seeds"] == [0, 1, 2, 5]
    assert sizing["rows"][0]["needed"] == 6 and sizing["alpha"] == 0.05
    again = design(parse_command("baselines", args), pilot["uri"], "stapoctl")
    assert again.definition.seeds == (10, 11, 12, 13, 14, 15)


@pytest.fixture(scope="module")
def confirmed(pilot):
    """A confirmatory sweep of grpo and wapo on seeds 10–15: grpo 0.50 … 0.55, wapo 0.56 … 0.61,
    every wapo above every grpo: exact two-sided p = 2/C(12, 6) = 2/924; diff +0.06."""
    client, exp = pilot["client"], pilot["exp"]
    run = client.create_run(exp, run_name="sweep-baselines",
                            tags={keys.KIND: keys.KIND_SWEEP, keys.SWEEP_NAME: "baselines",
                                  keys.SWEEP_ROLE: keys.ROLE_CONFIRMATORY, keys.CONFIRMS: pilot["sweep"]})
    sid = run.info.run_id
    client.log_batch(sid, params=[Param(keys.SWEEP_KEY, "loss")], tags=[RunTag(keys.SWEEP_ID, sid)])
    for i, seed in enumerate(range(10, 16)):
        _trial(client, exp, sid, "grpo", seed, 0.50 + 0.01 * i)
        _trial(client, exp, sid, "wapo", seed, 0.56 + 0.01 * i)
    client.set_terminated(sid, "FINISHED")
    return sid


def test_compare_tests_the_confirmatory_seeds_and_shows_the_pilot_beside(pilot, confirmed, tmp_path):
    from rich.console import Console

    from stapoctl.analysis.compare import compare

    console = Console(width=250, record=True)
    compare(pilot["uri"], [confirmed], console, out=str(tmp_path / "c"))
    table = json.loads((tmp_path / "c" / "table.json").read_text())
    (wapo,) = [r for r in table["rows"] if r["table"] == "statistics" and r["group"] == "wapo"]
    assert wapo["n_seeds"] == 6 and wapo["diff"] == pytest.approx(0.06)
    assert wapo["p_value"] == pytest.approx(2 / 924) and wapo["p_holm"] == pytest.approx(2 / 924)
    assert wapo["verdict"] == "better"
    conf = table["confirmatory"]
    assert conf["pilot"] == pilot["sweep"] and conf["seeds"] == [str(s) for s in range(10, 16)]
    (pw,) = [r for r in conf["pilot_rows"] if r["group"] == "wapo"]
    # the pilot: 3 vs 3 seeds, diff +0.02; 5 of the 20 splits give wapo a sum ≥ its 1.62: p = 2·5/20
    assert pw["n_seeds"] == 3 and pw["diff"] == pytest.approx(0.02) and pw["p_holm"] == pytest.approx(0.5)
    text = console.export_text()
    assert f"Confirmatory on seeds 10, 11, 12, 13, 14, 15 (fresh), beside its pilot {pilot['sweep'][:8]}" in text
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("wapo") and "0.5" in ln.split()[-1]]
    assert line.split() == ["wapo", "6", "+6.00", *line.split()[3:5], "0.00216", "better", "3", "+2.00",
                            *line.split()[9:11], "0.5"]


def test_a_confirmatory_sweep_is_never_pooled_with_its_pilot(pilot, confirmed, tmp_path):
    from rich.console import Console

    from stapoctl.analysis.compare import compare

    with pytest.raises(UserError, match="is confirmatory: it is tested on its own seeds only; compare it alone"):
        compare(pilot["uri"], [confirmed, pilot["sweep"]], Console(), out=str(tmp_path / "x"))
