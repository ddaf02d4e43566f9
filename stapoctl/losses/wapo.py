"""WAPO (002 Eq. 8): winners only, constant 1/(G*T_max) normalisation per prompt.

J = E_x[ 1/(G*T_max) sum_i sum_t A+_i * min(rho_it, 1+eps) | exists i: A+_i > 0 ],
A+ = max(A, 0). The expectation over prompts is conditional on a winner: the mini-batch
estimate averages over the prompts that have one (``prompt_norm="winners"``), so prompts
without a winner contribute nothing, not even to the average; ``prompt_norm="all"`` divides
by every prompt of the mini-batch instead. ``winner_norm="winners"`` is 002's G*r_bar variant
(number of winners in the group instead of G). For A+ >= 0 the clipped surrogate
min(rho*A, clip(rho, 1-eps_l, 1+eps_h)*A) equals A*min(rho, 1+eps_h): the lower bound is
inactive (002 §4), so the shared surrogate is reused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stapoctl.config.losses import WAPOConfig

from .advantages import group_index
from .batch import PolicyBatch
from .diagnostics import standard_metrics
from .pg import apply_rules, surrogate_of
from .registry import register_loss


def wapo_row_weights(
    advantages: Tensor, mask: Tensor, group_ids: Tensor, *, t_max: int, winner_norm: str = "group",
    prompt_norm: str = "winners",
) -> Tensor:
    """Per-row factor 1/(D_x * T_max * N_prompts) for rows of prompts with a winner, else 0; [B] fp32."""
    winner_row = (mask.to(torch.bool) & (advantages > 0)).any(dim=-1).to(torch.float32)
    idx, n_groups = group_index(group_ids.to(advantages.device))
    size = torch.zeros(n_groups, device=advantages.device).index_add_(0, idx, torch.ones_like(winner_row))
    winners = torch.zeros(n_groups, device=advantages.device).index_add_(0, idx, winner_row)
    has_winner = winners > 0
    divisor = size if winner_norm == "group" else winners
    n_prompts = has_winner.sum().to(torch.float32) if prompt_norm == "winners" else torch.tensor(float(n_groups))
    per_group = 1.0 / (divisor.clamp(min=1.0) * float(t_max) * n_prompts.clamp(min=1.0))
    return torch.where(has_winner, per_group, 0.0)[idx]


@register_loss("wapo", WAPOConfig)
def wapo_loss(batch: PolicyBatch, cfg: WAPOConfig):
    """WAPO: winners-only clipped PG with constant 1/(G*T_max) normalisation (002 Eq. 8). Needs group_ids."""
    group_ids = batch.row_tensor("group_ids", required_by="wapo", dtype=torch.long)
    t_max = batch.extra("max_response_length") or batch.T
    row_w = batch.ctx(
        "row_weight",
        lambda: wapo_row_weights(
            batch.adv, batch.mask, group_ids, t_max=int(t_max), winner_norm=cfg.winner_norm,
            prompt_norm=cfg.prompt_norm,
        ),
    )
    adv_pos = batch.adv.clamp(min=0.0)
    sur = surrogate_of(batch, cfg, advantages=adv_pos)
    keep = batch.mask & (adv_pos > 0) & (row_w[:, None] > 0)
    outcome, _, metrics = apply_rules(batch, cfg)  # token_rules: WAPO has no denominator, so renorm is moot
    objective = sur.objective if outcome is None else outcome.scaled(sur.objective)
    keep = keep if outcome is None else keep & outcome.keep
    terms = torch.where(keep, objective * row_w[:, None], 0.0)
    loss = -terms.sum()
    return loss, standard_metrics(batch, cfg, sur, loss, keep=keep, extra=metrics or None)
