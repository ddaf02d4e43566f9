"""The registry contract other parts of the project build on (configs, names, errors)."""

from __future__ import annotations

import typing
from dataclasses import asdict, fields, is_dataclass

import pytest
import torch

from stapoctl.losses import LOSSES, LossSpec, compute_policy_loss, register_loss
from test_losses_methods import GROUPS, make_batch

EXPECTED = {
    "grpo", "dapo", "stapo", "stapo_prob_only", "stapo_high_entropy", "entropy20", "justrl", "wapo",
    "tr_grpo", "ppl_shaping", "position_shaping", "stare", "advantage_reweighting",
}
SCALARS = {int, float, bool, str}
LIST_FIELDS = ("token_rules", "shadow", "modules")  # lists: config/token_rules.py, shadow_rules.py, loss_modules.py
REQUIRED_METRICS = {
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "stapo/spurious_ratio",
    "stapo/spurious_count", "stapo/entropy_threshold", "stapo/masked_pos_adv_ratio",
    "grad/lmhead_norm/spurious", "grad/lmhead_norm/pos_normal", "grad/lmhead_norm/neg",
}


def test_all_eleven_methods_are_registered():
    assert set(LOSSES) == EXPECTED
    for name, spec in LOSSES.items():
        assert isinstance(spec, LossSpec) and spec.name == name and spec.doc


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_is_a_hydra_friendly_dataclass(name):
    cls = LOSSES[name].config_cls
    assert is_dataclass(cls)
    fs = fields(cls)
    assert fs[0].name == "name" and fs[0].default == name
    hints = typing.get_type_hints(cls)
    for f in fs:
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if f.name in LIST_FIELDS:  # the deliberate exceptions: lists of rule dicts (and preset names)
            assert typing.get_origin(tp) is list and f.default_factory() == []
            continue
        assert tp in SCALARS or (typing.get_origin(tp) is typing.Union and len(args) == 1 and args[0] in SCALARS)
        assert f.metadata.get("help"), f"{name}.{f.name} has no help text"
    from omegaconf import OmegaConf

    node = OmegaConf.structured(cls())
    assert OmegaConf.to_object(node) == cls()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_asdict_of_the_config_is_accepted_and_metrics_are_complete(name):
    cfg = asdict(LOSSES[name].config_cls())
    batch = make_batch()
    loss, metrics = compute_policy_loss(name, **batch, **cfg, group_ids=torch.tensor(GROUPS), global_step=0)
    assert REQUIRED_METRICS <= set(metrics)
    assert loss.dtype == torch.float32


def test_unknown_key_error_names_the_closest_valid_key():
    with pytest.raises(ValueError, match=r"unknown key 'tau_pp' for loss 'stapo' \(closest valid: 'tau_p'\)"):
        compute_policy_loss("stapo", **make_batch(), tau_pp=1e-3)
    with pytest.raises(ValueError, match="closest: 'stapo'"):
        compute_policy_loss("stap", **make_batch())
    with pytest.raises(ValueError, match="does not match"):
        compute_policy_loss("stapo", **make_batch(), name="dapo")


def test_config_values_are_validated():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_policy_loss("dapo", **make_batch(), loss_agg_mode="token-sum")
    with pytest.raises(ValueError, match="tau_h"):
        compute_policy_loss("stapo", **make_batch(), tau_h=1.5)


def test_register_loss_checks_the_config_name():
    from dataclasses import dataclass

    @dataclass
    class Bad:
        name: str = "other"

    with pytest.raises(TypeError, match="first field"):
        register_loss("my_loss", Bad)(lambda batch, cfg: None)
    assert "my_loss" not in LOSSES


def test_the_torch_free_config_table_names_every_method_with_its_config():
    # composing a config reads LOSS_CONFIGS (no torch); it must agree with the registry
    from stapoctl.config.losses import LOSS_CONFIGS

    assert list(LOSS_CONFIGS) == list(LOSSES)
    assert all(LOSS_CONFIGS[k] is LOSSES[k].config_cls for k in LOSSES)


def test_a_loss_registered_at_run_time_joins_the_config_table():
    from dataclasses import dataclass

    from stapoctl.config.losses import LOSS_CONFIGS

    @dataclass
    class MyCfg:
        name: str = "my_runtime_loss"

    try:
        register_loss("my_runtime_loss", MyCfg)(lambda batch, cfg: None)
        assert LOSS_CONFIGS["my_runtime_loss"] is MyCfg and "my_runtime_loss" in LOSSES
    finally:
        LOSSES.pop("my_runtime_loss", None)
        LOSS_CONFIGS.pop("my_runtime_loss", None)
