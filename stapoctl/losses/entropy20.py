"""20-Entropy (000 baseline [2], "Beyond the 80/20 rule"): gradient through the top-20% entropy
tokens. A preset of the token-rule engine: ``{entropy_q: [0, 1 - top_entropy_frac], action: mask,
renorm: false}`` (``Entropy20Config.preset_rules``) on the DAPO surrogate."""

from __future__ import annotations

from stapoctl.config.losses import Entropy20Config

from .batch import PolicyBatch
from .pg import clipped_pg_loss
from .registry import register_loss


@register_loss("entropy20", Entropy20Config)
def entropy20_loss(batch: PolicyBatch, cfg: Entropy20Config):
    """20-Entropy: policy gradient only through the top-20% highest-entropy tokens of the mini-batch."""
    return clipped_pg_loss(batch, cfg)
