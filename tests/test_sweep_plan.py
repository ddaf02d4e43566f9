"""Sweep definitions, command line and planning: no engines (compose only), seconds.

What the local runner and the SLURM array submitter share: the sweep files load, the command
line replaces values/seeds and passes the rest to every trial, a typo names the key, and each
trial's overrides compose to the config it is meant to be.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from stapoctl.errors import UserError
from stapoctl.losses import LOSSES
from stapoctl.sweep import layout
from stapoctl.sweep.definition import SweepDefinition, available_sweeps, load_definition, parse_command
from stapoctl.sweep.plan import check_plan, compose_trial, plan_trials


def test_the_issue_sweeps_are_defined():
    assert {"tau_p", "tau_h", "ablation", "baselines"} <= set(available_sweeps())
    tau_p, tau_h = load_definition("tau_p"), load_definition("tau_h")
    assert (tau_p.key, tau_p.values, tau_p.seeds, tau_p.experiment) == (
        "loss.tau_p", ("2e-3", "2e-2", "2e-1"), (0, 1, 2), "tiny")
    assert (tau_h.key, tau_h.values) == ("loss.tau_h", ("0.2", "0.4", "0.6", "0.8"))
    ablation, baselines = load_definition("ablation"), load_definition("baselines")
    assert ablation.key == baselines.key == "loss"
    assert ablation.values == ("grpo", "stapo_prob_only", "stapo_high_entropy", "stapo")
    assert baselines.values == ("grpo", "entropy20", "justrl", "stapo", "wapo", "tr_grpo", "ppl_shaping",
                                "position_shaping", "dapo_full")
    for value in ablation.values + baselines.values[:-1]:
        assert value in LOSSES, value
    # DAPO's full recipe: a label whose own overrides pick the loss
    assert baselines.overrides_of("dapo_full") == ("loss=dapo", "trainer.dynamic_sampling=true",
                                                   "reward.overlong_buffer=16")


def test_command_line_replaces_lists_and_passes_the_rest_to_every_trial():
    cmd = parse_command("tau_p", ["values=[2e-3, 2e-1]", "seeds=[4]", "experiment=stapo_qwen3_1.7b",
                                  "trainer.total_steps=200", "resume=ab12"])
    d = cmd.definition
    assert d.values == ("2e-3", "2e-1") and d.seeds == (4,) and d.experiment == "stapo_qwen3_1.7b"
    assert d.overrides == ("trainer.total_steps=200",) and cmd.cli_overrides == ("trainer.total_steps=200",)
    assert cmd.resume == "ab12" and cmd.given == {"values", "seeds", "experiment", "overrides"}
    # comma lists without brackets work too, and values stay as written
    assert parse_command("tau_h", ["values=0.20,0.8"]).definition.values == ("0.20", "0.8")


@pytest.mark.parametrize("args, message", [
    (["valuse=[1]"], "unknown sweep option 'valuse'; did you mean 'values'?"),
    (["loss.tau_p=0.1"], "loss.tau_p is the key sweep 'tau_p' varies"),
    (["trainer.seed=3"], "trainer.seed is set by the sweep for each trial; use seeds=[…] instead"),
    (["tracking.tags={a:b}"], "use +tracking.tags.NAME=VALUE to add a tag"),
    (["seeds=[a]"], "seeds: expected integers"),
    (["values=[1,1]"], "'1' appears twice"),
    (["tracking.parent_run_id=x"], "tracking.parent_run_id is set by the sweep"),
    (["force=maybe"], "force=maybe: use true or false"),
    (["trainer.total_steps"], "has no '='"),
])
def test_bad_command_lines_get_one_line_errors(args, message):
    with pytest.raises(UserError) as err:
        parse_command("tau_p", args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_sweep_and_bad_files(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="no sweep 'tau_q'.*did you mean 'tau_p'"):
        load_definition("tau_q")
    monkeypatch.setenv("STAPOCTL_SWEEPS", str(tmp_path))
    (tmp_path / "a.yaml").write_text("key: loss.tau_p\nvalus: [1]\n")
    with pytest.raises(UserError, match="unknown field 'valus'; did you mean 'values'"):
        load_definition("a")
    (tmp_path / "b.yaml").write_text("values: [1]\n")
    with pytest.raises(UserError, match="'key' must name the swept Hydra key"):
        load_definition("b")
    (tmp_path / "c.yaml").write_text("key: loss.tau_h\nvalues: [2.0e-1, 4e-1]\n")
    c = load_definition("c")
    assert c.values == ("2.0e-1", "4e-1") and c.seeds == (0, 1, 2) and c.experiment == "tiny"


def test_definition_round_trips_through_its_yaml():
    d = parse_command("baselines", ["seeds=[0,1]", "trainer.total_steps=5", "+tracking.tags.team=rl"]).definition
    assert SweepDefinition.from_yaml(d.to_yaml(), d.name, "x") == d


def test_trials_carry_value_seed_nesting_and_tags():
    d = parse_command("tau_p", ["values=[2e-3,2e-2]", "seeds=[0,1]", "trainer.total_steps=3"]).definition
    trials = plan_trials(d, "f" * 32)
    assert [(t.index, t.value, t.seed) for t in trials] == [(0, "2e-3", 0), (1, "2e-3", 1), (2, "2e-2", 0),
                                                           (3, "2e-2", 1)]
    assert [t.run_name for t in trials] == ["tau_p=2e-3-seed0", "tau_p=2e-3-seed1", "tau_p=2e-2-seed0",
                                            "tau_p=2e-2-seed1"]
    conf = compose_trial(trials[3])
    assert conf.loss.tau_p == pytest.approx(0.02) and conf.trainer.seed == 1 and conf.trainer.total_steps == 3
    assert conf.tracking.parent_run_id == "f" * 32 and conf.tracking.run_name == "tau_p=2e-2-seed1"
    assert dict(conf.tracking.tags) == {layout.SWEEP_ID: "f" * 32, layout.SWEEP_NAME: "tau_p",
                                        layout.SWEEP_VALUE: "2e-2", layout.SEED: "1", layout.TRIAL: "3"}
    method = plan_trials(parse_command("ablation", ["seeds=[2]"]).definition, "s")
    assert method[1].run_name == "stapo_prob_only-seed2"
    assert compose_trial(method[1]).loss.name == "stapo_prob_only"


def test_check_plan_names_a_typo_before_anything_starts():
    with pytest.raises(UserError, match=r"^unknown config key 'loss.tau_q'; did you mean 'loss.tau_p'\?$"):
        check_plan(SweepDefinition(name="x", key="loss.tau_q", values=("1e-3",)))
    with pytest.raises(UserError, match="unknown option 'loss=grpoo': did you mean 'loss=grpo'"):
        check_plan(SweepDefinition(name="x", key="loss", values=("grpo", "grpoo")))
    with pytest.raises(UserError, match="eval.every_n_steps=0: a sweep's trials must validate"):
        check_plan(SweepDefinition(name="x", key="loss.tau_p", values=("1e-3",), overrides=("eval.every_n_steps=0",)))
    with pytest.raises(UserError, match="learner.ppo_mini_batch_size"):  # the trainer's own cross-field checks
        check_plan(SweepDefinition(name="x", key="learner.ppo_mini_batch_size", values=("3",)))


def test_dry_run_prints_the_trials(capsys):
    from rich.console import Console

    from stapoctl.sweep.runner import sweep_command

    console = Console(width=200, record=True)
    assert sweep_command("tau_h", ["values=[0.2,0.8]", "seeds=[0]"], console, dry_run=True) == 0
    text = console.export_text()
    assert "2 trials of experiment tiny" in text and "tau_h=0.8-seed0" in text and "loss.tau_h=0.8" in text


def test_the_command_line_reports_a_typo_in_one_line():
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "200"}
    res = subprocess.run([sys.executable, "-m", "stapoctl.cli", "sweep", "tau_p", "--dry-run", "loss.tau_q=1e-3"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == ["error: unknown config key 'loss.tau_q'; did you mean 'loss.tau_p'?"]
    res = subprocess.run([sys.executable, "-m", "stapoctl.cli", "sweep", "tau_p", "--dry-run", "cluster=slurm"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and "would go out as one SLURM job array (16 at once); nothing was submitted" in res.stdout


# -- per-value overrides: {value: NAME, set: [key=value, …]} ------------------------------------------
def test_a_value_carries_overrides_only_its_trials_get():
    d = load_definition("baselines")
    trials = {t.value: t for t in plan_trials(replace(d.with_values(("grpo", "dapo_full")), seeds=(0,)), "s")}
    full, grpo = trials["dapo_full"], trials["grpo"]
    assert full.run_name == "dapo_full-seed0" and full.tags[layout.SWEEP_VALUE] == "dapo_full"
    assert "loss=dapo_full" not in full.overrides  # the set names the swept key: the value is a label
    assert full.overrides[1:4] == ("loss=dapo", "trainer.dynamic_sampling=true", "reward.overlong_buffer=16")
    assert not any(o.startswith(("trainer.dynamic_sampling", "reward.")) for o in grpo.overrides)
    conf = compose_trial(full)
    assert conf.loss.name == "dapo" and conf.trainer.dynamic_sampling is True and conf.reward.overlong_buffer == 16
    plain = compose_trial(grpo)
    assert plain.loss.name == "grpo" and plain.trainer.dynamic_sampling is False and plain.reward.overlong_buffer == 0


def test_a_values_own_override_wins_over_the_sweeps(tmp_path, monkeypatch):
    monkeypatch.setenv("STAPOCTL_SWEEPS", str(tmp_path))
    (tmp_path / "v.yaml").write_text(
        "key: loss.tau_p\nseeds: [0]\noverrides: [reward.overlong_buffer=4, trainer.total_steps=5]\n"
        "values: [2e-3, {value: 2e-1, set: [reward.overlong_buffer=8]}]\n")
    d = parse_command("v", ["eval.every_n_steps=5"]).definition
    first, second = plan_trials(d, "s")
    assert first.overrides[1:5] == ("reward.overlong_buffer=4", "trainer.total_steps=5", "eval.every_n_steps=5",
                                    "loss.tau_p=2e-3")
    assert second.overrides[1:5] == ("trainer.total_steps=5", "eval.every_n_steps=5", "loss.tau_p=2e-1",
                                     "reward.overlong_buffer=8")
    assert compose_trial(second).reward.overlong_buffer == 8 and compose_trial(first).reward.overlong_buffer == 4
    # values=[…] on the command line: a value the file gives overrides keeps them, the others' are dropped
    assert parse_command("v", ["values=[2e-1]"]).definition.value_overrides == (("2e-1", ("reward.overlong_buffer=8",)),)
    assert parse_command("v", ["values=[2e-3]"]).definition.value_overrides == ()
    # the parent run's sweep.yaml reads back to the same definition
    assert SweepDefinition.from_yaml(d.to_yaml(), d.name, "x") == d


def test_dry_run_shows_a_values_own_overrides():
    from rich.console import Console

    from stapoctl.sweep.runner import sweep_command

    console = Console(width=400, record=True)
    assert sweep_command("baselines", ["values=[stapo,dapo_full]", "seeds=[0]"], console, dry_run=True) == 0
    text = console.export_text()
    assert "dapo_full-seed0" in text and "loss=dapo trainer.dynamic_sampling=true reward.overlong_buffer=16" in text


@pytest.mark.parametrize("values, message", [
    ("[{value: x, sett: [a.b=1]}]", "unknown field 'sett' in a value entry; did you mean 'set'?"),
    ("[{set: [loss=dapo]}]", "a value entry needs value: NAME"),
    ("[{value: x, set: [loss]}]", "the set of value 'x' must be a list of key=value Hydra overrides"),
    ("[{value: x, set: loss=dapo}]", "the set of value 'x' must be a list of key=value Hydra overrides"),
    ("[{value: x, set: [trainer.seed=3]}]", "value 'x' sets trainer.seed, which the sweep sets for every trial"),
    ("[{value: x, set: [experiment=tiny_dapo]}]", "value 'x' sets experiment"),
    ("[{value: x, set: [a.b=1, a.b=2]}]", "value 'x' sets a.b twice"),
    ("[grpo, {value: grpo, set: [loss=dapo]}]", "'grpo' appears twice"),
    ("[[grpo]]", "expected a flat list"),
])
def test_bad_value_entries_are_refused_in_one_line(values, message, tmp_path, monkeypatch):
    monkeypatch.setenv("STAPOCTL_SWEEPS", str(tmp_path))
    (tmp_path / "bad.yaml").write_text(f"key: loss\nvalues: {values}\n")
    with pytest.raises(UserError) as err:
        load_definition("bad")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_check_plan_names_a_typo_in_a_values_own_overrides():
    d = SweepDefinition(name="x", key="loss", values=("grpo", "full"),
                        value_overrides=(("full", ("loss=dapo", "reward.overlong_bufer=8")),))
    with pytest.raises(UserError, match=r"unknown config key 'reward.overlong_bufer'; did you mean 'reward.overlong_buffer'"):
        check_plan(d)
