"""STAPO (000 Eq. 1, Alg. 1) and the masking ablations of 000 Fig. 5: presets of the token-rule
engine. Each config's ``preset_rules()`` is its S2T rule, e.g. STAPO's
``{adv: pos, prob: [0, tau_p], entropy_q: [0, 1 - tau_h], action: mask}`` (renormalised: the
denominator is sum_t I_t), applied on the DAPO surrogate by ``clipped_pg_loss``."""

from __future__ import annotations

from stapoctl.config.losses import STAPOConfig, STAPOHighEntropyConfig, STAPOProbOnlyConfig

from .batch import PolicyBatch
from .pg import clipped_pg_loss
from .registry import register_loss


@register_loss("stapo", STAPOConfig)
def stapo_loss(batch: PolicyBatch, cfg: STAPOConfig):
    """STAPO: silence A > 0 and pi < tau_p and H < h*, renormalise (000 Eq. 1)."""
    return clipped_pg_loss(batch, cfg)


@register_loss("stapo_prob_only", STAPOProbOnlyConfig)
def stapo_prob_only_loss(batch: PolicyBatch, cfg: STAPOProbOnlyConfig):
    """STAPO ablation (000 Fig. 5): silence A > 0 and pi < tau_p."""
    return clipped_pg_loss(batch, cfg)


@register_loss("stapo_high_entropy", STAPOHighEntropyConfig)
def stapo_high_entropy_loss(batch: PolicyBatch, cfg: STAPOHighEntropyConfig):
    """STAPO ablation (000 Fig. 5): silence A > 0 and pi < tau_p and H >= h*."""
    return clipped_pg_loss(batch, cfg)
