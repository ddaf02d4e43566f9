"""STAPO (000 Eq. 1, Alg. 1) and the masking ablations of 000 Fig. 5."""

from __future__ import annotations

from stapoctl.config.losses import STAPOConfig, STAPOHighEntropyConfig, STAPOProbOnlyConfig

from .batch import PolicyBatch
from .diagnostics import standard_metrics
from .masks import entropy_threshold, s2t_mask
from .pg import aggregate_with_context, surrogate_of
from .registry import register_loss


def s2t_loss(batch: PolicyBatch, cfg: STAPOConfig, kind: str):
    """J = sum_t I_t s_t / sum_t I_t with I_t from the mini-batch h* and the current pi, H."""
    h = batch.ctx(
        "entropy_threshold",
        lambda: entropy_threshold(batch.ent, batch.mask, cfg.tau_h, cfg.quantile_interpolation),
    )
    silenced = s2t_mask(batch.adv, batch.prob, batch.ent, batch.mask, tau_p=cfg.tau_p, threshold=h, kind=kind)
    keep = batch.mask & ~silenced
    sur = surrogate_of(batch, cfg)
    norm_mask = keep if cfg.renormalize else batch.mask
    loss = aggregate_with_context(batch, cfg, -sur.objective, loss_mask=keep, norm_mask=norm_mask)
    return loss, standard_metrics(batch, cfg, sur, loss, keep=keep, silenced=silenced)


@register_loss("stapo", STAPOConfig)
def stapo_loss(batch: PolicyBatch, cfg: STAPOConfig):
    """STAPO: silence A > 0 and pi < tau_p and H < h*, renormalise (000 Eq. 1)."""
    return s2t_loss(batch, cfg, "s2t")


@register_loss("stapo_prob_only", STAPOProbOnlyConfig)
def stapo_prob_only_loss(batch: PolicyBatch, cfg: STAPOProbOnlyConfig):
    """STAPO ablation (000 Fig. 5): silence A > 0 and pi < tau_p."""
    return s2t_loss(batch, cfg, "prob_only")


@register_loss("stapo_high_entropy", STAPOHighEntropyConfig)
def stapo_high_entropy_loss(batch: PolicyBatch, cfg: STAPOHighEntropyConfig):
    """STAPO ablation (000 Fig. 5): silence A > 0 and pi < tau_p and H >= h*."""
    return s2t_loss(batch, cfg, "high_entropy")
