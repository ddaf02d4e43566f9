"""Entry points: compute_policy_loss (one micro-batch) and prepare_minibatch (its context)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .batch import PolicyBatch
from .diagnostics import to_floats
from .registry import EXTRA_KEYS, resolve
from .regularizers import record_context, regularizer_loss
from .rollout_correction import rollout_correction


def _apply_rollout_correction(batch: PolicyBatch, conf: Any) -> None:
    """The weight every method's surrogate multiplies (``batch.is_weight``) and its metrics."""
    cap = getattr(conf, "rollout_is_cap", None) or float(batch.extras.get("is_cap") or 2.0)
    corr = rollout_correction(batch.old, batch.token_tensor("behavior_log_prob"), batch.mask,
                              mode=getattr(conf, "rollout_correction", "auto"), cap=cap)
    batch.is_weight = corr.weight
    batch.metric_terms.update(corr.metrics)


def compute_policy_loss(
    name: Any, /, *, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
    entropy: Tensor, **cfg: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Loss to minimise (fp32 scalar, differentiable w.r.t. log_prob, and w.r.t. entropy when
    ``entropy_coef != 0`` and the entropy carries a gradient) and metrics.

    ``name`` is the loss's config instance (the learner's, built once: no config per micro-batch)
    or its name, and then ``cfg`` takes the config's fields too (``dataclasses.asdict(cfg)`` works,
    ``name`` included); beside them the extra inputs and the mini-batch context listed in
    ``registry``. Without a context the call is its own mini-batch. loss = method's pg − c·agg(H) +
    β·agg(KL) (verl).
    """
    spec, conf, extras, context = resolve(name, cfg)
    batch = PolicyBatch(
        log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask,
        entropy=entropy, extras=extras, context=context,
    )
    _apply_rollout_correction(batch, conf)
    reg = regularizer_loss(batch, conf)
    loss, metrics = spec.fn(batch, conf)
    missing = {k: v for k, v in batch.metric_terms.items() if k not in metrics}
    if missing:  # a method that does not return standard_metrics
        metrics.update(to_floats(missing))
    if reg is not None:
        loss = loss + reg
    return loss, metrics


def prepare_minibatch(
    name: Any, /, *, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, entropy: Tensor, **cfg: Any
) -> dict[str, Any]:
    """Mini-batch statistics to pass as kwargs into every micro-batch ``compute_policy_loss``.

    All inputs are the (detached) tensors of the whole mini-batch, from the current policy
    (000 Alg. 1 line 8). Returns floats (``entropy_threshold``, ``loss_denominator``,
    ``reg_denominator``, ...) and [B] tensors under ``row_*`` keys, to be sliced per
    micro-batch with ``slice_context``. With it, the sum over micro-batches of loss (and
    gradient) equals the one-shot mini-batch value. ``old_log_prob`` may be passed
    (ppl_shaping needs it); ``behavior_log_prob`` only by the measured values (shadow rules' G_t, the
    mismatch per category), ``ref_log_prob`` only by tr_grpo's own tr_weighted KL. ``name``: as
    in ``compute_policy_loss`` (a config instance or a loss name).
    """
    old_log_prob = cfg.pop("old_log_prob", None)
    spec, conf, extras, context = resolve(name, cfg, extra_keys=EXTRA_KEYS)
    if context:
        raise ValueError(f"prepare_minibatch computes the context itself; drop {sorted(context)}")
    with torch.no_grad():
        batch = PolicyBatch(
            log_prob=log_prob.detach(), old_log_prob=None if old_log_prob is None else old_log_prob.detach(),
            advantages=advantages, response_mask=response_mask, entropy=entropy.detach(), extras=extras,
        )
        _apply_rollout_correction(batch, conf)  # the surrogate coefficients of shadow.py's G_t carry it
        record_context(batch, conf)
        spec.fn(batch, conf)
    return batch.exported_context()
