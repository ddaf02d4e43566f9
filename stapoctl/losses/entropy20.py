"""20-Entropy (000 baseline [2], "Beyond the 80/20 rule"): gradient through the top-20% entropy tokens."""

from __future__ import annotations

from stapoctl.config.losses import Entropy20Config

from .batch import PolicyBatch
from .diagnostics import standard_metrics
from .masks import high_entropy_mask, masked_quantile
from .pg import aggregate_with_context, surrogate_of
from .registry import register_loss


@register_loss("entropy20", Entropy20Config)
def entropy20_loss(batch: PolicyBatch, cfg: Entropy20Config):
    """20-Entropy: policy gradient only through the top-20% highest-entropy tokens of the mini-batch."""
    threshold = batch.ctx(
        "select_entropy_threshold",
        lambda: masked_quantile(batch.ent, batch.mask, 1.0 - cfg.top_entropy_frac, cfg.quantile_interpolation),
    )
    keep = high_entropy_mask(batch.ent, batch.mask, threshold)
    sur = surrogate_of(batch, cfg)
    norm_mask = keep if cfg.renormalize else batch.mask
    loss = aggregate_with_context(batch, cfg, -sur.objective, loss_mask=keep, norm_mask=norm_mask)
    return loss, standard_metrics(batch, cfg, sur, loss, keep=keep)
