"""Training–inference drift per token rule (losses/drift.py): the |Δ log p| distribution overall and
per 000 Table 1 cell, and the rule decisions vLLM's π would flip, checked against numpy by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stapoctl.losses.drift import drift
from stapoctl.trainer.inert import loss_config


def batch(seed: int = 0, rows: int = 16, length: int = 24, noise: float = 0.3) -> dict:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, length, generator=g) * 9.0  # π from 1e-4 to 1: some below τ_p = 2e-3
    behav = lp + noise * torch.randn(rows, length, generator=g)
    ent = torch.rand(rows, length, generator=g) * 2.0
    adv = torch.where(torch.rand(rows, generator=g) < 0.5, 1.0, -1.0)
    mask = torch.ones(rows, length, dtype=torch.bool)
    mask[3, 20:] = False  # a short response
    return dict(learner_log_prob=lp, rollout_log_prob=behav, entropy=ent, advantages=adv, response_mask=mask)


def s2t_by_hand(lp: np.ndarray, ent: np.ndarray, adv: np.ndarray, mask: np.ndarray, tau_p: float, tau_h: float,
                mini_rows: int) -> np.ndarray:
    out = np.zeros_like(mask)
    for s in range(0, len(mask), mini_rows):
        sl = slice(s, s + mini_rows)
        h_star = np.quantile(ent[sl][mask[sl]], 1 - tau_h)
        out[sl] = mask[sl] & (adv[sl, None] > 0) & (np.exp(lp[sl]) < tau_p) & (ent[sl] < h_star)
    return out


@pytest.mark.parametrize("mini_rows", [16, 4])
def test_flips_of_the_stapo_mask_match_a_hand_count(mini_rows):
    b = batch()
    cfg = loss_config({"name": "stapo", "tau_p": 2e-3, "tau_h": 0.2, "shadow": ["stapo_prob_only"]})
    d = drift(cfg, mini_rows=mini_rows, **b)
    lp, behav = b["learner_log_prob"].numpy(), b["rollout_log_prob"].numpy()
    ent, adv, mask = b["entropy"].numpy(), b["advantages"].numpy(), b["response_mask"].numpy()
    by_learner = s2t_by_hand(lp, ent, adv, mask, 2e-3, 0.2, mini_rows)
    by_vllm = s2t_by_hand(behav, ent, adv, mask, 2e-3, 0.2, mini_rows)  # H and h* stay the learner's
    flips = int((by_learner ^ by_vllm).sum())
    assert flips > 0, "the batch must have flips for the check to mean anything"
    assert d.metrics["rollout_corr/flips/s2t"] == flips == d.metrics["rollout_corr/flips"]
    assert d.metrics["rollout_corr/flip_rate"] == pytest.approx(flips / mask.sum())
    assert np.array_equal(d.acted["s2t"].numpy(), by_learner)
    prob_only = lambda x: mask & (adv[:, None] > 0) & (np.exp(x) < 2e-3)  # noqa: E731
    assert d.metrics["shadow/stapo_prob_only/flips"] == int((prob_only(lp) ^ prob_only(behav)).sum())


def test_the_drift_distribution_per_cell_matches_numpy():
    b = batch(1)
    cfg = loss_config({"name": "grpo", "tau_p": 2e-3, "tau_h": 0.2})
    d = drift(cfg, mini_rows=16, **b)
    lp, behav = b["learner_log_prob"].numpy(), b["rollout_log_prob"].numpy()
    ent, adv, mask = b["entropy"].numpy(), b["advantages"].numpy(), b["response_mask"].numpy()
    diff = np.abs(lp - behav)
    assert d.metrics["rollout/logprob_diff_p99"] == pytest.approx(np.quantile(diff[mask], 0.99), rel=1e-6)
    assert d.metrics["rollout_corr/abs_dlogp"] == pytest.approx(diff[mask].mean(), rel=1e-6)
    h_star = np.quantile(ent[mask], 0.8)
    cell = mask & (adv[:, None] > 0) & (np.exp(lp) < 2e-3) & (ent < h_star)  # pos_lowp_lowh: the spurious cell
    assert cell.sum() > 1
    assert d.metrics["rollout_corr/abs_dlogp/pos_lowp_lowh"] == pytest.approx(diff[cell].mean(), rel=1e-6)
    assert d.metrics["rollout_corr/abs_dlogp_p99/pos_lowp_lowh"] == pytest.approx(np.quantile(diff[cell], 0.99),
                                                                                   rel=1e-6)
    assert d.metrics["rollout_corr/abs_dlogp_max/pos_lowp_lowh"] == pytest.approx(diff[cell].max(), rel=1e-6)
    assert "rollout_corr/flips" not in d.metrics  # grpo applies no rule: nothing to flip


def test_equal_log_probs_flip_nothing():
    b = batch(2)
    b["rollout_log_prob"] = b["learner_log_prob"].clone()
    d = drift(loss_config({"name": "stapo", "tau_p": 2e-3}), mini_rows=4, **b)
    assert d.metrics["rollout_corr/flips"] == 0 and d.metrics["rollout/logprob_diff_p99"] == 0
    assert int(d.acted["s2t"].sum()) > 0
