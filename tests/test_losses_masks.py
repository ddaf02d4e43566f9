"""Quantile semantics of tau_h (SPEC reading: h* = quantile(H over M, 1 - tau_h), low iff H < h*)."""

from __future__ import annotations

import pytest
import torch

from stapoctl.losses import compute_policy_loss
from stapoctl.losses.masks import entropy_threshold, high_entropy_mask, masked_quantile, s2t_mask


def _one_row(values):
    h = torch.tensor([values], dtype=torch.float32)
    return h, torch.ones_like(h, dtype=torch.bool)


def test_distinct_entropies_tau_h_02_makes_80_percent_candidates():
    h, m = _one_row([0.0, 1.0, 2.0, 3.0, 4.0])
    # q = 0.8, position 0.8 * 4 = 3.2 -> 3 + 0.2 * (4 - 3) = 3.2
    hs = entropy_threshold(h, m, 0.2)
    assert hs.item() == pytest.approx(3.2, abs=1e-6)
    assert (h < hs).sum().item() == 4  # 4 of 5 tokens are low-entropy


def test_tau_h_08_makes_20_percent_candidates():
    h, m = _one_row([0.0, 1.0, 2.0, 3.0, 4.0])
    # q = 0.2, position 0.8 -> 0 + 0.8 * (1 - 0) = 0.8: only H = 0 is below
    hs = entropy_threshold(h, m, 0.8)
    assert hs.item() == pytest.approx(0.8, abs=1e-6)
    assert (h < hs).sum().item() == 1


def test_ties_at_the_threshold_are_exempt():
    h, m = _one_row([1.0, 1.0, 1.0, 2.0, 2.0])
    # position 3.2 lies between xs[3] = 2 and xs[4] = 2 -> h* = 2; only the three 1.0 are low
    hs = entropy_threshold(h, m, 0.2)
    assert hs.item() == 2.0
    assert (h < hs).sum().item() == 3
    assert high_entropy_mask(h, m, hs).sum().item() == 2


def test_all_equal_entropies_mask_nothing():
    h, m = _one_row([0.7] * 5)
    hs = entropy_threshold(h, m, 0.2)
    assert hs.item() == pytest.approx(0.7)
    adv = torch.ones_like(h)
    prob = torch.full_like(h, 1e-6)
    assert s2t_mask(adv, prob, h, m, tau_p=2e-3, threshold=hs).sum().item() == 0
    # the ablation flips the entropy test: all five H >= h*, all silenced
    assert s2t_mask(adv, prob, h, m, tau_p=2e-3, threshold=hs, kind="high_entropy").sum().item() == 5
    # 20-Entropy keeps every token when all are tied
    assert high_entropy_mask(h, m, hs).sum().item() == 5


def test_quantile_ignores_padding_and_matches_torch_quantile():
    g = torch.Generator().manual_seed(0)
    h = torch.rand(4, 9, generator=g)
    m = torch.rand(4, 9, generator=g) > 0.3
    h_pad = torch.where(m, h, torch.full_like(h, 1e9))  # padding values must not matter
    for interp in ("linear", "lower", "higher", "midpoint"):
        for q in (0.0, 0.2, 0.5, 0.8, 1.0):
            ours = masked_quantile(h_pad, m, q, interp)
            ref = torch.quantile(h[m], q, interpolation=interp)
            assert ours.item() == pytest.approx(ref.item(), abs=1e-6), (interp, q)


def test_empty_response_threshold_is_zero():
    h = torch.rand(2, 3)
    m = torch.zeros(2, 3, dtype=torch.bool)
    assert entropy_threshold(h, m, 0.2).item() == 0.0


def _batch(adv_value):
    lp = torch.full((2, 5), -8.0)  # pi = 3.4e-4 < tau_p everywhere
    return dict(
        log_prob=lp.clone().requires_grad_(True),
        old_log_prob=lp.clone(),
        advantages=torch.full((2, 5), adv_value),
        response_mask=torch.ones(2, 5, dtype=torch.bool),
        entropy=torch.arange(10, dtype=torch.float32).view(2, 5),
    )


def test_no_positive_advantage_means_no_mask_and_stapo_equals_dapo():
    b1, b2 = _batch(-1.0), _batch(-1.0)
    l_stapo, m = compute_policy_loss("stapo", **b1)
    l_dapo, _ = compute_policy_loss("dapo", **b2)
    assert m["stapo/spurious_count"] == 0
    assert m["stapo/masked_pos_adv_ratio"] == 0.0  # no positive tokens: 0, not NaN
    assert l_stapo.item() == l_dapo.item() == pytest.approx(1.0)


def test_positive_advantages_low_entropy_tokens_are_silenced():
    _, m = compute_policy_loss("stapo", **_batch(1.0))
    # entropies 0..9: h* = 7 + 0.2 = 7.2 -> H in {0..7} (8 tokens) silenced
    assert m["stapo/entropy_threshold"] == pytest.approx(7.2, abs=1e-6)
    assert m["stapo/spurious_count"] == 8
    assert m["stapo/spurious_ratio"] == pytest.approx(0.8)
