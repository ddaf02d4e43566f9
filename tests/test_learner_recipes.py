"""The verl/OpenRLHF recipe terms inside the real DeepSpeed learner (CPU, in-process): the frozen
reference policy of the KL term, the entropy bonus's gradient and the rollout-mismatch weight,
each against values computed by hand from the learner's own log-probs.
"""

from __future__ import annotations

import math

import pytest
import torch

from test_learner import EPS, LR, MICRO, N, WD, fixed_batch, reference_log_probs

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from stapoctl.config.schema import TinyModelConfig
    from stapoctl.models.tiny import build_random

    return str(build_random(tmp_path_factory.mktemp("tiny_random_recipes"), TinyModelConfig(), seed=0))


def make_learner(tiny_dir, mini_prompts: int = 2, **loss_overrides):
    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.losses import LOSSES

    name = loss_overrides.pop("name", "grpo")
    loss_cfg = {**vars(LOSSES[name].config_cls()), **loss_overrides}
    learner_cfg = dict(zero_stage=0, lr=LR, betas=[0.9, 0.999], weight_decay=WD, adam_eps=EPS, warmup_steps=0,
                       grad_clip=1.0, ppo_mini_batch_size=mini_prompts, micro_batch_size=MICRO, ppo_epochs=1,
                       logits_chunk_size=7, cpus=1, num_gpus=0)
    learner = Learner(rank=0, world_size=1)
    learner.setup(tiny_dir, learner_cfg, loss_cfg, n_per_prompt=N, seed=0)
    return learner


def batch_for(tiny_dir):
    from transformers import AutoTokenizer

    return fixed_batch(AutoTokenizer.from_pretrained(tiny_dir).pad_token_id)


def test_kl_to_the_frozen_reference_is_zero_before_the_first_update_then_positive(tiny_dir):
    from transformers import AutoModelForCausalLM

    batch = batch_for(tiny_dir)
    plain = make_learner(tiny_dir)
    assert plain.reference is None  # no KL term: no second copy of the weights
    learner = make_learner(tiny_dir, mini_prompts=4, kl_coef=0.1, kl_estimator="k3")
    assert learner.reference is not None and not any(p.requires_grad for p in learner.reference.parameters())
    first = learner.train_step(batch, global_step=1).metrics  # one mini-batch of 4 prompts: one update
    assert first["actor/kl_loss"] == 0.0  # π = π_ref before any update: k3 = e^0 - 0 - 1 = 0
    assert first["timing_s/ref_policy"] > 0
    second_step = learner.train_step(batch, global_step=2)
    second = second_step.metrics
    # by hand: GRPO's seq-mean-token-mean of k3 = exp(ref - lp) - (ref - lp) - 1 at the weights
    # the second step starts from (its one mini-batch is the whole batch, so lp = its old log-probs)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = reference_log_probs(base, batch)
    lp = second_step.old_log_probs
    d = torch.where(batch.response_mask, ref - lp, 0.0)
    per_token = torch.where(batch.response_mask, d.exp() - d - 1, 0.0)
    k3 = (per_token.sum(1) / batch.response_mask.sum(1)).mean()
    assert second["actor/kl_loss"] == pytest.approx(float(k3), rel=1e-4, abs=1e-9)
    assert second["actor/kl_loss"] > 0
    # the reference stays the initial policy: its log-probs are the base model's
    assert torch.allclose(learner.reference_log_probs(batch), ref, atol=1e-6)


