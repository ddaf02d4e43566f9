"""The verl/OpenRLHF-parity terms every loss takes: KL to a reference, entropy bonus, rollout
correction and the seq-mean-token-sum-norm mode — by hand, then through every registered loss.

KL fixture (2 x 3, row lengths 3 and 2; π = 0.5 everywhere, ρ = 1, A = [1, −1]):
    x = π_ref/π   row 0: 0.5, 1, 2     row 1: 2, 0.5
    k3 = x − ln x − 1: 0.193147 (x = 0.5), 0 (x = 1), 0.306853 (x = 2): each row sums to 0.5
    k2 = ½ ln² x = 0.240227 where x ≠ 1;  abs = ln 2 = 0.693147 where x ≠ 1;  k1 = −ln x
    ∂k3/∂log π = 1 − x

Correction fixture (3 x 3, row lengths 3, 2, 3; C = 2; π = π_old = 0.1, ρ = 1, A = [1, −1, 1]):
    r = π_old/π_behav   row 0: 4, 2.5, 1      row 1: 0.25, 0.8      row 2: 1.25, 0.8, 1
    Π_t r              10                    0.2                   1
    geometric mean     2.154 (> C)           0.447 (< 1/C)         1
    token_tis w        2, 2, 1               0.25, 0.8             1.25, 0.8, 1     Σ w·A = 7.0
    seq_tis w          2, 2, 2               0.2, 0.2              1, 1, 1          Σ w·A = 8.6
    token_mask w       0, 0, 1               0, 1                  1, 1, 1          Σ w·A = 3
    seq_mask w         0, 0, 0               0, 0                  1, 1, 1          Σ w·A = 3
DAPO token-mean at ρ = 1: loss = −Σ w·A / 8, ∂loss/∂log π_t = −w_t·A_t / 8.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from stapoctl.config.losses import DAPOConfig, GRPOConfig, STAPOConfig, TRGRPOConfig
from stapoctl.losses import LOSSES, PolicyBatch, compute_policy_loss, prepare_minibatch, slice_context
from stapoctl.losses.kl import kl_estimate
from stapoctl.losses.registry import split_kwargs
from stapoctl.losses.rollout_correction import rollout_correction
from test_losses_methods import GROUPS, make_batch

LN2 = math.log(2.0)
MODES = ["auto", "off", "token_tis", "seq_tis", "token_mask", "seq_mask"]


# -- KL estimators ------------------------------------------------------------------------------
def kl_batch():
    lp = torch.full((2, 3), math.log(0.5), requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    x = torch.tensor([[0.5, 1.0, 2.0], [2.0, 0.5, 1.0]])
    ref = (0.5 * x).log()
    return dict(log_prob=lp, old_log_prob=lp.detach().clone(), advantages=torch.tensor([1.0, -1.0]),
                response_mask=mask, entropy=torch.ones(2, 3)), ref


@pytest.mark.parametrize("estimator, row0", [
    ("k1", [LN2, 0.0, -LN2]),
    ("k2", [LN2 ** 2 / 2, 0.0, LN2 ** 2 / 2]),
    ("k3", [0.5 + LN2 - 1, 0.0, 2 - LN2 - 1]),
    ("abs", [LN2, 0.0, LN2]),
])
def test_each_estimator_by_hand(estimator, row0):
    b, ref = kl_batch()
    kl = kl_estimate(b["log_prob"], ref, estimator)
    torch.testing.assert_close(kl[0], torch.tensor(row0), atol=1e-6, rtol=0)


def test_k3_is_clamped_to_ten_like_verl_and_its_gradient_zeroed_beyond():
    """x = π_ref/π: k3 = x − ln x − 1; at ln x = 3, 20.0855 − 3 − 1 = 16.0855 > 10; at ln x = 2,
    7.3891 − 2 − 1 = 4.3891 < 10 keeps its value and its gradient 1 − x = −6.3891."""
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[3.0, 2.0]])
    kl = kl_estimate(lp, ref, "k3")  # the default clamp, 10
    torch.testing.assert_close(kl, torch.tensor([[10.0, math.exp(2) - 3]]), atol=1e-5, rtol=0)
    (g,) = torch.autograd.grad(kl.sum(), lp)
    torch.testing.assert_close(g, torch.tensor([[0.0, 1 - math.exp(2)]]), atol=1e-5, rtol=0)
    kl = kl_estimate(lp, ref, "k3", clamp=5.0)  # 4.3891 still inside
    (g,) = torch.autograd.grad(kl.sum(), lp)
    assert kl[0, 0].item() == 5.0 and g[0, 0].item() == 0.0 and g[0, 1].item() == pytest.approx(1 - math.exp(2))


def test_k3_clamp_zero_is_off():
    lp = torch.tensor([[0.0]], requires_grad=True)
    kl = kl_estimate(lp, torch.tensor([[3.0]]), "k3", clamp=0.0)
    assert kl.item() == pytest.approx(math.exp(3) - 4, abs=1e-4)
    (g,) = torch.autograd.grad(kl.sum(), lp)
    assert g.item() == pytest.approx(1 - math.exp(3), abs=1e-4)


@pytest.mark.parametrize("clamp, value, grad", [(10.0, 10.0, 0.0), (0.0, math.exp(3) - 4, 1 - math.exp(3))])
def test_kl_clamp_through_the_loss(clamp, value, grad):
    """One token, π = π_old (ρ = 1, A = 0: no surrogate gradient), ln(π_ref/π) = 3, β = 0.5."""
    lp = torch.tensor([[math.log(0.01)]], requires_grad=True)
    b = dict(log_prob=lp, old_log_prob=lp.detach().clone(), advantages=torch.tensor([0.0]),
             response_mask=torch.tensor([[True]]), entropy=torch.ones(1, 1))
    loss, m = compute_policy_loss("dapo", **b, kl_coef=0.5, kl_clamp=clamp, ref_log_prob=lp.detach() + 3.0)
    assert m["actor/kl_loss"] == pytest.approx(value, abs=1e-4)
    assert loss.item() == pytest.approx(0.5 * value, abs=1e-4)
    (g,) = torch.autograd.grad(loss, lp)
    assert g.item() == pytest.approx(0.5 * grad, abs=1e-4)
    assert DAPOConfig().kl_clamp == 10.0


def test_kl_term_token_mean_by_hand():
    b, ref = kl_batch()
    base, _ = compute_policy_loss("dapo", **b)
    (g0,) = torch.autograd.grad(base, b["log_prob"])
    b, ref = kl_batch()
    loss, m = compute_policy_loss("dapo", **b, kl_coef=0.1, ref_log_prob=ref)
    assert m["actor/kl_loss"] == pytest.approx(1.0 / 5, abs=1e-6)  # (0.5 + 0.5) / 5 tokens
    assert loss.item() == pytest.approx(base.item() + 0.1 * 0.2, abs=1e-6)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    one_minus_x = torch.tensor([[0.5, 0.0, -1.0], [-1.0, 0.5, 0.0]])
    torch.testing.assert_close(g - g0, 0.1 * one_minus_x / 5, atol=1e-7, rtol=0)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 1.0 / 5),
    ("seq-mean-token-mean", (0.5 / 3 + 0.5 / 2) / 2),
    ("seq-mean-token-sum", (0.5 + 0.5) / 2),
    ("seq-mean-token-sum-norm", (0.5 + 0.5) / (2 * 3)),
])
def test_kl_follows_the_loss_agg_mode(mode, expected):
    b, ref = kl_batch()
    _, m = compute_policy_loss("grpo", **b, loss_agg_mode=mode, kl_coef=1.0, ref_log_prob=ref)
    assert m["actor/kl_loss"] == pytest.approx(expected, abs=1e-6)


def test_kl_without_reference_names_the_keyword():
    b, _ = kl_batch()
    with pytest.raises(ValueError, match="ref_log_prob=") as err:
        compute_policy_loss("grpo", **b, kl_coef=0.1)
    assert "\n" not in str(err.value)


def test_stapo_kl_is_not_silenced():
    """(0,2) is silenced by S2T (test_losses_methods); its KL still counts, over all 25 tokens."""
    ref = make_batch()["log_prob"].detach().clone()
    ref[0, 2] += LN2  # x = 2 at the silenced token only: k3 = 0.306853
    base, _ = compute_policy_loss("stapo", **make_batch())
    b = make_batch()
    loss, m = compute_policy_loss("stapo", **b, kl_coef=0.5, ref_log_prob=ref)
    assert m["stapo/spurious_count"] == 2.0
    assert m["actor/kl_loss"] == pytest.approx((2 - LN2 - 1) / 25, abs=1e-7)  # not / 23, not 0
    assert loss.item() == pytest.approx(base.item() + 0.5 * (2 - LN2 - 1) / 25, abs=1e-7)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    assert g[0, 2].item() == pytest.approx(0.5 * (1 - 2) / 25, abs=1e-7)  # silenced, yet pulled by the KL


def test_tr_grpo_default_keeps_its_weighted_form_and_k3_matches_it_at_unit_weight():
    ref = make_batch()["log_prob"].detach() - LN2
    unit = dict(alpha=0.0, mu=-1.0, weight_high=1.0, kl_coef=0.5, ref_log_prob=ref)
    own, m_own = compute_policy_loss("tr_grpo", **make_batch(), **unit)
    k3, m_k3 = compute_policy_loss("tr_grpo", **make_batch(), **unit, kl_estimator="k3")
    # w = 1: 004's D = x - ln x - 1 is k3; the weighted form sits in the token loss, k3 is added after
    assert own.item() == pytest.approx(k3.item(), abs=1e-6)
    assert m_own["actor/kl_loss"] == pytest.approx(0.5 + LN2 - 1, abs=1e-6) == m_k3["actor/kl_loss"]
    assert TRGRPOConfig().kl_estimator == "tr_weighted" and GRPOConfig().kl_estimator == "k3"


def test_per_microbatch_norm_uses_the_microbatch_count_for_the_terms_too():
    b, ref = kl_batch()
    ctx = prepare_minibatch("dapo", log_prob=b["log_prob"].detach(), advantages=b["advantages"],
                            response_mask=b["response_mask"], entropy=b["entropy"], kl_coef=1.0,
                            per_microbatch_norm=True)
    assert "reg_denominator" not in ctx and "loss_denominator" not in ctx
    # row 1 alone: k3 = 0.306853 + 0.193147 over its own 2 tokens
    _, m = compute_policy_loss("dapo", **{k: v[1:] for k, v in b.items()}, ref_log_prob=ref[1:], kl_coef=1.0,
                               per_microbatch_norm=True, **ctx)
    assert m["actor/kl_loss"] == pytest.approx(0.5 / 2, abs=1e-6)


# -- entropy bonus ------------------------------------------------------------------------------
def test_entropy_bonus_by_hand():
    b, _ = kl_batch()
    base, m0 = compute_policy_loss("dapo", **b)
    b, _ = kl_batch()
    b["entropy"] = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 9.0]], requires_grad=True)  # 9.0: padding
    loss, m = compute_policy_loss("dapo", **b, entropy_coef=0.01)
    assert m["actor/entropy_loss"] == pytest.approx(7.0 / 5, abs=1e-6)
    assert "actor/entropy_loss" not in m0
    assert loss.item() == pytest.approx(base.item() - 0.01 * 7.0 / 5, abs=1e-6)
    (g,) = torch.autograd.grad(loss, b["entropy"])
    torch.testing.assert_close(g, -0.01 / 5 * b["response_mask"].float(), atol=1e-9, rtol=0)


def test_a_negative_entropy_coef_minimises_entropy_by_hand():
    """c < 0 (verl takes either sign): loss = pg + |c|·agg(H), the gradient pushes H down."""
    b, _ = kl_batch()
    base, _ = compute_policy_loss("dapo", **b)
    b, _ = kl_batch()
    b["entropy"] = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 9.0]], requires_grad=True)  # 9.0: padding
    loss, m = compute_policy_loss("dapo", **b, entropy_coef=-0.01)
    assert m["actor/entropy_loss"] == pytest.approx(7.0 / 5, abs=1e-6)
    assert loss.item() == pytest.approx(base.item() + 0.01 * 7.0 / 5, abs=1e-6)
    (g,) = torch.autograd.grad(loss, b["entropy"])
    torch.testing.assert_close(g, 0.01 / 5 * b["response_mask"].float(), atol=1e-9, rtol=0)


def test_entropy_without_gradient_gives_the_value_but_no_gradient():
    b, _ = kl_batch()
    loss, m = compute_policy_loss("dapo", **b, entropy_coef=0.01)
    assert m["actor/entropy_loss"] == pytest.approx(1.0, abs=1e-7)
    assert loss.requires_grad  # through log_prob only


# -- rollout correction -------------------------------------------------------------------------
RATIOS = torch.tensor([[4.0, 2.5, 1.0], [0.25, 0.8, 1.0], [1.25, 0.8, 1.0]])
CORR_MASK = torch.tensor([[True, True, True], [True, True, False], [True, True, True]])
HAND = {  # weight, Σ w·A, changed (masked_frac) — see the module docstring
    "token_tis": ([[2, 2, 1], [0.25, 0.8, 0], [1.25, 0.8, 1]], 7.0, 2 / 8),
    "seq_tis": ([[2, 2, 2], [0.2, 0.2, 0], [1, 1, 1]], 8.6, 3 / 8),
    "token_mask": ([[0, 0, 1], [0, 1, 0], [1, 1, 1]], 3.0, 3 / 8),
    "seq_mask": ([[0, 0, 0], [0, 0, 0], [1, 1, 1]], 3.0, 5 / 8),
    "off": ([[1, 1, 1], [1, 1, 0], [1, 1, 1]], 4.0, 0.0),
}
HAND["auto"] = HAND["token_tis"]


def corr_batch():
    old = torch.full((3, 3), math.log(0.1))
    return dict(log_prob=old.clone().requires_grad_(True), old_log_prob=old, advantages=torch.tensor([1.0, -1.0, 1.0]),
                response_mask=CORR_MASK, entropy=torch.ones(3, 3)), (old - RATIOS.log())


@pytest.mark.parametrize("mode", MODES)
def test_each_correction_mode_by_hand(mode):
    weight, wsum, changed = HAND[mode]
    b, behav = corr_batch()
    loss, m = compute_policy_loss("dapo", **b, behavior_log_prob=behav, rollout_correction=mode, rollout_is_cap=2.0)
    assert loss.item() == pytest.approx(-wsum / 8, abs=1e-6)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    expected = -torch.tensor(weight) * torch.tensor([1.0, -1.0, 1.0])[:, None] / 8
    torch.testing.assert_close(g, expected * CORR_MASK, atol=1e-6, rtol=0)
    assert m["rollout_corr/weight_mean"] == pytest.approx(sum(map(sum, weight)) / 8, abs=1e-6)
    assert m["rollout_corr/masked_frac"] == pytest.approx(changed, abs=1e-7)
    assert m["rollout_corr/ratio_mean"] == pytest.approx(11.6 / 8, abs=1e-6)
    assert m["rollout_corr/ratio_max"] == pytest.approx(4.0, abs=1e-5)
    assert m["rollout_corr/kl_k3"] == pytest.approx(2.9068528 / 8, abs=1e-6)  # mean of r - 1 - ln r


def test_the_cap_moves_the_bounds():
    b, behav = corr_batch()
    w = rollout_correction(b["old_log_prob"], behav, CORR_MASK, mode="token_mask", cap=5.0).weight
    torch.testing.assert_close(w, CORR_MASK.float())  # every ratio lies in [0.2, 5]
    w = rollout_correction(b["old_log_prob"], behav, CORR_MASK, mode="token_tis", cap=3.0).weight
    torch.testing.assert_close(w[0], torch.tensor([3.0, 2.5, 1.0]))
    assert rollout_correction(b["old_log_prob"], None, CORR_MASK, mode="token_tis").weight is None


def test_is_cap_is_an_alias_with_one_warning():
    import stapoctl.losses.registry as registry

    registry._WARNED.discard("is_cap")
    b, behav = corr_batch()
    with pytest.warns(FutureWarning, match="rollout_is_cap"):
        loss, _ = compute_policy_loss("dapo", **b, behavior_log_prob=behav, is_cap=3.0)
    assert loss.item() == pytest.approx(-(3 + 2.5 + 1 - 0.25 - 0.8 + 1.25 + 0.8 + 1) / 8, abs=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        loss, _ = compute_policy_loss("dapo", **corr_batch()[0], behavior_log_prob=behav, is_cap=3.0,
                                      rollout_is_cap=4.0)  # a rollout_is_cap of its own wins
    assert loss.item() == pytest.approx(-(4 + 2.5 + 1 - 0.25 - 0.8 + 1.25 + 0.8 + 1) / 8, abs=1e-6)


def test_no_behaviour_log_probs_no_weight_and_no_metrics():
    b, _ = corr_batch()
    _, m = compute_policy_loss("dapo", **b, rollout_correction="seq_mask")
    assert not any(k.startswith("rollout_corr/") for k in m)


# -- seq-mean-token-sum-norm --------------------------------------------------------------------
def test_seq_mean_token_sum_norm_by_hand():
    """test_losses_methods' DAPO row sums add to 4.52 over 8 rows: loss = −4.52 / (8 · T_max)."""
    loss, _ = compute_policy_loss("dapo", **make_batch(), loss_agg_mode="seq-mean-token-sum-norm")
    assert loss.item() == pytest.approx(-4.52 / (8 * 5), abs=1e-6)
    b = make_batch()
    loss, _ = compute_policy_loss("dapo", **b, loss_agg_mode="seq-mean-token-sum-norm", max_response_length=10)
    assert loss.item() == pytest.approx(-4.52 / 80, abs=1e-6)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    assert g[0, 0].item() == pytest.approx(-1.5 / 80, abs=1e-8)  # A = 1.5 at rho = 1


