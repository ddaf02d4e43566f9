"""The published methods written as rules (losses/published.py; docs/LOSSES.md "Published methods as
rules"): STARE and Advantage Reweighting by hand on test_losses_methods' fixture, against each
reference implementation's own formula on random batches, and the grammar they needed.

Fixture (test_losses_methods' docstring): DAPO token-mean, 25 tokens, s_t = A_t except (0,1) = 1.92
(clipped), (6,1) = −0.8 (clipped), (7,0) = −1.1; total Σ s_t = 4.52. π = 0.5 except 1e−3 at (0,2),
(1,1), (4,3), (5,0); H = 1 except five tokens in [2, 2.4] → mean H = (20 + 11)/25 = 1.24.
"""

from __future__ import annotations

import pytest
import torch

from stapoctl.config.losses import AdvantageReweightingConfig, STAREConfig
from stapoctl.config.token_rules import parse_rule
from stapoctl.errors import UserError
from stapoctl.losses import compute_policy_loss, prepare_minibatch, slice_context
from test_losses_methods import make_batch
from test_losses_rules import MODES, SPLIT, random_batch


def test_stare_by_hand():
    """Â > 0 tokens: 11, π = 1e−3 at (0,2), (4,3), (5,0), else 0.5. Their 10% quantile (linear, position
    1.0 of 10) is 1e−3, and the band is π < 1e−3: empty. At P = 0.3 (position 3.0 → 0.5) the three
    π = 1e−3 tokens (s = 1.5, 1, 1) are L+: loss = −(4.52 + 0.1·3.5)/25 with W = 1.1, token-mean."""
    b = make_batch()
    base, _ = compute_policy_loss("dapo", **b, clip_ratio_c=10.0)
    gate = dict(stare_target_entropy=2.0)  # H̄ = 1.24 < 2: on
    p10, _ = compute_policy_loss("stare", **b, **gate)
    assert p10.item() == pytest.approx(base.item(), abs=1e-7)
    p30, m = compute_policy_loss("stare", **b, stare_top_ratio=0.3, **gate)
    assert p30.item() == pytest.approx(-(4.52 + 0.1 * 3.5) / 25, abs=1e-6)
    (g,) = torch.autograd.grad(p30, b["log_prob"])
    assert g[0, 2].item() == pytest.approx(-1.1 * 1.5 / 25, abs=1e-8) and g[0, 0].item() == pytest.approx(-1.5 / 25)
    off, _ = compute_policy_loss("stare", **make_batch(), stare_top_ratio=0.3, stare_target_entropy=1.24)
    assert off.item() == pytest.approx(base.item(), abs=1e-7)  # H̄ = 1.24 is not < 1.24: the gate is off
    # C2: L- = the Â < 0 tokens below their 30% π quantile: 14 tokens, one π = 1e−3 at (1,1) (s = −0.5),
    # position 3.9 → 0.5, so only (1,1): its term × M = 0.9
    c2, _ = compute_policy_loss("stare", **make_batch(), stare_top_ratio=0.3, stare_m=0.9, **gate)
    assert c2.item() == pytest.approx(-(4.52 + 0.1 * 3.5 + 0.1 * 0.5) / 25, abs=1e-6)


def test_advantage_reweighting_by_hand():
    """GRPO (seq-mean-token-mean): each term × (0.3·π_old + 0.7). π_old = π/ρ: 0.5 except (0,1) 1/3,
    (6,1) 1, (7,0) 0.5/1.1 and 1e−3 at the four rare tokens, whose factor is 0.7003."""
    b = make_batch()
    loss, _ = compute_policy_loss("advantage_reweighting", **b)
    old = b["old_log_prob"].exp()
    w = 0.3 * old + 0.7
    # GRPO's s_t by hand: A_t, except (0,1) clip 1.2·1.5 = 1.8, (6,1) −0.8 clipped, (7,0) −1.1
    s = b["advantages"].clone()
    s[0, 1], s[6, 1], s[7, 0] = 1.8, -0.8, -1.1
    mask = b["response_mask"]
    rows = torch.where(mask, w * s, 0.0).sum(1) / mask.sum(1)
    assert loss.item() == pytest.approx(-rows.mean().item(), abs=1e-6)
    assert w[0, 2].item() == pytest.approx(0.7003, abs=1e-6) and w[0, 0].item() == pytest.approx(0.85, abs=1e-6)
    plain, _ = compute_policy_loss("grpo", **make_batch())
    zero, _ = compute_policy_loss("advantage_reweighting", **make_batch(), ar_alpha=0.0)
    assert zero.item() == pytest.approx(plain.item(), abs=1e-7) and loss.item() != plain.item()


