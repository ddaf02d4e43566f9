"""Per-token estimates of KL(π_θ || π_ref) from the sampled tokens (Schulman, "Approximating KL
divergence", 2020), on the current policy's log-probs so the gradient flows through them.

    k1  = log π − log π_ref
    k2  = ½ (log π − log π_ref)²
    k3  = π_ref/π − log(π_ref/π) − 1      (verl "low_var_kl"; ≥ 0, unbiased, low variance)
    abs = |log π − log π_ref|

k3 is computed in log space with the log ratio clamped like the surrogate's (±20), then its
value is clamped to [−clamp, clamp] (``kl_clamp``, default 10 as verl 0.9.1; 0 = off). Its
gradient 1 − π_ref/π grows without bound as π → 0 under π_ref, exactly on the low-probability
tokens this project studies; the clamp zeroes it once k3 > clamp (log(π_ref/π) ≳ 2.6 at 10).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .surrogate import LOG_RATIO_CLAMP

ESTIMATORS = ("k1", "k2", "k3", "abs")
DEFAULT_K3_CLAMP = 10.0  # verl 0.9.1 kl_penalty_forward: torch.clamp(kld, min=-10, max=10)


def kl_estimate(log_prob: Tensor, ref_log_prob: Tensor, estimator: str = "k3",
                clamp: float = DEFAULT_K3_CLAMP) -> Tensor:
    """[B, T] fp32 per-token KL estimate; differentiable w.r.t. ``log_prob``, ``ref_log_prob`` detached.
    ``clamp`` bounds k3's value (and so zeroes its gradient beyond); 0 leaves it unbounded."""
    lp = log_prob.float()
    ref = ref_log_prob.detach().float()
    if estimator == "k1":
        return lp - ref
    if estimator == "k2":
        return 0.5 * (lp - ref).square()
    if estimator == "abs":
        return (lp - ref).abs()
    if estimator == "k3":
        log_x = (ref - lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.exp(log_x) - log_x - 1.0
        return k3.clamp(-clamp, clamp) if clamp > 0 else k3
    raise ValueError(f"kl_estimator={estimator!r} is not one of {', '.join(ESTIMATORS)} here "
                     "(tr_weighted is TR-GRPO's own term)")
