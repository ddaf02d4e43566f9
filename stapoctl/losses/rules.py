"""The token-rule engine: which tokens each rule takes and what it does to their loss terms.

Rules (``config.token_rules``: the grammar, parsing and checks) are evaluated in order and each
response token takes the action of the first rule whose condition it meets. The outcome is applied
by the methods at their aggregation (``pg.clipped_pg_loss``, ``wapo``): a masked token leaves the
sum (and, with ``renorm``, the denominator: STAPO's Σ I_t), a scaled or weighted token's term is
multiplied by a detached factor. Entropy quantiles are mini-batch statistics read through
``batch.ctx`` under ``entropy_q=<q>`` keys, so micro-batches see the one-shot values. The KL and
entropy terms are never touched (as STAPO's mask never touches them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from stapoctl.config.token_rules import TOKEN_WEIGHT_FNS, Band, TokenRule

from .batch import PolicyBatch
from .masks import masked_quantile

QUANTILE_KEY = "entropy_q="  # context key prefix: entropy_q=0.8 holds quantile(H over M, 0.8)
PROB_QUANTILE_KEY = "prob_q="  # prob_q=pos:0.1 holds quantile(π over the Â > 0 response tokens, 0.1)
MEAN_ENTROPY_KEY = "mean_entropy"  # the mini-batch's mean H over its response tokens
TOKEN_WEIGHTS: dict[str, Callable[[PolicyBatch], Tensor]] = {}


def register_token_weight(name: str) -> Callable:
    """Decorator: ``fn(batch) -> [B, T]`` becomes ``action: weight, fn: NAME`` (the factor is detached)."""

    def deco(fn: Callable[[PolicyBatch], Tensor]) -> Callable[[PolicyBatch], Tensor]:
        if name in TOKEN_WEIGHTS:
            raise ValueError(f"token weight {name!r} is already registered")
        TOKEN_WEIGHTS[name] = fn
        TOKEN_WEIGHT_FNS.add(name)  # config checks (torch-free) accept it from now on
        return fn

    return deco


@register_token_weight("prob")
def _prob(batch: PolicyBatch) -> Tensor:
    """π(y_t) of the current policy."""
    return batch.prob


@register_token_weight("one_minus_prob")
def _one_minus_prob(batch: PolicyBatch) -> Tensor:
    """1 − π(y_t): up-weights the unlikely tokens."""
    return 1.0 - batch.prob


@register_token_weight("old_prob")
def _old_prob(batch: PolicyBatch) -> Tensor:
    """π_old(y_t), the policy before this step's updates (Advantage Reweighting's π)."""
    return torch.where(batch.mask, batch.old.exp(), 0.0)


@register_token_weight("surprisal")
def _surprisal(batch: PolicyBatch) -> Tensor:
    """−log π(y_t) (the token's surprisal, in nats)."""
    return -batch.lp.detach()


@dataclass
class RuleOutcome:
    keep: Tensor  # bool [B, T]: response tokens left in the sum
    norm: Tensor  # bool [B, T]: response tokens the denominator counts
    weight: Optional[Tensor] = None  # [B, T] detached factor of each term; None = 1 everywhere
    taken: list[Tensor] = field(default_factory=list)  # per rule: the tokens that took its action

    def scaled(self, token_loss: Tensor) -> Tensor:
        return token_loss if self.weight is None else token_loss * self.weight


def entropy_quantile(batch: PolicyBatch, cfg, q: float) -> Tensor:
    """quantile(H over the mini-batch's response tokens, q), as STAPO's h* (context ``entropy_q=<q>``)."""
    interpolation = getattr(cfg, "quantile_interpolation", "linear")
    return batch.ctx(f"{QUANTILE_KEY}{float(q)!r}",
                     lambda: masked_quantile(batch.ent, batch.mask, float(q), interpolation))


def prob_quantile(batch: PolicyBatch, cfg, adv: str, q: float) -> Tensor:
    """quantile(π over the mini-batch's response tokens of advantage sign ``adv``, q) (STARE's L±)."""
    sign = {"pos": batch.adv > 0, "neg": batch.adv < 0}.get(adv, batch.mask)
    interpolation = getattr(cfg, "quantile_interpolation", "linear")
    return batch.ctx(f"{PROB_QUANTILE_KEY}{adv}:{float(q)!r}",
                     lambda: masked_quantile(batch.prob, batch.mask & sign, float(q), interpolation))


def mean_entropy(batch: PolicyBatch) -> Tensor:
    """The mini-batch's mean H over its response tokens (a rule's gate: STARE's H̄ < H_tgt)."""
    return batch.ctx(MEAN_ENTROPY_KEY, lambda: batch.ent.sum() / batch.mask.sum().clamp(min=1))


def _in_band(x: Tensor, band: Band, bound: Callable[[float], object] = float) -> Tensor:
    low, high = band
    out = torch.ones_like(x, dtype=torch.bool)
    if low is not None:
        out = out & (x >= bound(low))
    if high is not None:
        out = out & (x < bound(high))
    return out


def condition(batch: PolicyBatch, cfg, rule: TokenRule) -> Tensor:
    """bool [B, T]: the response tokens meeting every condition of ``rule``."""
    hit = batch.mask
    if rule.adv != "any":
        hit = hit & ((batch.adv > 0) if rule.adv == "pos" else (batch.adv < 0))
    if rule.prob is not None:
        hit = hit & _in_band(batch.prob, rule.prob)
    if rule.entropy is not None:
        hit = hit & _in_band(batch.ent, rule.entropy)
    if rule.entropy_q is not None:
        hit = hit & _in_band(batch.ent, rule.entropy_q, lambda q: entropy_quantile(batch, cfg, q))
    if rule.prob_q is not None:
        hit = hit & _in_band(batch.prob, rule.prob_q, lambda q: prob_quantile(batch, cfg, rule.adv, q))
    if rule.mean_entropy is not None:
        hit = hit & _in_band(mean_entropy(batch).expand_as(batch.ent), rule.mean_entropy)
    if rule.position is not None or rule.rel_position is not None:
        index = torch.cumsum(batch.mask.to(torch.float32), dim=-1) - 1.0  # 0-based among response tokens
        if rule.position is not None:
            hit = hit & _in_band(index, rule.position)
        if rule.rel_position is not None:
            length = batch.mask.sum(dim=-1, keepdim=True).to(torch.float32).clamp(min=1.0)
            hit = hit & _in_band(index / length, rule.rel_position)
    return hit


def _factor(batch: PolicyBatch, rule: TokenRule) -> Tensor | float:
    if rule.action == "scale":
        return rule.scale
    if rule.fn not in TOKEN_WEIGHTS:
        raise ValueError(f"token weight fn={rule.fn!r} is not registered ({', '.join(sorted(TOKEN_WEIGHTS))})")
    f = TOKEN_WEIGHTS[rule.fn](batch).detach().float()
    return f if rule.alpha == 1.0 else rule.alpha * f + (1.0 - rule.alpha)


def evaluate_rules(batch: PolicyBatch, cfg, rules: tuple[TokenRule, ...]) -> RuleOutcome:
    """Apply ``rules`` in order, first match wins; tokens no rule takes are left as they are."""
    free = batch.mask
    keep, norm, weight = batch.mask, batch.mask, None
    taken: list[Tensor] = []
    for rule in rules:
        hit = free & condition(batch, cfg, rule)
        free = free & ~hit
        taken.append(hit)
        if rule.action == "mask":
            keep = keep & ~hit
            norm = norm & ~hit if rule.renorm else norm
        else:
            base = torch.ones_like(batch.lp, dtype=torch.float32) if weight is None else weight
            weight = torch.where(hit, _factor(batch, rule), base)
    return RuleOutcome(keep=keep, norm=norm, weight=weight, taken=taken)


def rule_metrics(batch: PolicyBatch, rules: tuple[TokenRule, ...], taken: list[Tensor]) -> dict[str, Tensor]:
    """``rules/<name>/token_ratio``: the share of response tokens each rule took (its action applied)."""
    n = batch.mask.sum().float().clamp(min=1.0)
    return {f"rules/{rule.name}/token_ratio": hit.sum().float() / n for rule, hit in zip(rules, taken)}
