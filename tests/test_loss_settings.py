"""The run's typed loss config (`config/loss_settings.py`): built once by the driver and once per
learner set-up, the same object reaching advantages, drift and token diagnostics, and the config
layer owning the table a method registered at run time joins."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from stapoctl.config import compose
from stapoctl.config.loss_settings import add_loss_config, build_loss_config, loss_config_class
from stapoctl.config.losses import LOSS_CONFIGS, DAPOConfig, GRPOConfig, STAPOConfig
from stapoctl.errors import UserError
from stapoctl.losses import LOSSES, register_loss
from stapoctl.rollout.batch import RolloutBatch


def test_the_loss_group_becomes_its_registered_dataclass_or_one_line_naming_the_field():
    conf = compose.compose_config(["loss=stapo", "loss.tau_p=0.01"])
    cfg = build_loss_config(conf.loss)
    assert type(cfg) is STAPOConfig and cfg.tau_p == 0.01 and cfg.tau_h == 0.2
    assert build_loss_config(dataclasses.asdict(cfg)) == cfg  # the dict a learner rank receives builds the same
    with pytest.raises(UserError, match=r"^loss.name=nope: not a registered loss"):
        build_loss_config({"name": "nope"})
    with pytest.raises(UserError, match=r"^loss.tau_pp: loss=stapo has no such field: remove it$"):
        build_loss_config({"name": "stapo", "tau_pp": 0.1})
    with pytest.raises(ValueError, match="clip_ratio_low"):  # the config's own checks run
        build_loss_config({"name": "dapo", "clip_ratio_low": 0.5, "clip_ratio_high": 0.2})


def _batch() -> RolloutBatch:
    return RolloutBatch.from_token_lists(
        [[1, 2], [3]], [[[5] * 3, [6] * 4], [[7] * 2, [8] * 3]],
        [[[-0.1] * 3, [-0.2] * 4], [[-0.3] * 2, [-0.4] * 3]], [[False, False], [False, False]],
        [["a", "b"], ["c", "d"]], pad_id=0, prompt_index=[0, 1])


def test_the_driver_builds_the_loss_config_once_and_hands_that_object_to_every_reader(monkeypatch):
    import stapoctl.losses as L
    import stapoctl.losses.drift as D
    from stapoctl.tracking import token_diagnostics
    from stapoctl.trainer import step_runner
    from stapoctl.trainer.step_runner import StepRunner

    built, seen = [], {"advantages": [], "drift": [], "diagnostics": []}

    def counting_build(loss):
        built.append(loss)
        return build_loss_config(loss)

    real_adv, real_drift = L.compute_advantages, D.drift
    monkeypatch.setattr(step_runner, "build_loss_config", counting_build)
    monkeypatch.setattr(L, "compute_advantages", lambda cfg, *a, **k: seen["advantages"].append(cfg)
                        or real_adv(cfg, *a, **k))
    monkeypatch.setattr(D, "drift", lambda cfg, **k: seen["drift"].append(cfg) or real_drift(cfg, **k))
    monkeypatch.setattr(token_diagnostics, "log_step", lambda b, lp, ent, cfg, **k: seen["diagnostics"].append(cfg))

    conf = compose.compose_config(["loss=stapo", "loss.tau_p=0.05", "rollout.n=2", "learner.ppo_mini_batch_size=2"])
    scorer = SimpleNamespace(score=lambda texts, *a: ([1.0, 0.0, 0.0, 1.0], {}))
    data = SimpleNamespace(prompt_ids=[[1, 2], [3]], answers=["1", "2"], questions=["q", "q"], kinds=None,
                           tokenizer=SimpleNamespace(decode=str))
    runner = StepRunner(conf, SimpleNamespace(info={}), scorer, data)
    for step in (1, 2, 3):
        batch, _ = runner.score(_batch())
        lp = batch.rollout_log_probs + 0.01 * batch.response_mask
        ent = torch.rand(lp.shape, generator=torch.Generator().manual_seed(step))
        result = SimpleNamespace(old_log_probs=lp, entropy=ent)
        runner._last_drift = runner._drift(batch, result)
        runner._last_old, runner._last_entropy = result.old_log_probs, result.entropy
        runner.log_diagnostics(batch, step)
    runner.drain_diagnostics(pytest.fail)
    assert len(built) == 1 and type(runner.loss_config) is STAPOConfig and runner.loss_config.tau_p == 0.05
    assert {k: len(v) for k, v in seen.items()} == {"advantages": 3, "drift": 3, "diagnostics": 3}
    assert all(cfg is runner.loss_config for calls in seen.values() for cfg in calls)
    # the typed call gives the advantages the old keyword form gave
    fields = dataclasses.asdict(runner.loss_config)
    assert torch.equal(batch.advantages, real_adv("stapo", batch.rewards, batch.group_ids, **fields))


def test_a_learner_rank_builds_its_config_at_set_up_and_none_per_micro_batch(monkeypatch):
    from stapoctl.learner.engine_setup import EngineSetup
    from stapoctl.learner.ppo_step import PPOStep
    from stapoctl.losses import registry

    rank = type("Rank", (EngineSetup, PPOStep), {})()
    loss = dataclasses.asdict(DAPOConfig(entropy_coef=0.01))  # what the driver ships through Ray
    rank._set_run_config({"zero_stage": 0}, loss, n_per_prompt=2, temperature=1.0, top_p=1.0,
                         max_response_length=None)
    assert type(rank.loss_config) is DAPOConfig and rank.loss_config.entropy_coef == 0.01

    made = []
    monkeypatch.setattr(DAPOConfig, "__post_init__", lambda self: made.append(self))
    monkeypatch.setattr(registry, "split_kwargs", lambda *a, **k: pytest.fail("a config built per call"))
    g = torch.Generator().manual_seed(0)
    lp = torch.log(torch.rand(4, 5, generator=g) * 0.9 + 0.05)
    rank.device = "cpu"
    rank._token_stats = lambda mb, entropy_grad: (torch.rand(len(mb.response_mask), 5, generator=g), lp[mb.rows],
                                                   lp[mb.rows].exp() ** 2)
    mini = SimpleNamespace(response_mask=torch.ones(4, 5, dtype=torch.bool),
                           advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                           old_log_probs=lp - 0.01, group_ids=torch.tensor([0, 0, 1, 1]), rollout_log_probs=lp,
                           ref_log_probs=None)
    first = {"entropy": torch.rand(4, 5, generator=g), "log_prob": lp, "sum_p2": lp.exp() ** 2}
    ent, context = rank._minibatch_context(mini, slice(0, 4), slice(0, 4), {"group_ids": mini.group_ids}, first, False)
    for rows in (slice(0, 2), slice(2, 4)):
        mb = SimpleNamespace(rows=rows, **{k: getattr(mini, k)[rows] for k in vars(mini) if k != "ref_log_probs"},
                             ref_log_probs=None)
        loss_value, metrics, _ = rank._micro_loss(mb, rows, ent, context, {}, behavior=False)
        assert torch.isfinite(loss_value) and "actor/entropy_loss" in metrics
    assert made == []


def test_register_loss_adds_a_composable_option_through_the_config_layer(monkeypatch):
    from stapoctl.losses import registry

    @dataclasses.dataclass
    class MyCfg(GRPOConfig):
        name: str = "my_settings_loss"
        my_knob: float = 0.5

    added = []
    monkeypatch.setattr(registry, "add_loss_config", lambda name, cls: added.append(name) or add_loss_config(name, cls))
    try:
        register_loss("my_settings_loss", MyCfg)(lambda batch, cfg: (batch.log_prob.sum() * 0, {}))
        assert added == ["my_settings_loss"] and loss_config_class("my_settings_loss") is MyCfg
        conf = compose.compose_config(["loss=my_settings_loss", "loss.my_knob=0.25"])
        cfg = build_loss_config(conf.loss)
        assert type(cfg) is MyCfg and cfg.my_knob == 0.25
    finally:
        from hydra.core.config_store import ConfigStore

        LOSSES.pop("my_settings_loss", None)
        LOSS_CONFIGS.pop("my_settings_loss", None)
        ConfigStore.instance().repo.get("loss", {}).pop("my_settings_loss.yaml", None)
        compose._stored_losses.pop("my_settings_loss", None)


def test_the_config_layer_refuses_a_class_whose_first_field_is_not_its_name():
    @dataclasses.dataclass
    class Bad:
        other: int = 0

    with pytest.raises(TypeError, match="first field must be name"):
        add_loss_config("bad_loss", Bad)
    assert "bad_loss" not in LOSS_CONFIGS
    add_loss_config("grpo", GRPOConfig)  # a built-in's own class: already declared, the table is unchanged
    assert LOSS_CONFIGS["grpo"] is GRPOConfig and list(LOSS_CONFIGS) == list(LOSSES)


def test_the_inert_knobs_read_the_runs_config_object_when_given_it(monkeypatch):
    """The loop hands `knobs` the step runner's config: none is built a second time at run start."""
    from stapoctl.trainer import inert

    conf = compose.compose_config(["loss=stapo"])
    cfg = build_loss_config(conf.loss)
    built = inert.knobs(conf)  # without it: built here
    monkeypatch.setattr(inert, "loss_config", lambda loss: pytest.fail("a second loss config was built"))
    assert [k.key for k in inert.knobs(conf, cfg)] == [k.key for k in built]