def test_trimmed_microbatches_add_up_in_seq_mean_token_sum_norm():
    """Each micro-batch cut to its own longest row (as the learner's trimmed forward does)."""
    cfg = dict(loss_agg_mode="seq-mean-token-sum-norm", kl_coef=0.1, entropy_coef=0.01)
    ref = make_batch()["log_prob"].detach() - 0.3
    one, _ = compute_policy_loss("dapo", **make_batch(), ref_log_prob=ref, **cfg)
    b = make_batch()
    ctx = prepare_minibatch("dapo", log_prob=b["log_prob"].detach(), advantages=b["advantages"],
                            response_mask=b["response_mask"], entropy=b["entropy"], **cfg)
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 5), slice(5, 8)):  # widths 5, 4, 5, 3
        width = int(b["response_mask"][rows].sum(-1).max())
        part = {k: v[rows, :width] for k, v in b.items()}
        loss, _ = compute_policy_loss("dapo", **part, ref_log_prob=ref[rows, :width], **slice_context(ctx, rows),
                                      **cfg)
        total = total + loss
    assert total.item() == pytest.approx(one.item(), abs=1e-7)


# -- every registered loss ----------------------------------------------------------------------
EXTRAS = dict(group_ids=torch.tensor(GROUPS), global_step=0)
SPLITS = [slice(0, 3), slice(3, 5), slice(5, 8)]