def test_entropy_bonus_is_the_aggregated_entropy_and_moves_the_update(tiny_dir):
    batch = batch_for(tiny_dir)
    with_bonus = make_learner(tiny_dir, mini_prompts=4, entropy_coef=0.5)
    without = make_learner(tiny_dir, mini_prompts=4)
    m1 = with_bonus.train_step(batch, global_step=1).metrics
    m0_step = without.train_step(batch, global_step=1)
    m0 = m0_step.metrics
    # one mini-batch at the initial weights: GRPO's seq-mean-token-mean of H, by hand
    mask = batch.response_mask
    h = torch.where(mask, m0_step.entropy, 0.0)
    by_hand = float((h.sum(1) / mask.sum(1)).mean())
    assert m1["actor/entropy_loss"] == pytest.approx(by_hand, rel=1e-5)
    assert "actor/entropy_loss" not in m0  # no bonus: the metric set is today's
    assert m1["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], abs=1e-6)  # same surrogate
    assert m1["actor/grad_norm"] != pytest.approx(m0["actor/grad_norm"], rel=1e-5)  # the bonus has a gradient
    w1 = next(with_bonus.module.parameters()).detach()
    w0 = next(without.module.parameters()).detach()
    assert not torch.equal(w1, w0)


def test_token_tis_weight_checked_by_hand_against_the_log_probs(tiny_dir):
    """vLLM's log-probs of the fixed batch are 0 (π_behav = 1), so the raw ratio is π_old and
    token_tis's weight min(π_old / 1, C) = π_old: every weight is below 1 and none is capped."""
    batch = batch_for(tiny_dir)
    learner = make_learner(tiny_dir, rollout_correction="token_tis", rollout_is_cap=2.0)
    step = learner.train_step(batch, global_step=1)
    m = step.metrics
    mask = batch.response_mask
    old = step.old_log_probs
    half = len(batch) // 2  # metrics average the two mini-batches; the ratio uses the step's old log-probs
    per_mb = [torch.where(mask[s], old[s].exp(), 0.0).sum() / mask[s].sum()
              for s in (slice(0, half), slice(half, None))]
    assert m["rollout_corr/ratio_mean"] == pytest.approx(float(sum(per_mb) / 2), rel=1e-5)
    assert m["rollout_corr/weight_mean"] == pytest.approx(m["rollout_corr/ratio_mean"], rel=1e-6)
    assert m["rollout_corr/masked_frac"] == 0.0
    assert m["rollout_corr/ratio_max"] <= 1.0
    # k3 of KL(behav → old) with r = π_old / π_behav: mean of r - 1 - log r
    r = old.exp()
    k3 = [torch.where(mask[s], r[s] - 1 - old[s], 0.0).sum() / mask[s].sum() for s in (slice(0, half), slice(half, None))]
    assert m["rollout_corr/kl_k3"] == pytest.approx(float(sum(k3) / 2), rel=1e-5)
    assert not math.isclose(m["rollout_corr/ratio_mean"], 1.0)


def test_auto_correction_leaves_a_fresh_synchronous_batch_alone(tiny_dir):
    batch = batch_for(tiny_dir)
    m = make_learner(tiny_dir).train_step(batch, global_step=1).metrics
    assert not any(k.startswith("rollout_corr/") for k in m)
    off = make_learner(tiny_dir, rollout_correction="off").train_step(batch, global_step=1).metrics
    assert off["rollout_corr/ratio_mean"] < 1.0  # measured ...
    assert off["actor/pg_loss"] == pytest.approx(m["actor/pg_loss"], abs=1e-7)  # ... and not applied


def test_token_rules_pass_through_the_learner_unchanged(tiny_dir):
    """`loss=dapo` with STAPO's rule as `token_rules` (a list of dicts in loss_cfg, passed as **cfg to
    prepare_minibatch and every micro-batch's compute_policy_loss) trains exactly as `loss=stapo`;
    without the rule dapo is another update (τ_p = 1: every A > 0 token below h* is silenced)."""
    batch = batch_for(tiny_dir)
    rule = {"adv": "pos", "prob": [0, 1.0], "entropy_q": [0, 0.8], "action": "mask"}
    ruled = make_learner(tiny_dir, name="dapo", tau_p=1.0, token_rules=[rule]).train_step(batch, global_step=1).metrics
    stapo = make_learner(tiny_dir, name="stapo", tau_p=1.0).train_step(batch, global_step=1).metrics
    plain = make_learner(tiny_dir, name="dapo", tau_p=1.0).train_step(batch, global_step=1).metrics
    assert ruled["rules/r0/token_ratio"] > 0 and ruled["stapo/spurious_count"] > 0
    for key in ("actor/pg_loss", "actor/grad_norm", "loss/active_token_ratio"):
        assert ruled[key] == pytest.approx(stapo[key], abs=1e-6), key
    assert abs(plain["actor/grad_norm"] - stapo["actor/grad_norm"]) > 1e-4
