"""The behaviour-policy correction of asynchronous training (decoupled PPO with a truncated
importance weight), checked by hand on one response of three tokens.

    π_old (proximal, the learner's recompute) = 0.5, 0.5, 0.5
    π_behav (the stale weights that sampled)  = 0.25, 0.5, 0.1
    w = min(π_old/π_behav, C=2)               = 2,    1,   2      (5 ⇒ truncated to 2)
At ρ = π/π_old = 1 (first update) the DAPO token-mean surrogate is Σ w_t·Â / 3, so with Â = 1:
    loss = −(2 + 1 + 2)/3 = −5/3,  ∂loss/∂log π_t = −w_t/3.
"""

from __future__ import annotations

import math

import pytest
import torch

from stapoctl.losses import LOSSES, compute_policy_loss

LOG_HALF = math.log(0.5)


def inputs(requires_grad: bool = True):
    lp = torch.full((1, 3), LOG_HALF, requires_grad=requires_grad)
    return dict(log_prob=lp, old_log_prob=torch.full((1, 3), LOG_HALF), advantages=torch.tensor([1.0]),
                response_mask=torch.ones(1, 3, dtype=torch.bool), entropy=torch.full((1, 3), 0.7))


BEHAV = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))


def cfg(name: str) -> dict:
    return {"name": name, **vars(LOSSES[name].config_cls())}


def test_truncated_is_weight_by_hand():
    x = inputs()
    loss, m = compute_policy_loss("dapo", **x, behavior_log_prob=BEHAV, is_cap=2.0, **cfg("dapo"))
    assert float(loss) == pytest.approx(-5 / 3, abs=1e-6)
    loss.backward()
    assert torch.allclose(x["log_prob"].grad, torch.tensor([[-2 / 3, -1 / 3, -2 / 3]]), atol=1e-6)
    # the metrics were async/is_weight_mean, async/is_weight_max, async/is_truncated_frac
    assert m["rollout_corr/weight_mean"] == pytest.approx(5 / 3, abs=1e-6)
    assert m["rollout_corr/ratio_max"] == pytest.approx(5.0, abs=1e-5)  # the raw ratio, before the cap
    assert m["rollout_corr/masked_frac"] == pytest.approx(1 / 3, abs=1e-6)  # only the 5 was cut (2 is the cap)


def test_the_cap_is_configurable():
    loss, _ = compute_policy_loss("dapo", **inputs(), behavior_log_prob=BEHAV, is_cap=10.0, **cfg("dapo"))
    assert float(loss) == pytest.approx(-(2 + 1 + 5) / 3, abs=1e-5)


@pytest.mark.parametrize("name", ["grpo", "dapo", "stapo", "entropy20", "wapo", "tr_grpo"])
def test_without_behavior_log_probs_nothing_changes(name):
    """The synchronous path is exactly the old one: no weight, no rollout_corr/* metrics."""
    extra = {"group_ids": torch.tensor([0])} if name == "wapo" else {}
    loss, m = compute_policy_loss(name, **inputs(), **extra, **cfg(name))
    same, _ = compute_policy_loss(name, **inputs(), **extra, behavior_log_prob=torch.full((1, 3), LOG_HALF),
                                  **cfg(name))
    assert float(loss) == float(same)  # π_behav = π_old: w ≡ 1 exactly
    assert not any(k.startswith(("async/", "rollout_corr/")) for k in m)


def test_stapo_mask_uses_the_current_policy_not_the_behaviour_one():
    """Token 0 was unlikely under the stale policy (0.25 < τ_p = 0.3) but not under the current
    one (0.5): it is not silenced. Lower the current π of token 0 to 0.2 and it is."""
    c = {**cfg("stapo"), "tau_p": 0.3, "tau_h": 0.2}
    x = inputs()
    x["entropy"] = torch.tensor([[0.1, 0.2, 0.9]])  # h* = 80th percentile: tokens 0 and 1 are low-entropy
    _, m = compute_policy_loss("stapo", **x, behavior_log_prob=BEHAV, **c)
    assert m["stapo/spurious_ratio"] == 0.0
    x["log_prob"] = torch.log(torch.tensor([[0.2, 0.5, 0.5]])).requires_grad_()
    _, m = compute_policy_loss("stapo", **x, behavior_log_prob=BEHAV, **c)
    assert m["stapo/spurious_ratio"] == pytest.approx(1 / 3)
