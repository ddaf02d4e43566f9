"""GRPO advantages (SPEC "Advantages"), by hand."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch

from stapoctl.losses import compute_advantages
from stapoctl.losses.stapo import STAPOConfig


def test_grpo_population_std():
    r = torch.tensor([1.0, -1, -1, -1, 1, 1, -1, -1])
    g = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])  # arbitrary ids
    adv = compute_advantages("grpo", r, g)
    # group 7: mean -0.5, population std sqrt(0.75) = 0.8660254: 1.5/0.866 = 1.7320508, -0.5/0.866 = -0.5773503
    # group 3: mean 0, std 1 -> +-1 / (1 + 1e-6)
    s = math.sqrt(0.75) + 1e-6
    expected = [1.5 / s, -0.5 / s, -0.5 / s, -0.5 / s, 1 / (1 + 1e-6), 1 / (1 + 1e-6), -1 / (1 + 1e-6), -1 / (1 + 1e-6)]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-6, rtol=0)
    assert adv.dtype == torch.float32


def test_grpo_unbiased_std_flag():
    r = torch.tensor([1.0, -1, -1, -1])
    adv = compute_advantages("grpo", r, torch.zeros(4, dtype=torch.long), std_mode="unbiased")
    # unbiased var = (2.25 + 3 * 0.25) / 3 = 1 -> std 1: [1.5, -0.5, -0.5, -0.5] / (1 + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]) / (1 + 1e-6), atol=1e-6, rtol=0)


def test_equal_rewards_and_singletons_give_exact_zero():
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, -1.0, -1.0])
    g = torch.tensor([0, 0, 0, 1, 2, 2])
    adv = compute_advantages("grpo", r, g)
    assert adv.tolist() == [0.0] * 6  # not 1e-10 from float noise / (0 + eps)
    adv_u = compute_advantages("grpo", r, g, std_mode="unbiased")
    assert adv_u.tolist() == [0.0] * 6


def test_loss_name_uses_its_config_and_accepts_asdict():
    r = torch.tensor([1.0, -1, -1, -1])
    g = torch.zeros(4, dtype=torch.long)
    a = compute_advantages("stapo", r, g, **asdict(STAPOConfig(std_mode="unbiased")))
    b = compute_advantages("grpo", r, g, std_mode="unbiased")
    torch.testing.assert_close(a, b)
    d = compute_advantages("stapo", r, g, adv_estimator="dr_grpo")
    assert d.tolist() == [1.5, -0.5, -0.5, -0.5]


def test_errors_name_the_closest_valid_key():
    r, g = torch.ones(2), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="closest valid: 'std_mode'"):
        compute_advantages("grpo", r, g, std_mod="population")
    with pytest.raises(ValueError, match="closest: 'grpo'"):
        compute_advantages("grp", r, g)
    with pytest.raises(ValueError, match="std_mode"):
        compute_advantages("grpo", r, g, std_mode="sample")
