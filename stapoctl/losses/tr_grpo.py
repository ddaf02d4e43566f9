"""TR-GRPO (004 Eq. 10-12): probability-aware token weights inside the clipped surrogate."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import PolicyBatch
from .config import AggFields, _f
from .pg import clipped_pg_loss
from .registry import register_loss
from .surrogate import LOG_RATIO_CLAMP
from .weights import TAU_MODES, tr_grpo_weight


@dataclass
class TRGRPOConfig(AggFields):
    """TR-GRPO on the project's DAPO base (clip 0.2/0.28, token-mean); KL off like STAPO."""

    name: str = _f("tr_grpo", "registry key of the loss (loss=NAME)")
    alpha: float = _f(2.0, "alpha of w = clip(alpha*(sigmoid(z) - mu), L, U) (004 App. B)")
    mu: float = _f(0.25, "mu of the token weight")
    weight_low: float = _f(1.0, "L: lower clip of the token weight", range="[0, inf)")
    weight_high: float = _f(1.4, "U: upper clip of the token weight", range="[0, inf)")
    tau: float = _f(9.0, "tau of the sigmoid argument (004 sweep: 0.5, 2, 7, 9, 10, 20)", range="(0, inf)")
    tau_mode: str = _f("multiply", "z = tau*pi (multiply, SPEC reading) | pi/tau (divide, as printed: w = 1)",
                       choices=TAU_MODES)
    kl_coef: float = _f(0.0, "beta of the weighted KL term to pi_ref (004 used 0.001); needs ref_log_prob",
                        range="[0, inf)")

    def validate(self) -> None:
        super().validate()
        if self.weight_low > self.weight_high:
            raise ValueError(f"{self.name}: weight_low={self.weight_low} > weight_high={self.weight_high}")


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
