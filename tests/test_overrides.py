"""Hydra overrides read by Hydra's own parser (`config/overrides.py`) in every caller: the key and
kind from Hydra, the value as typed; `~key` deletes where Hydra can; bad syntax is one line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stapoctl.config import overrides as ov
from stapoctl.config.compose import ConfigError, compose_config
from stapoctl.errors import UserError
from test_cli import resolved_yaml, run_cli

PACKAGE = Path(__file__).resolve().parents[1] / "stapoctl"


@pytest.mark.parametrize("text, key, kind, value", [
    ("loss.tau_p=2e-3", "loss.tau_p", ov.SET, "2e-3"),  # Hydra's value would be 0.002
    ("+tracking.tags.team=rl", "tracking.tags.team", ov.ADD, "rl"),
    ("++trainer.save_freq=3", "trainer.save_freq", ov.FORCE_ADD, "3"),
    ("~tracking.tags.team", "tracking.tags.team", ov.DELETE, ""),
    ("~tracking.tags.team=rl", "tracking.tags.team", ov.DELETE, "rl"),
    ("sweep.values=[2e-3, 2e-2]", "sweep.values", ov.SET, "[2e-3, 2e-2]"),
    ("tracking.run_name='tau_p=2e-3-seed0'", "tracking.run_name", ov.SET, "'tau_p=2e-3-seed0'"),
])
def test_key_and_kind_from_hydra_value_as_typed(text, key, kind, value):
    o = ov.parse(text)
    assert (o.text, o.key, o.kind, o.value) == (text, key, kind, value)


def test_package_is_not_part_of_the_key():
    o = ov.parse("model@policy=tiny")
    assert (o.key, o.package) == ("model", "policy")


@pytest.mark.parametrize("text, expected", [
    ("trainer.total_steps", "override 'trainer.total_steps' has no '=': write key=value"),
    ("model=~/m", "override 'model=~/m' is not a Hydra override (unexpected '~' at character 7)"),
    ("a=b=c", "override 'a=b=c' is not a Hydra override (mismatched input '='"),
])
def test_bad_syntax_is_one_line_naming_the_override(text, expected):
    with pytest.raises(UserError) as err:
        ov.parse(text)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_keys_and_drop_read_every_kind():
    items = ["+cluster.address=http://h:8265", "~tracking.run_name", "++trainer.seed=1", "loss=grpo"]
    assert ov.keys(items) == {"cluster.address", "tracking.run_name", "trainer.seed", "loss"}
    assert ov.drop(items, ("cluster.address", "tracking.run_name")) == ["++trainer.seed=1", "loss=grpo"]


def test_delete_works_where_hydra_allows_it():
    cfg = compose_config(["+tracking.tags.team=rl", "+tracking.tags.group=a", "~tracking.tags.team",
                          "+rollout.resources.node=1", "~rollout.resources.node=1"])
    assert dict(cfg.tracking.tags) == {"group": "a"} and dict(cfg.rollout.resources) == {}
    with pytest.raises(ConfigError, match=r"The value of 'tracking.tags.team' is rl and not b"):
        compose_config(["+tracking.tags.team=rl", "~tracking.tags.team=b"])


@pytest.mark.parametrize("overrides, expected", [
    (["~trainer.total_steps"], "trainer.total_steps is a field of the schema and cannot be deleted"),
    (["~loss"], "'loss' has no value (a ~ delete removed it): choose one, e.g. loss="),
    (["~tracking.tags.nobody"], "'tracking.tags.nobody' does not exist"),
])
def test_deletes_hydra_refuses_are_one_line(overrides, expected):
    with pytest.raises(ConfigError) as err:
        compose_config(overrides)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_delete_and_bad_syntax_through_the_command_line():
    res = run_cli("train", "--dry-run", "+tracking.tags.team=rl", "+tracking.tags.group=a", "~tracking.tags.team")
    assert res.returncode == 0, res.stderr
    assert resolved_yaml(res.stdout)["tracking"]["tags"] == {"group": "a"}
    res = run_cli("train", "--dry-run", "loss.tau_p=[1,")
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stdout + res.stderr
    assert lines[0].startswith("error: override 'loss.tau_p=[1,' is not a Hydra override")


def test_job_command_lines_replace_what_they_own_whatever_its_prefix():
    from stapoctl.jobs import presets, ray_jobs, slurm

    conf = compose_config(["cluster=slurm"])
    out = slurm.job_overrides(conf, ["++tracking.uri=x", "+tracking.run_name=y", "++cluster.num_cpus=3",
                                     "loss=grpo"], "run", "sqlite:////tmp/s.db")
    assert out == ["++cluster.num_cpus=3", "loss=grpo", "tracking.uri=sqlite:////tmp/s.db", "tracking.run_name=run",
                   f"cluster.num_gpus={int(conf.cluster.gpus_per_node or 0)}"]
    assert presets._given(["++cluster.partition=gpu", "~cluster.account"]) == {"cluster.partition", "cluster.account"}
    conf = compose_config(["cluster=ray", "cluster.address=http://127.0.0.1:8265"])
    spec = ray_jobs.job_spec(conf, ["++cluster.address=http://h:1", "loss=grpo"], "r", "sqlite:////tmp/x.db")
    assert "cluster.address=http" not in spec.entrypoint and " loss=grpo cluster.address=auto " in spec.entrypoint


def test_sweeps_take_deletes_and_compare_values_as_typed():
    from stapoctl.sweep.definition import parse_command
    from stapoctl.sweep.runner import reconcile

    cmd = parse_command("tau_p", ["~tracking.tags.x", "loss.lr=1e-6"])
    assert cmd.cli_overrides == ("~tracking.tags.x", "loss.lr=1e-6")
    recorded = cmd.definition
    assert reconcile(parse_command("tau_p", ["loss.lr=1e-6", "resume=ab"]), recorded)[0] == recorded
    with pytest.raises(UserError, match="loss.lr=0.000001 differs from the sweep's recorded loss.lr=1e-6"):
        reconcile(parse_command("tau_p", ["loss.lr=0.000001", "resume=ab"]), recorded)
    with pytest.raises(UserError, match="is the key sweep 'tau_p' varies"):
        parse_command("tau_p", ["~loss.tau_p"])


def test_no_caller_parses_override_keys_by_hand():
    """`partition("=")` or `.lstrip("+~")` on an override is Hydra's parser done by hand."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "overrides.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("partition", "lstrip") and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in ("=", "+~", "~+", "+")):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, found
