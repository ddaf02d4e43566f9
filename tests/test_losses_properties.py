"""Property tests on random shapes (hypothesis): no NaN, empty batches, mask shapes, dtypes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stapoctl.losses import LOSSES, compute_policy_loss
from stapoctl.losses.masks import s2t_mask

NAMES = list(LOSSES)
FAST = settings(max_examples=30, deadline=None, derandomize=True)


@st.composite
def batches(draw, empty=None):
    b = draw(st.integers(1, 6))
    t = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(b, t, generator=g) * 10  # pi down to 4.5e-5: S2T candidates
    old = log_prob + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, generator=g).round()  # -1, 0, +1 ... with exact zeros
    if empty is None:
        empty = draw(st.booleans())
    mask = torch.zeros(b, t, dtype=torch.bool) if empty else torch.rand(b, t, generator=g) > 0.3
    # garbage off the response must not leak into anything
    log_prob = torch.where(mask, log_prob, torch.full_like(log_prob, float("-inf")))
    return dict(
        log_prob=log_prob,
        old_log_prob=torch.where(mask, old, torch.full_like(old, float("nan"))),
        advantages=adv[:, None].expand(b, t).clone(),
        response_mask=mask,
        entropy=torch.rand(b, t, generator=g) * 3,
        group_ids=torch.arange(b) // 2,
        global_step=0,
    )


def _call(name, batch, dtype=torch.float32, **cfg):
    inputs = dict(batch)
    lp = inputs.pop("log_prob").to(dtype).requires_grad_(True)
    loss, metrics = compute_policy_loss(name, log_prob=lp, **inputs, **cfg)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, metrics, grad, lp


@FAST
@given(batch=batches(), name=st.sampled_from(NAMES))
def test_finite_loss_gradient_and_metrics(batch, name):
    loss, metrics, grad, _ = _call(name, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert torch.isfinite(grad).all()
    assert grad[~batch["response_mask"]].eq(0).all()
    assert all(isinstance(v, float) and v == v for v in metrics.values())


@FAST
@given(batch=batches(empty=True), name=st.sampled_from(NAMES))
def test_all_masked_minibatch_gives_zero_loss_and_zero_gradient(batch, name):
    loss, metrics, grad, _ = _call(name, batch)
    assert loss.item() == 0.0
    assert grad.eq(0).all()
    assert metrics["stapo/spurious_ratio"] == 0.0


@FAST
@given(batch=batches(empty=False))
def test_everything_silenced_gives_zero_not_nan(batch):
    # tau_p = 1 and tau_h = 0 (h* = max H): prob_only silences every A > 0 token; make all A > 0
    batch = dict(batch, advantages=batch["advantages"].abs() + 1.0)
    loss, metrics, grad, _ = _call("stapo_prob_only", batch, tau_p=1.0)
    assert loss.item() == 0.0 and grad.eq(0).all()
    n = int(batch["response_mask"].sum())
    assert metrics["stapo/spurious_count"] == n


@FAST
@given(batch=batches(), name=st.sampled_from(NAMES))
def test_bf16_inputs_accumulate_in_fp32(batch, name):
    batch = dict(batch, entropy=batch["entropy"].bfloat16(), advantages=batch["advantages"].bfloat16(),
                 old_log_prob=batch["old_log_prob"].bfloat16())
    loss, _, grad, lp = _call(name, batch, dtype=torch.bfloat16)
    assert loss.dtype == torch.float32
    assert grad.dtype == torch.bfloat16 and lp.dtype == torch.bfloat16
    assert torch.isfinite(grad.float()).all()


@FAST
@given(batch=batches(), kind=st.sampled_from(["s2t", "prob_only", "high_entropy"]),
       tau_p=st.floats(0, 1), h=st.floats(0, 3))
def test_s2t_mask_shape_and_support(batch, kind, tau_p, h):
    m = batch["response_mask"]
    prob = batch["log_prob"].exp()
    adv = batch["advantages"]
    sil = s2t_mask(adv, prob, batch["entropy"], m, tau_p=tau_p, threshold=h, kind=kind)
    assert sil.shape == m.shape and sil.dtype == torch.bool
    assert not (sil & ~m).any()  # only response tokens
    assert not (sil & (adv <= 0)).any()  # never A <= 0
    assert not (sil & (prob >= tau_p)).any()
