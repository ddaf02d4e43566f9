"""TR-GRPO token weights (004 Eq. 12)."""

from __future__ import annotations

import torch
from torch import Tensor

from stapoctl.config.losses import TAU_MODES



def tr_grpo_weight(
    log_prob: Tensor,
    *,
    alpha: float = 2.0,
    mu: float = 0.25,
    lower: float = 1.0,
    upper: float = 1.4,
    tau: float = 9.0,
    tau_mode: str = "multiply",
) -> Tensor:
    """w_t = clip(alpha * (sigmoid(z) - mu), L, U) with z = tau*sg[pi] (default) or sg[pi]/tau.

    SPEC reading: 004 prints sigma(pi/tau), which at tau = 9 lies in (0.5, 0.528), so
    2*(sigma - 0.25) < 0.556 and the clip to [1.0, 1.4] gives w = 1 for every token (plain
    DAPO). 004's own description ("sigmoid lies in (0.5, 1)", weights centred in (0.5, 1.5))
    only holds for sigma(tau*pi); that is ``tau_mode="multiply"``, the default. The printed
    form stays available as ``tau_mode="divide"``.
    """
    if tau_mode not in TAU_MODES:
        raise ValueError(f"tau_mode={tau_mode!r} is not one of {', '.join(TAU_MODES)}")
    p = log_prob.detach().float().exp()
    z = p * tau if tau_mode == "multiply" else p / tau
    return (alpha * (torch.sigmoid(z) - mu)).clamp(min=lower, max=upper)
