"""Shadow rules (`loss.shadow`, losses/shadow.py) and the rollout mismatch per 000 Table 1 cell: shares
by hand on test_losses_methods' fixture, and a shadow never changing the update on random batches.

By hand, GRPO (clip 0.2/0.2): coef_t = A_t except (0,1) and (6,1) clipped (0) and (7,0) = ρA = −1.1.
Without Σp², ‖e(y) − π‖ = 1 − π: 0.5 for π = 0.5 and 0.999 for the four π = 1e−3 tokens, so
G per row = 3.7485, 0.9995, 1, 0.5, 2.999, 0.999, 1, 1.05 → ΣG = 12.296.
S2T (STAPO's shadow) = (0,2) G 1.4985 and (4,3) G 0.999; 11 tokens have Â > 0 (rows 0, 4, 5).
20-Entropy's mask takes the 20 tokens with H < h* = 1.2; the five H ≥ 2 tokens have
G = 0.75 (0,4), 0.999 (5,0), 0.5 (6,0), 0.5 (4,4), 0.25 (2,3) = 2.999.
"""

from __future__ import annotations

import math

import pytest
import torch

from stapoctl.config.losses import GRPOConfig
from stapoctl.config.shadow_rules import CELLS, SPURIOUS_CELL
from stapoctl.errors import UserError
from stapoctl.losses import LOSSES, compute_policy_loss, prepare_minibatch, slice_context
from test_losses_methods import LOW_P, make_batch
from test_losses_rules import MODES, SPLIT, random_batch

SHADOWS = ["stapo", "entropy20", "table1"]


def test_shares_by_hand():
    _, m = compute_policy_loss("grpo", **make_batch(), shadow=["stapo", "entropy20"])
    assert m["shadow/stapo/token_share"] == pytest.approx(2 / 25)
    assert m["shadow/stapo/pos_adv_share"] == pytest.approx(2 / 11)
    assert m["shadow/stapo/grad_share"] == pytest.approx((1.4985 + 0.999) / 12.296, rel=1e-5)
    assert m["shadow/entropy20/token_share"] == pytest.approx(20 / 25)
    assert m["shadow/entropy20/pos_adv_share"] == pytest.approx(8 / 11)
    assert m["shadow/entropy20/grad_share"] == pytest.approx((12.296 - 2.999) / 12.296, rel=1e-5)


def test_the_gradient_norm_reads_sum_p2_and_a_rule_shadow_by_hand():
    """Σp² = 2π makes ‖e(y) − π‖ = 1, so G_t = |coef_t|: Σ|coef| = 6 + 1.5 + 2 + 1 + 5 + 1 + 2 + 2.1 = 20.6."""
    b = make_batch()
    sum_p2 = 2 * b["log_prob"].detach().exp()
    rule = {"adv": "neg", "prob": [0, 0.01], "action": "scale", "scale": 3, "name": "rare_neg"}
    _, m = compute_policy_loss("grpo", **b, sum_p2=sum_p2, shadow=["stapo", rule, [{"adv": "neg", "action": "mask",
                                                                                    "name": "neg"}, rule]])
    assert m["shadow/stapo/grad_share"] == pytest.approx(2.5 / 20.6, rel=1e-6)
    assert m["shadow/rare_neg/grad_share"] == pytest.approx(0.5 / 20.6, rel=1e-6)  # (1,1): A = −0.5
    assert m["shadow/rare_neg/pos_adv_share"] == 0.0 and m["shadow/rare_neg/token_share"] == pytest.approx(1 / 25)
    # a rule list is named by its first rule and takes what any of its rules takes: every A < 0 token
    assert m["shadow/neg/token_share"] == pytest.approx(14 / 25)
    assert m["shadow/neg/grad_share"] == pytest.approx((1.5 + 2 + 1 + 2 + 2.1) / 20.6, rel=1e-6)


def test_table1_cells_partition_the_tokens_and_the_gradient():
    b = random_batch(4)
    _, m = compute_policy_loss("grpo", **b, shadow=["table1"], tau_p=0.05)
    mask, adv = b["response_mask"], b["advantages"][:, None].expand_as(b["response_mask"])
    signed = (mask & (adv != 0)).sum().item() / mask.sum().item()
    assert signed < 1.0  # some Â = 0 tokens: they belong to no cell
    assert sum(m[f"shadow/{c[0]}/token_share"] for c in CELLS) == pytest.approx(signed, abs=1e-6)
    assert sum(m[f"shadow/{c[0]}/grad_share"] for c in CELLS) == pytest.approx(1.0, abs=1e-6)
    assert m[f"shadow/{SPURIOUS_CELL}/grad_share"] > 0


