"""Gradient accumulation: with prepare_minibatch's context the micro-batch losses add up exactly.

SPEC: token-mean denominators, STAPO's h* and sum I_t, and (here) WAPO's group normalisers and
PPL weights are mini-batch quantities. The split below cuts prompt 0 in the middle
(rows 0-2 | rows 3-7), the hard case for group statistics.
"""

from __future__ import annotations

import pytest
import torch

from stapoctl.losses import LOSSES, compute_policy_loss, prepare_minibatch, slice_context
from test_losses_methods import GROUPS, make_batch

EXTRAS = dict(group_ids=torch.tensor(GROUPS), global_step=0)
SPLITS = [slice(0, 3), slice(3, 8)]


def _rows(batch, rows):
    out = {k: v[rows] for k, v in batch.items() if k != "log_prob"}
    return out


def _one_shot(name, **cfg):
    batch = make_batch()
    loss, _ = compute_policy_loss(name, **batch, **EXTRAS, **cfg)
    (grad,) = torch.autograd.grad(loss, batch["log_prob"])
    return loss, grad


def _accumulated(name, use_context=True, **cfg):
    batch = make_batch()
    ctx = {}
    if use_context:
        ctx = prepare_minibatch(
            name, log_prob=batch["log_prob"].detach(), advantages=batch["advantages"],
            response_mask=batch["response_mask"], entropy=batch["entropy"],
            old_log_prob=batch["old_log_prob"], **EXTRAS, **cfg,
        )
    total = torch.zeros(())
    for rows in SPLITS:
        extras = {"group_ids": EXTRAS["group_ids"][rows], "global_step": 0}
        loss, _ = compute_policy_loss(
            name, log_prob=batch["log_prob"][rows], **_rows(batch, rows), **extras,
            **slice_context(ctx, rows), **cfg,
        )
        total = total + loss
    (grad,) = torch.autograd.grad(total, batch["log_prob"])
    return total, grad, ctx


@pytest.mark.parametrize("name", list(LOSSES))
def test_sum_of_microbatches_equals_minibatch(name):
    loss, grad = _one_shot(name)
    acc, acc_grad, _ = _accumulated(name)
    assert acc.item() == pytest.approx(loss.item(), abs=1e-7)
    torch.testing.assert_close(acc_grad, grad, atol=1e-7, rtol=0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_every_aggregation_mode_accumulates_exactly(mode):
    loss, grad = _one_shot("stapo", loss_agg_mode=mode)
    acc, acc_grad, _ = _accumulated("stapo", loss_agg_mode=mode)
    assert acc.item() == pytest.approx(loss.item(), abs=1e-7)
    torch.testing.assert_close(acc_grad, grad, atol=1e-7, rtol=0)


def test_context_contents_for_stapo():
    _, _, ctx = _accumulated("stapo")
    # h* = 1.2 and sum I_t = 25 - 2 silenced (see test_losses_methods)
    assert ctx["entropy_threshold"] == pytest.approx(1.2, abs=1e-6)
    assert ctx["loss_denominator"] == 23.0


def test_without_context_each_microbatch_is_its_own_minibatch():
    # a per-micro-batch normalisation (biased; verl 0.9.1 normalises by the mini-batch) is another number
    loss, _ = _one_shot("stapo")
    acc, _, _ = _accumulated("stapo", use_context=False)
    assert acc.item() != pytest.approx(loss.item(), abs=1e-4)


def test_per_microbatch_norm_flag_ignores_the_denominator():
    plain, _, _ = _accumulated("dapo", use_context=False)
    flagged, _, ctx = _accumulated("dapo", per_microbatch_norm=True)
    assert "loss_denominator" not in ctx
    assert flagged.item() == pytest.approx(plain.item(), abs=1e-7)


def test_row_context_must_be_sliced():
    batch = make_batch()
    ctx = prepare_minibatch("wapo", log_prob=batch["log_prob"], advantages=batch["advantages"],
                            response_mask=batch["response_mask"], entropy=batch["entropy"], **EXTRAS)
    with pytest.raises(ValueError, match="slice_context"):
        compute_policy_loss("wapo", log_prob=batch["log_prob"][:3], **_rows(batch, slice(0, 3)),
                            group_ids=EXTRAS["group_ids"][:3], **ctx)


def test_ppl_shaping_prepare_needs_old_log_prob():
    batch = make_batch()
    with pytest.raises(ValueError, match="old_log_prob"):
        prepare_minibatch("ppl_shaping", log_prob=batch["log_prob"], advantages=batch["advantages"],
                          response_mask=batch["response_mask"], entropy=batch["entropy"], **EXTRAS)
