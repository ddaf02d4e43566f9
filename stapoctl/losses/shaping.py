"""Advantage shaping from 003: PPL-based (Eq. 7, 9) and position-based (Eq. 8).

Position READING (SPEC asked to check 003): 003 defines r_t = m * (l_t - n), l_t in [0, 1]
the token's relative position, with m = 15 and n = -0.5 as printed. With n = -0.5,
r in [7.5, 22.5] and sigma(d*r) is constant to 5e-4 (d = +1: the bonus is gamma everywhere;
d = -1: ~0 everywhere), which contradicts 003's "this bonus increases toward the end of the
sequence". n = +0.5 gives r in [-7.5, 7.5] and a bonus rising from ~0 to ~gamma along the
response, so the default shift is +0.5; ``pos_shift=-0.5`` reproduces the printed value.
l_t = t / (|o_i| - 1) for 0-based t (first token 0, last 1; 1 for a one-token response);
``rel_pos_mode="spec"`` uses SPEC's first reading (t + 1) / |o_i| in (0, 1].
"""

from __future__ import annotations

import torch
from torch import Tensor

from stapoctl.config.losses import REL_POS_MODES

from .advantages import group_standardize



def sequence_log_ppl(log_prob: Tensor, mask: Tensor) -> Tensor:
    """ln PPL(o_i) = -mean_t log pi(y_t) over the response tokens; [B] fp32 (0 for empty rows)."""
    m = mask.to(torch.bool)
    lp = torch.where(m, log_prob.detach().float(), 0.0)
    n = m.sum(dim=-1).to(torch.float32)
    return -lp.sum(dim=-1) / n.clamp(min=1.0)


def ppl_weights(
    log_prob: Tensor, mask: Tensor, group_ids: Tensor, *, std_mode: str = "population", eps: float = 1e-6
) -> Tensor:
    """w_ppl(o_i) = (ln PPL(o_i) - mu_g) / sigma_g within the prompt's group; [B] fp32.

    Rows without response tokens are left out of the group statistics and get 0.
    """
    log_ppl = sequence_log_ppl(log_prob, mask)
    valid = mask.to(torch.bool).any(dim=-1)
    w = group_standardize(log_ppl, group_ids, std_mode=std_mode, eps=eps, valid=valid)
    return w.to(torch.float32)


def relative_position(mask: Tensor, mode: str = "closed") -> Tensor:
    """l_t of each response token (see module doc); 0 off the response. Works for any padding side."""
    if mode not in REL_POS_MODES:
        raise ValueError(f"rel_pos_mode={mode!r} is not one of {', '.join(REL_POS_MODES)}")
    m = mask.to(torch.bool)
    idx = torch.cumsum(m.to(torch.float32), dim=-1) - 1.0  # 0-based rank among response tokens
    length = m.sum(dim=-1, keepdim=True).to(torch.float32)
    if mode == "closed":
        rel = torch.where(length > 1, idx / (length - 1.0).clamp(min=1.0), torch.ones_like(idx))
    else:
        rel = (idx + 1.0) / length.clamp(min=1.0)
    return torch.where(m, rel, 0.0)


def position_bonus(
    mask: Tensor,
    *,
    gamma: float,
    direction: float,
    pos_scale: float,
    pos_shift: float,
    rel_pos_mode: str = "closed",
) -> Tensor:
    """b_t = gamma * sigmoid(d * r_t), r_t = m * (l_t - n) (003 Eq. 8); 0 off the response."""
    rel = relative_position(mask, rel_pos_mode)
    b = gamma * torch.sigmoid(direction * pos_scale * (rel - pos_shift))
    return torch.where(mask.to(torch.bool), b, 0.0)