@pytest.mark.parametrize("split", [None, SPLIT], ids=["one-shot", "micro"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["grpo", "dapo", "stapo", "wapo", "tr_grpo"])
def test_a_shadow_never_changes_the_update(name, mode, split):
    """Same loss, gradient and every other metric with and without shadows; micro-batches report the
    mini-batch's shares."""
    out = {}
    for shadow in ([], SHADOWS):
        b = random_batch(5)
        cfg = dict(loss_agg_mode=mode, tau_p=0.05, shadow=shadow, group_ids=torch.arange(16) // 4)
        if name in ("wapo", "tr_grpo"):
            cfg.pop("loss_agg_mode")
        if split is None:
            loss, m = compute_policy_loss(name, **b, **cfg)
            metrics = [m]
        else:
            ctx = prepare_minibatch(name, log_prob=b["log_prob"].detach(), advantages=b["advantages"],
                                    response_mask=b["response_mask"], entropy=b["entropy"],
                                    old_log_prob=b["old_log_prob"], **cfg)  # as the learner passes it
            parts = [compute_policy_loss(name, **{k: v[r] for k, v in b.items()}, **slice_context(ctx, r),
                                         **{**cfg, "group_ids": cfg["group_ids"][r]}) for r in SPLIT]
            loss, metrics = sum(p[0] for p in parts), [p[1] for p in parts]
        out[bool(shadow)] = loss, torch.autograd.grad(loss, b["log_prob"])[0], metrics
    (l0, g0, m0), (l1, g1, m1) = out[False], out[True]
    assert l1.item() == l0.item()
    assert torch.equal(g1, g0)
    assert [{k: v for k, v in m.items() if not k.startswith("shadow/")} for m in m1] == m0
    one_shot = compute_policy_loss(name, **random_batch(5), **cfg)[1]
    for m in m1:
        assert {k: v for k, v in m.items() if k.startswith("shadow/")} == pytest.approx(
            {k: v for k, v in one_shot.items() if k.startswith("shadow/")}, abs=1e-6)
    assert len([k for k in m1[0] if k.startswith("shadow/")]) == 3 * (2 + len(CELLS))


def test_mismatch_per_cell_and_per_shadow_by_hand():
    """|Δlogp| = 0.2 on the four π = 1e−3 tokens, 0.01 elsewhere: (0,2), (4,3) are the spurious cell,
    (5,0) is Â > 0 with H ≥ h*, (1,1) is Â < 0 with H < h*."""
    b = make_batch()
    delta = torch.full_like(b["old_log_prob"], 0.01)
    for ij in LOW_P:
        delta[ij] = 0.2
    behav = b["old_log_prob"] - delta
    one, m = compute_policy_loss("grpo", **b, behavior_log_prob=behav, rollout_correction="off", shadow=["stapo"])
    assert m["rollout_corr/abs_dlogp"] == pytest.approx((4 * 0.2 + 21 * 0.01) / 25, rel=1e-5)
    for cell in (SPURIOUS_CELL, "pos_lowp_highh", "neg_lowp_lowh"):
        assert m[f"rollout_corr/abs_dlogp/{cell}"] == pytest.approx(0.2, rel=1e-5)
    assert m["rollout_corr/abs_dlogp/pos_highp_lowh"] == pytest.approx(0.01, rel=1e-4)
    assert m["rollout_corr/abs_dlogp/neg_lowp_highh"] == 0.0  # an empty cell
    assert m["shadow/stapo/abs_dlogp"] == pytest.approx(0.2, rel=1e-5)
    plain, m_plain = compute_policy_loss("grpo", **make_batch())
    assert not any(k.startswith("rollout_corr/") for k in m_plain)  # no behaviour log-probs: nothing measured
    assert one.item() == plain.item()  # rollout_correction=off: measured only


@pytest.mark.parametrize("shadow, message", [
    (["stapoo"], "shadow[0]=stapoo: not a preset; use"),
    ([{"adv": "up", "action": "mask"}], "shadow[0].adv=up: must be pos"),
    ([[{"action": "mask"}, {"prob": [0.5, 0.1], "action": "mask"}]], "shadow[0][1].prob=[0.5, 0.1]: an empty band"),
    ("stapo", "shadow=stapo: a list of presets or rules"),
    ([{"action": "mask", "name": "a"}, {"action": "mask", "name": "a"}], "shadow: two shadows are named a"),
    ([3], "shadow[0]=3: a preset name, a rule dict or a list of rules"),
])
def test_bad_shadows_are_refused_in_one_line(shadow, message):
    with pytest.raises(UserError) as err:
        GRPOConfig(shadow=shadow)
    assert message in str(err.value) and "\n" not in str(err.value) and str(err.value).startswith("grpo: shadow")


def test_a_preset_shadow_takes_the_runs_thresholds():
    (name, rules), = GRPOConfig(shadow=["stapo"], tau_p=0.05, tau_h=0.3).shadows()
    assert name == "stapo" and rules[0].prob == (None, 0.05) and rules[0].entropy_q == (None, pytest.approx(0.7))
    cells = dict(GRPOConfig(shadow=["table1"], tau_p=0.01).shadows())
    assert list(cells) == [c[0] for c in CELLS] and cells[SPURIOUS_CELL][0].text() == (
        "{adv: pos, prob: [0, 0.01], entropy_q: [0, 0.8], action: mask}")
    assert not math.isnan(len(LOSSES))


def test_a_minibatch_without_gradient_has_no_grad_share_and_the_step_mean_leaves_it_out():
    """Every Â = 0 (a mini-batch of uniform groups): no gradient, so no gradient share (NaN), not 0;
    the learner's step mean is over the mini-batches that had one (it once logged 0.75 for a step
    whose fourth mini-batch had no gradient)."""
    from stapoctl.learner.metric_accumulator import MetricAccumulator

    b = make_batch()
    b["advantages"] = torch.zeros_like(b["advantages"])
    _, m = compute_policy_loss("grpo", **b, shadow=["stapo"])
    assert math.isnan(m["shadow/stapo/grad_share"]) and m["shadow/stapo/token_share"] == 0.0
    acc = MetricAccumulator()
    for share, loss in ((0.2, 1.0), (0.4, 1.0), (float("nan"), 0.0)):
        acc.add({"shadow/stapo/grad_share": share, "actor/pg_loss": loss, "actor/entropy": 0.3})
        acc.end_minibatch()
    out = acc.result()
    assert out["shadow/stapo/grad_share"] == pytest.approx(0.3) and out["actor/entropy"] == pytest.approx(0.3)
    acc = MetricAccumulator()
    acc.add({"shadow/stapo/grad_share": float("nan"), "actor/entropy": float("nan")})
    acc.end_minibatch()
    out = acc.result()
    assert "shadow/stapo/grad_share" not in out and math.isnan(out["actor/entropy"])  # other NaNs stay visible
