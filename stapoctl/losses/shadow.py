"""Shadow rules (`loss.shadow`, config/shadow_rules.py) and the rollout mismatch per token category:
measured on every trained batch, never applied, so a GRPO run can say what STAPO would silence.

Per shadow S (the tokens any of its rules takes), over the mini-batch's response tokens M:

    shadow/<name>/token_share    |S| / |M|
    shadow/<name>/pos_adv_share  |S ∩ {Â > 0}| / |{Â > 0}|
    shadow/<name>/grad_share     Σ_{t∈S} G_t / Σ_{t∈M} G_t   (NaN in a mini-batch with no gradient: every
                                 Â = 0; the step's value is the mean over the mini-batches that have one)
    shadow/<name>/abs_dlogp      mean over S of |log π_old − log π_behav|   (with behaviour log-probs)

G_t is `diagnostics.lmhead_grad_norm` of the method's surrogate (passed in by `standard_metrics`).
The rollout–training mismatch is also split by 000 Table 1's eight cells whenever the behaviour
log-probs are given: ``rollout_corr/abs_dlogp/<cell>`` (and ``rollout_corr/abs_dlogp`` over M).
Every value is a mini-batch statistic read through ``batch.ctx``: ``prepare_minibatch`` computes it
once, so micro-batches and data-parallel ranks report the one-shot value.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from stapoctl.config.shadow_rules import cell_rules

from .batch import PolicyBatch
from .rules import condition, evaluate_rules

SHADOW_PREFIX = "shadow/"
MISMATCH = "rollout_corr/abs_dlogp"


def _ratio(num: Tensor, den: Tensor, empty: float = 0.0) -> Tensor:
    """num / den; `empty` where den is 0 (an empty set has no share; no gradient at all has no
    gradient share: NaN, which the learner's step mean leaves out rather than count as 0)."""
    den = den.float()
    return torch.where(den > 0, num.float() / den.clamp(min=1e-30), empty)


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x.float(), 0.0).sum() / m.sum().clamp(min=1)


def from_context(batch: PolicyBatch, keys: list[str], compute: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
    """Mini-batch values of ``keys``: from the context when every one is there, else computed from this
    call's tensors (and recorded, in ``prepare_minibatch``)."""
    if all(k in batch.context for k in keys):
        return {k: batch.ctx(k, lambda: torch.zeros(())) for k in keys}
    values = compute()
    return {k: batch.ctx(k, lambda v=values[k]: v) for k in keys}


def shadow_tokens(batch: PolicyBatch, cfg: Any, rules: tuple) -> Tensor:
    """bool [B, T]: the response tokens any of ``rules`` takes (first match wins, as when applied)."""
    taken = evaluate_rules(batch, cfg, rules).taken
    out = torch.zeros_like(batch.mask)
    for hit in taken:
        out = out | hit
    return out


def _shadow_values(batch: PolicyBatch, cfg: Any, rules: tuple, g: Tensor, dlogp) -> dict[str, Tensor]:
    s = shadow_tokens(batch, cfg, rules)
    pos = batch.mask & (batch.adv > 0)
    g = torch.where(batch.mask, g.float(), 0.0)
    out = {"token_share": _ratio(s.sum(), batch.mask.sum()), "pos_adv_share": _ratio((s & pos).sum(), pos.sum()),
           "grad_share": _ratio(torch.where(s, g, 0.0).sum(), g.sum(), empty=float("nan"))}
    if dlogp is not None:
        out["abs_dlogp"] = _masked_mean(dlogp, s)
    return out


def abs_dlogp(batch: PolicyBatch):
    """|log π_old − log π_behav| [B, T] on the response (0 elsewhere), None without behaviour log-probs."""
    behav = batch.token_tensor("behavior_log_prob")
    return None if behav is None else torch.where(batch.mask, (batch.old - behav).abs(), 0.0)


def shadow_metrics(batch: PolicyBatch, cfg: Any, g: Tensor) -> dict[str, Tensor]:
    """``shadow/<name>/*`` of every shadow of the config (none without ``shadow``)."""
    shadows = cfg.shadows() if hasattr(cfg, "shadows") else ()
    if not shadows:
        return {}
    dlogp = abs_dlogp(batch)
    out: dict[str, Tensor] = {}
    for name, rules in shadows:
        parts = ["token_share", "pos_adv_share", "grad_share"] + (["abs_dlogp"] if dlogp is not None else [])
        keys = [f"{SHADOW_PREFIX}{name}/{p}" for p in parts]
        out.update(from_context(batch, keys, lambda rules=rules, keys=keys: dict(zip(
            keys, _shadow_values(batch, cfg, rules, g, dlogp).values()))))
    return out


def mismatch_metrics(batch: PolicyBatch, cfg: Any) -> dict[str, Tensor]:
    """``rollout_corr/abs_dlogp[/<cell>]``: the mean |Δlogp| over the response and over each of 000
    Table 1's cells (τ_p, h* as the S2T metrics take them); none without behaviour log-probs."""
    dlogp = abs_dlogp(batch)
    if dlogp is None or not hasattr(cfg, "tau_p"):
        return {}
    cells = cell_rules(cfg.tau_p, cfg.tau_h)
    keys = [MISMATCH] + [f"{MISMATCH}/{rule.name}" for rule in cells]

    def compute() -> dict[str, Tensor]:
        values = [_masked_mean(dlogp, batch.mask)]
        values += [_masked_mean(dlogp, condition(batch, cfg, rule)) for rule in cells]
        return dict(zip(keys, values))

    return from_context(batch, keys, compute)
