"""Published token-level methods beyond the seed papers, written as presets of the rule engine
(docs/LOSSES.md "Published methods as rules", with the equations and where they were read):

- STARE (arXiv 2606.19236): the top-P surprisal tokens of the Â > 0 tokens (L+) have their
  clipped-surrogate term × W while the batch's mean entropy is below H_tgt (``STAREConfig``).
- Advantage Reweighting (arXiv 2505.12929): every token's advantage × (α·π_old + 1 − α)
  (``AdvantageReweightingConfig``); the same paper's Lopti is two updates per mini-batch, not a rule.
"""

from __future__ import annotations

from stapoctl.config.losses import AdvantageReweightingConfig, STAREConfig

from .batch import PolicyBatch
from .pg import clipped_pg_loss
from .registry import register_loss


@register_loss("stare", STAREConfig)
def stare_loss(batch: PolicyBatch, cfg: STAREConfig):
    """STARE (O1, static W): Â > 0 tokens in the bottom P of π × W while the batch's H̄ < H_tgt."""
    return clipped_pg_loss(batch, cfg)


@register_loss("advantage_reweighting", AdvantageReweightingConfig)
def advantage_reweighting_loss(batch: PolicyBatch, cfg: AdvantageReweightingConfig):
    """Advantage Reweighting: GRPO with Â_t × (α·π_old(y_t) + 1 − α), damping low-probability tokens."""
    return clipped_pg_loss(batch, cfg)