def _stare_reference(b, p=0.1, w=1.1, m=1.0, h_tgt=0.3):
    """hp-luo/STARE core_algos.compute_stare_token_weights: top-ceil(P·n) surprisal per sign, gated."""
    mask, adv = b["response_mask"], b["advantages"][:, None].expand_as(b["response_mask"])
    ent = torch.where(mask, b["entropy"], 0.0)
    weights = torch.ones_like(b["log_prob"].detach())
    if not ent.sum() / mask.sum() < h_tgt:
        return weights
    s = -b["log_prob"].detach()
    for sel, factor in ((mask & (adv > 0), w), (mask & (adv < 0), m)):
        n = int(sel.sum())
        k = max(1, int(n * p + 0.999999))
        idx = sel.reshape(-1).nonzero().squeeze(-1)[torch.topk(s[sel], k).indices]
        weights.reshape(-1)[idx] = factor
    return weights


@pytest.mark.parametrize("mode", MODES)
def test_stare_equals_its_reference_weights(mode):
    """Random batches, distinct π: the band π < quantile(π over Â > 0, q) with q = k/(n − 1) (linear: the
    (k+1)-th smallest) takes the k least likely tokens, the reference's top-ceil(P·n) surprisal with P = k/n."""
    for seed in (0, 1, 2):
        b = random_batch(seed)
        mask, adv = b["response_mask"], b["advantages"][:, None].expand_as(b["response_mask"])
        n_pos, n_neg = int((mask & (adv > 0)).sum()), int((mask & (adv < 0)).sum())
        k = max(1, n_pos // 10)
        q = k / (n_pos - 1)
        cfg = dict(loss_agg_mode=mode, stare_top_ratio=q, stare_w=1.1, stare_target_entropy=10.0)
        b2 = random_batch(seed)
        loss, _ = compute_policy_loss("stare", **b2, **cfg)
        ref_w = _stare_reference(b, p=k / n_pos, w=1.1, h_tgt=10.0)
        ref, _ = compute_policy_loss("dapo", **random_batch(seed), loss_agg_mode=mode, clip_ratio_c=10.0,
                                     token_rules=[])
        weighted = _weighted_dapo(random_batch(seed), ref_w, mode)
        assert loss.item() == pytest.approx(weighted, abs=1e-6) and loss.item() != ref.item()
        assert n_neg > 0


def _weighted_dapo(b, weights, mode):
    """DAPO (dual clip 10) with each token's term × the reference's weight, as its compute_policy_loss_stare."""
    from stapoctl.losses.batch import PolicyBatch
    from stapoctl.losses.pg import aggregate_with_context, surrogate_of
    from stapoctl.losses.registry import LOSSES, split_kwargs

    cfg, _, _ = split_kwargs(LOSSES["dapo"], dict(loss_agg_mode=mode, clip_ratio_c=10.0))
    pb = PolicyBatch(log_prob=b["log_prob"], old_log_prob=b["old_log_prob"], advantages=b["advantages"],
                     response_mask=b["response_mask"], entropy=b["entropy"])
    sur = surrogate_of(pb, cfg)
    return aggregate_with_context(pb, cfg, -sur.objective * weights, loss_mask=pb.mask, norm_mask=pb.mask).item()


@pytest.mark.parametrize("name", ["stare", "advantage_reweighting"])
def test_the_published_presets_add_up_over_micro_batches(name):
    cfg = dict(stare_target_entropy=10.0) if name == "stare" else {}
    b = random_batch(7)
    one, _ = compute_policy_loss(name, **b, **cfg)
    b = random_batch(7)
    ctx = prepare_minibatch(name, log_prob=b["log_prob"].detach(), advantages=b["advantages"],
                            response_mask=b["response_mask"], entropy=b["entropy"], old_log_prob=b["old_log_prob"],
                            **cfg)
    total = sum(compute_policy_loss(name, **{k: v[r] for k, v in b.items()}, **slice_context(ctx, r), **cfg)[0]
                for r in SPLIT)
    assert total.item() == pytest.approx(one.item(), abs=1e-6)
    if name == "stare":
        assert "prob_q=pos:0.1" in ctx and "mean_entropy" in ctx


def test_the_grammar_they_needed():
    rule = parse_rule({"adv": "pos", "prob_q": [0, 0.1], "mean_entropy": [0, 0.3], "action": "scale", "scale": 1.1}, 0)
    assert rule.text() == "{adv: pos, prob_q: [0, 0.1], mean_entropy: [0, 0.3], action: scale, scale: 1.1}"
    assert STAREConfig().preset_rules()[0].text() == rule.text()
    ar = parse_rule({"action": "weight", "fn": "old_prob", "alpha": 0.3}, 0)
    assert AdvantageReweightingConfig().preset_rules()[0].text() == ar.text() == (
        "{action: weight, fn: old_prob, alpha: 0.3}")
    for raw, message in (({"action": "weight", "fn": "prob", "alpha": 1.5}, "token_rules[0].alpha=1.5: alpha: a mixes"),
                         ({"action": "scale", "scale": 1, "alpha": 0.5}, "token_rules[0].alpha=0.5: only action: weight"),
                         ({"prob_q": [0.2, 0.1], "action": "mask"}, "token_rules[0].prob_q=[0.2, 0.1]: an empty band")):
        with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_rule(raw, 0)
