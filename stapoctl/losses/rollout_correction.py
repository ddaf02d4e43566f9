"""Rollout-training mismatch correction: the tokens were sampled by the rollout engine's
distribution π_behav (vLLM, possibly stale weights), not by the π_old the surrogate's ratio
starts from, so each token's surrogate gets a detached weight built from r = π_old/π_behav.

    token_tis   w_t = min(r_t, C)                               (truncated IS, verl rollout_is=token)
    seq_tis     w_t = min(Π_t r_t, C) on every token of the row  (verl rollout_is=sequence)
    token_mask  w_t = 1 if r_t ∈ [1/C, C] else 0                 (verl rollout_rs=token_k1's kept set)
    seq_mask    w_t = 1 if exp(mean_t log r_t) ∈ [1/C, C] else 0 (geometric mean of the row)

``auto`` is token_tis whenever behavior_log_prob is given (the learner passes it only for
stale asynchronous batches); ``off`` applies nothing but still measures. token_mask is not IcePop
(IcePop keeps r_t as the weight inside the band). Rows are whole
sequences in every micro-batch, so the sequence modes need no mini-batch context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from stapoctl.config.losses import ROLLOUT_CORRECTIONS

from .surrogate import LOG_RATIO_CLAMP


@dataclass
class Correction:
    weight: Optional[Tensor]  # [B, T] detached, 0 off the response; None = nothing applied
    metrics: dict[str, Tensor] = field(default_factory=dict)  # rollout_corr/*


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x.float(), 0.0).sum() / m.sum().clamp(min=1)


def resolve_mode(mode: str) -> str:
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout_correction={mode!r} is not one of {', '.join(ROLLOUT_CORRECTIONS)}")
    return "token_tis" if mode == "auto" else mode


def correction_weight(old: Tensor, behav: Tensor, mask: Tensor, mode: str, cap: float) -> tuple[Optional[Tensor],
                                                                                             Tensor]:
    """(weight, or None for ``off``; bool [B, T] of the tokens whose weight is not their raw ratio
    because the cap truncated it or a mask zeroed it). ``old``/``behav``: fp32 log-probs."""
    mode = resolve_mode(mode)
    log_r = torch.where(mask, old - behav, 0.0)
    if mode == "off":
        return None, torch.zeros_like(mask)
    if mode == "seq_tis":  # the sequence's ratio, prod_t r_t
        log_r = log_r.sum(dim=-1, keepdim=True).expand_as(log_r)
    elif mode == "seq_mask":  # the sequence's geometric-mean ratio
        log_r = (log_r.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1))[:, None].expand_as(log_r)
    ratio = torch.exp(log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode in ("token_tis", "seq_tis"):
        return torch.where(mask, ratio.clamp(max=cap), 0.0), mask & (ratio > cap)
    keep = (ratio >= 1.0 / cap) & (ratio <= cap)
    return torch.where(mask & keep, 1.0, 0.0), mask & ~keep


def rollout_correction(old: Tensor, behav: Optional[Tensor], mask: Tensor, *, mode: str = "auto",
                       cap: float = 2.0) -> Correction:
    """The weight to apply and the ``rollout_corr/*`` metrics (none without ``behav``)."""
    resolve_mode(mode)
    if behav is None:
        return Correction(weight=None)
    if cap < 1.0:
        raise ValueError(f"rollout_is_cap={cap} must be >= 1 (the ratios kept lie in [1/C, C])")
    weight, changed = correction_weight(old, behav, mask, mode, cap)
    log_r = torch.where(mask, old - behav, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_r)
    metrics = {
        # k3 estimate of KL(pi_behav || pi_old) from tokens sampled by pi_behav: r - 1 - log r
        "rollout_corr/kl_k3": _masked_mean(ratio - 1.0 - log_r, mask),
        "rollout_corr/ratio_mean": _masked_mean(ratio, mask),
        "rollout_corr/ratio_max": torch.where(mask, ratio, 0.0).max() if ratio.numel() else torch.zeros(()),
        "rollout_corr/weight_mean": _masked_mean(torch.ones_like(ratio) if weight is None else weight, mask),
        "rollout_corr/masked_frac": _masked_mean(changed, mask),
    }
    return Correction(weight=weight, metrics=metrics)
