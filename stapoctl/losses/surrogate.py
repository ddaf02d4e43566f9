"""Clipped surrogate and aggregation modes (SPEC "Policy losses")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from stapoctl.config.losses import AGG_MODES

LOG_RATIO_CLAMP = 20.0  # exp(±20) keeps ratios finite when a policy drifts far (verl does the same)


@dataclass
class Surrogate:
    objective: Tensor  # s_t [B, T] fp32, differentiable w.r.t. log_prob; 0 off the response
    ratio: Tensor  # rho_t (detached); 1 off the response
    clipped: Tensor  # bool: the clipped (zero-gradient) branch was taken
    coef: Tensor  # d s_t / d log pi_t (detached): the token's surrogate coefficient
    log_ratio: Tensor  # log pi - log pi_old (detached), for actor/ppo_kl
    is_weight: Optional[Tensor] = None  # rollout correction weight applied (rollout_correction.py), else None


def clipped_surrogate(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: Optional[float] = None,
    weight: Optional[Tensor] = None,
    is_weight: Optional[Tensor] = None,
) -> Surrogate:
    """s_t = min(w*rho*A, clip(w*rho, 1-eps_low, 1+eps_high)*A), optional dual clip max(s_t, c*A) for A<0.

    ``is_weight`` (detached, outside the clip): the rollout correction s_t ← is_weight_t · s_t
    (``rollout_correction.py``; the decoupled PPO of asynchronous training is its token_tis).

    The min is a ``where`` rather than ``torch.minimum`` so that ties (rho inside the clip range,
    where both branches are equal) give the full unclipped gradient rather than two halves.
    """
    lp = log_prob.float()
    adv = advantages.detach().float()
    log_ratio = torch.where(mask, lp - old_log_prob.detach().float(), 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    r = ratio if weight is None else ratio * weight.detach().float()
    s_unclipped = r * adv
    s_clipped = r.detach().clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high) * adv
    use_clipped = s_clipped < s_unclipped
    s = torch.where(use_clipped, s_clipped, s_unclipped)
    if clip_ratio_c is not None:
        floor = clip_ratio_c * adv
        dual = (adv < 0) & (s < floor)
        s = torch.where(dual, floor, s)
        use_clipped = use_clipped | dual
    use_clipped = use_clipped & mask
    coef = torch.where(use_clipped | ~mask, 0.0, (r * adv).detach())
    if is_weight is not None:
        w = is_weight.detach().float()
        s, coef = s * w, coef * w
    s = torch.where(mask, s, 0.0)
    return Surrogate(objective=s, ratio=ratio.detach(), clipped=use_clipped, coef=coef, log_ratio=log_ratio.detach(),
                     is_weight=is_weight)


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is not one of {', '.join(AGG_MODES)}")


def normaliser(norm_mask: Tensor, mode: str, *, t_max: Optional[float] = None) -> Tensor:
    """Denominator of ``mode``: token count for token-mean, count of non-empty rows otherwise.

    seq-mean-token-sum-norm (Dr. GRPO) folds its constant T_max (``t_max``, default the tensor's
    T) into the denominator, so a context recorded on the mini-batch carries it to micro-batches.
    """
    _check_mode(mode)
    if mode == "token-mean":
        return norm_mask.sum().to(torch.float32)
    rows = norm_mask.any(dim=-1).sum().to(torch.float32)
    if mode == "seq-mean-token-sum-norm":
        return rows * float(norm_mask.shape[-1] if t_max is None else t_max)
    return rows


def aggregate(
    token_loss: Tensor,
    loss_mask: Tensor,
    mode: str,
    *,
    norm_mask: Optional[Tensor] = None,
    denominator: Optional[Tensor] = None,
    t_max: Optional[float] = None,
) -> Tensor:
    """Scalar fp32 loss from per-token terms.

    ``loss_mask``: tokens whose term enters the sum; ``norm_mask``: tokens counted by the
    normaliser (defaults to ``loss_mask``); ``denominator``: the mini-batch normaliser when the
    call is one micro-batch of it; ``t_max``: seq-mean-token-sum-norm's constant (default T).
    An empty sum gives 0 with zero gradient (the denominator is clamped to >= 1; nothing
    branches, so the graph stays connected).
    """
    norm_mask = loss_mask if norm_mask is None else norm_mask
    terms = torch.where(loss_mask, token_loss.float(), 0.0)
    if denominator is None:
        denominator = normaliser(norm_mask, mode, t_max=t_max)
    else:
        _check_mode(mode)
    denominator = torch.as_tensor(denominator, dtype=torch.float32, device=terms.device).clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        per_row = terms.sum(dim=-1) / norm_mask.sum(dim=-1).to(torch.float32).clamp(min=1.0)
        total = per_row.sum()
    else:
        total = terms.sum()
    return total / denominator
