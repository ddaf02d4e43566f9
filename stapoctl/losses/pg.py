"""Clipped policy-gradient baselines: GRPO, DAPO and the JustRL preset (000 §2.2-2.3)."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from stapoctl.config.losses import DAPOConfig, GRPOConfig, JustRLConfig

from .batch import PolicyBatch
from .diagnostics import standard_metrics
from .registry import register_loss
from .surrogate import Surrogate, aggregate, clipped_surrogate, normaliser


def surrogate_of(batch: PolicyBatch, cfg: Any, *, advantages: Optional[Tensor] = None,
                 weight: Optional[Tensor] = None) -> Surrogate:
    return clipped_surrogate(
        batch.lp,
        batch.old,
        batch.adv if advantages is None else advantages,
        batch.mask,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        weight=weight,
        is_weight=batch.is_weight,
    )


def aggregate_with_context(
    batch: PolicyBatch, cfg: Any, token_loss: Tensor, *, loss_mask: Tensor, norm_mask: Tensor
) -> Tensor:
    """Aggregate with the mini-batch normaliser (context ``loss_denominator``) unless per-micro-batch."""
    t_max = batch.extra("max_response_length") or None  # seq-mean-token-sum-norm's constant (default T)
    if cfg.per_microbatch_norm:
        denominator = normaliser(norm_mask, cfg.loss_agg_mode, t_max=t_max)
    else:
        denominator = batch.ctx("loss_denominator", lambda: normaliser(norm_mask, cfg.loss_agg_mode, t_max=t_max))
    return aggregate(token_loss, loss_mask, cfg.loss_agg_mode, norm_mask=norm_mask, denominator=denominator)


def clipped_pg_loss(batch: PolicyBatch, cfg: Any, *, advantages: Optional[Tensor] = None,
                    weight: Optional[Tensor] = None, extra_token_loss: Optional[Tensor] = None,
                    extra_metrics: Optional[dict] = None):
    """-(aggregated clipped surrogate) over every response token: the shared body of the baselines."""
    sur = surrogate_of(batch, cfg, advantages=advantages, weight=weight)
    token_loss = -sur.objective if extra_token_loss is None else extra_token_loss - sur.objective
    loss = aggregate_with_context(batch, cfg, token_loss, loss_mask=batch.mask, norm_mask=batch.mask)
    return loss, standard_metrics(batch, cfg, sur, loss, keep=batch.mask, extra=extra_metrics)


@register_loss("grpo", GRPOConfig)
def grpo_loss(batch: PolicyBatch, cfg: GRPOConfig):
    """GRPO: clipped surrogate, eps 0.2, seq-mean-token-mean (000 §2.2)."""
    return clipped_pg_loss(batch, cfg)


@register_loss("dapo", DAPOConfig)
def dapo_loss(batch: PolicyBatch, cfg: DAPOConfig):
    """DAPO: clip-higher (0.2, 0.28), token-mean over the mini-batch, optional dual clip (000 §2.3)."""
    return clipped_pg_loss(batch, cfg)


@register_loss("justrl", JustRLConfig)
def justrl_loss(batch: PolicyBatch, cfg: JustRLConfig):
    """JustRL: a preset of DAPO (clip-higher + token-mean, no KL, no entropy bonus)."""
    return clipped_pg_loss(batch, cfg)