def full_inputs():
    b = make_batch()
    g = torch.Generator().manual_seed(7)
    ref = b["log_prob"].detach() + 0.4 * torch.randn(8, 5, generator=g)
    behav = b["old_log_prob"] + 0.6 * torch.randn(8, 5, generator=g)
    b["entropy"] = b["entropy"].clone().requires_grad_(True)
    return b, ref, behav


def _grads(loss, b):
    return torch.autograd.grad(loss, (b["log_prob"], b["entropy"]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(LOSSES))
def test_microbatch_sum_equals_minibatch_with_every_term(name, mode):
    cfg = dict(kl_coef=0.2, entropy_coef=0.01, rollout_correction=mode, rollout_is_cap=1.5)
    b, ref, behav = full_inputs()
    one, m = compute_policy_loss(name, **b, ref_log_prob=ref, behavior_log_prob=behav, **EXTRAS, **cfg)
    g_one = _grads(one, b)
    assert "actor/kl_loss" in m and "actor/entropy_loss" in m and "rollout_corr/weight_mean" in m
    b, ref, behav = full_inputs()
    ctx = prepare_minibatch(name, log_prob=b["log_prob"].detach(), advantages=b["advantages"],
                            response_mask=b["response_mask"], entropy=b["entropy"].detach(),
                            old_log_prob=b["old_log_prob"], ref_log_prob=ref, **EXTRAS, **cfg)
    total = 0.0
    for rows in SPLITS:
        part = {k: v[rows] for k, v in b.items()}
        loss, _ = compute_policy_loss(name, **part, ref_log_prob=ref[rows], behavior_log_prob=behav[rows],
                                      group_ids=EXTRAS["group_ids"][rows], global_step=0,
                                      **slice_context(ctx, rows), **cfg)
        total = total + loss
    assert total.item() == pytest.approx(one.item(), abs=1e-6)
    for acc, ref_grad in zip(_grads(total, b), g_one):
        torch.testing.assert_close(acc, ref_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_microbatch_sum_for_every_estimator_and_mode(estimator, agg):
    loss_name = "entropy20"  # a mask that is not the response mask, and a mode
    cfg = dict(kl_coef=0.2, kl_estimator=estimator, entropy_coef=0.01, loss_agg_mode=agg, renormalize=True)
    b, ref, _ = full_inputs()
    one, _ = compute_policy_loss(loss_name, **b, ref_log_prob=ref, **cfg)
    g_one = _grads(one, b)
    b, ref, _ = full_inputs()
    ctx = prepare_minibatch(loss_name, log_prob=b["log_prob"].detach(), advantages=b["advantages"],
                            response_mask=b["response_mask"], entropy=b["entropy"].detach(), **cfg)
    assert "reg_denominator" in ctx
    total = sum(compute_policy_loss(loss_name, **{k: v[r] for k, v in b.items()}, ref_log_prob=ref[r],
                                    **slice_context(ctx, r), **cfg)[0] for r in SPLITS)
    assert total.item() == pytest.approx(one.item(), abs=1e-6)
    for acc, ref_grad in zip(_grads(total, b), g_one):
        torch.testing.assert_close(acc, ref_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(LOSSES))
def test_off_knobs_are_bit_equal_to_the_method_alone(name):
    """β = 0, c = 0, auto without behavior_log_prob: exactly the registered method's loss and gradient."""
    b = make_batch()
    loss, metrics = compute_policy_loss(name, **b, **EXTRAS, kl_coef=0.0, entropy_coef=0.0, rollout_correction="auto")
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    spec = LOSSES[name]
    b2 = make_batch()
    conf, extras, context = split_kwargs(spec, dict(EXTRAS))
    alone, m_alone = spec.fn(PolicyBatch(**b2, extras=extras, context=context), conf)
    (g2,) = torch.autograd.grad(alone, b2["log_prob"])
    assert torch.equal(loss, alone) and torch.equal(g, g2)
    assert metrics == m_alone
    assert not any(k in metrics for k in ("actor/entropy_loss", "rollout_corr/weight_mean"))
    assert "actor/kl_loss" not in metrics
    ctx = prepare_minibatch(name, log_prob=b["log_prob"].detach(), advantages=b["advantages"],
                            response_mask=b["response_mask"], entropy=b["entropy"],
                            old_log_prob=b["old_log_prob"], **EXTRAS)
    assert "reg_denominator" not in ctx


# -- refused values -----------------------------------------------------------------------------
@pytest.mark.parametrize("cls, kwargs, match", [
    (DAPOConfig, dict(kl_coef=-0.1), "kl_coef"),
    (DAPOConfig, dict(entropy_coef=float("nan")), "entropy_coef"),
    (DAPOConfig, dict(rollout_is_cap=0.5), "rollout_is_cap"),
    (DAPOConfig, dict(kl_estimator="k4"), "kl_estimator"),
    (DAPOConfig, dict(kl_clamp=-1.0), "kl_clamp"),
    (DAPOConfig, dict(rollout_correction="icepop"), "rollout_correction"),
    (STAPOConfig, dict(loss_agg_mode="token-sum-norm"), "loss_agg_mode"),
    (GRPOConfig, dict(kl_estimator="tr_weighted"),
     r"^grpo: kl_estimator=tr_weighted is TR-GRPO's own weighted form \(004 Eq. 11\): use k1, k2, k3 or abs$"),
])
def test_bad_values_are_refused_in_one_line(cls, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        cls(**kwargs)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=match.lstrip("^").rstrip("$")):
        compute_policy_loss(cls().name, **make_batch(), **kwargs)
