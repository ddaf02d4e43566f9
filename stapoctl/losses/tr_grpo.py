"""TR-GRPO (004 Eq. 10-12): probability-aware token weights inside the clipped surrogate."""

from __future__ import annotations

import torch

from stapoctl.config.losses import TRGRPOConfig

from .batch import PolicyBatch
from .pg import aggregate_with_context, clipped_pg_loss
from .registry import register_loss
from .surrogate import LOG_RATIO_CLAMP
from .weights import tr_grpo_weight


@register_loss("tr_grpo", TRGRPOConfig)
def tr_grpo_loss(batch: PolicyBatch, cfg: TRGRPOConfig):
    """TR-GRPO: min(w*rho*A, clip(w*rho, 1-eps_l, 1+eps_h)*A), w from sg[pi] (004 Eq. 10, 12).

    kl_estimator=tr_weighted (default) adds 004 Eq. 11's weighted KL to each token's loss here;
    k1/k2/k3/abs go through the shared regularizer like every loss."""
    w = tr_grpo_weight(
        batch.lp, alpha=cfg.alpha, mu=cfg.mu, lower=cfg.weight_low, upper=cfg.weight_high,
        tau=cfg.tau, tau_mode=cfg.tau_mode,
    )
    kl = None
    if cfg.kl_coef > 0 and cfg.kl_estimator == "tr_weighted":  # other estimators: regularizers.py
        ref = batch.token_tensor("ref_log_prob")
        if ref is None:
            raise ValueError("loss 'tr_grpo' with kl_coef > 0 needs the keyword argument ref_log_prob=...")
        # D = x - log x - 1 with x = w * pi_ref / pi (004 Eq. 11), in log space for stability
        log_x = (torch.log(w) + ref - batch.lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        d = torch.exp(log_x) - log_x - 1.0
        kl = cfg.kl_coef * d
    m = batch.mask
    extra = {"tr_grpo/weight_mean": torch.where(m, w, 0.0).sum() / m.sum().clamp(min=1)}
    if kl is not None:  # D before beta, as verl logs actor/kl_loss; a micro-batch's share, like pg_loss
        extra["actor/kl_loss"] = aggregate_with_context(batch, cfg, d.detach(), loss_mask=m, norm_mask=m)
    return clipped_pg_loss(batch, cfg, weight=w, extra_token_loss=kl, extra_metrics=extra)
