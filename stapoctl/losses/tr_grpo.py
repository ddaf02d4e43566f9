"""TR-GRPO (004 Eq. 10-12): probability-aware token weights inside the clipped surrogate."""

from __future__ import annotations

import torch

from stapoctl.config.losses import TRGRPOConfig

from .batch import PolicyBatch
from .pg import clipped_pg_loss
from .registry import register_loss
from .surrogate import LOG_RATIO_CLAMP
from .weights import tr_grpo_weight


@register_loss("tr_grpo", TRGRPOConfig)
def tr_grpo_loss(batch: PolicyBatch, cfg: TRGRPOConfig):
    """TR-GRPO: min(w*rho*A, clip(w*rho, 1-eps_l, 1+eps_h)*A), w from sg[pi] (004 Eq. 10, 12)."""
    w = tr_grpo_weight(
        batch.lp, alpha=cfg.alpha, mu=cfg.mu, lower=cfg.weight_low, upper=cfg.weight_high,
        tau=cfg.tau, tau_mode=cfg.tau_mode,
    )
    kl = None
    if cfg.kl_coef > 0:
        ref = batch.token_tensor("ref_log_prob")
        if ref is None:
            raise ValueError("loss 'tr_grpo' with kl_coef > 0 needs the keyword argument ref_log_prob=...")
        # D = x - log x - 1 with x = w * pi_ref / pi (004 Eq. 11), in log space for stability
        log_x = (torch.log(w) + ref - batch.lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = cfg.kl_coef * (torch.exp(log_x) - log_x - 1.0)
    m = batch.mask
    extra = {"tr_grpo/weight_mean": torch.where(m, w, 0.0).sum() / m.sum().clamp(min=1)}
    if kl is not None:
        extra["actor/kl_loss"] = torch.where(m, kl.detach(), 0.0).sum() / m.sum().clamp(min=1)
    return clipped_pg_loss(batch, cfg, weight=w, extra_token_loss=kl, extra_metrics=extra)
