"""Entry points: compute_policy_loss (one micro-batch) and prepare_minibatch (its context)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .batch import PolicyBatch
from .registry import EXTRA_KEYS, get_spec, split_kwargs


def compute_policy_loss(
    name: str, /, *, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
    entropy: Tensor, **cfg: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Loss to minimise (fp32 scalar, differentiable w.r.t. log_prob) and metrics.

    ``cfg`` takes the loss config's fields (``dataclasses.asdict(cfg)`` works, ``name``
    included), the extra inputs and the mini-batch context listed in ``registry``. Without a
    context the call is its own mini-batch.
    """
    spec = get_spec(name)
    conf, extras, context = split_kwargs(spec, cfg)
    batch = PolicyBatch(
        log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask,
        entropy=entropy, extras=extras, context=context,
    )
    loss, metrics = spec.fn(batch, conf)
    return loss, metrics


def prepare_minibatch(
    name: str, /, *, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, entropy: Tensor, **cfg: Any
) -> dict[str, Any]:
    """Mini-batch statistics to pass as kwargs into every micro-batch ``compute_policy_loss``.

    All inputs are the (detached) tensors of the whole mini-batch, from the current policy
    (000 Alg. 1 line 8). Returns floats (``entropy_threshold``, ``loss_denominator``, ...) and
    [B] tensors under ``row_*`` keys, to be sliced per micro-batch with ``slice_context``.
    With it, the sum over micro-batches of loss (and gradient) equals the one-shot mini-batch
    value. ``old_log_prob`` may be passed (ppl_shaping needs it).
    """
    spec = get_spec(name)
    old_log_prob = cfg.pop("old_log_prob", None)
    conf, extras, context = split_kwargs(spec, cfg, extra_keys=EXTRA_KEYS)
    if context:
        raise ValueError(f"prepare_minibatch computes the context itself; drop {sorted(context)}")
    with torch.no_grad():
        batch = PolicyBatch(
            log_prob=log_prob.detach(), old_log_prob=None if old_log_prob is None else old_log_prob.detach(),
            advantages=advantages, response_mask=response_mask, entropy=entropy, extras=extras,
        )
        spec.fn(batch, conf)
    return batch.exported_context()
