"""Training–inference drift per token rule: how far the learner's log-probs lie from the rollout
engine's, overall and within each of 000 Table 1's cells, and how many rule decisions it flips.

The rules decide on the learner's π (π_old here: what the first mini-batch's rules read); vLLM
sampled under its own π. A flip is a response token whose decision (the rule acted or not) changes
when π comes from vLLM instead; H and h* stay the learner's (vLLM returns no entropy), so a flip
comes from a π condition. Computed on the driver from tensors it already holds (the learner's
`StepResult`, the batch's `rollout_log_probs`), whether or not the loss sees vLLM's log-probs:

    rollout/logprob_diff_p99                    p99 of |Δ log p| over the response (mean, max: the learner's)
    rollout_corr/abs_dlogp[_p99|_max]/<cell>    mean, p99, max of |Δ log p| within each cell
    rollout_corr/flips[/<rule>], flip_rate      tokens whose decision flips (any rule; per configured rule)
    shadow/<name>/flips                         the same for each shadow
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from stapoctl.config.shadow_rules import cell_rules

from .batch import PolicyBatch
from .masks import masked_quantile
from .rules import condition, evaluate_rules

P = 0.99


@dataclass
class Drift:
    """Per-token results (bool / float [N, R]) beside the step's metrics: the trace page reads them."""

    metrics: dict[str, float] = field(default_factory=dict)
    abs_dlogp: Optional[Tensor] = None  # |learner − vLLM| log-prob, 0 off the response
    acted: dict[str, Tensor] = field(default_factory=dict)  # rule / shadow:<name> → acted under the learner's π
    flipped: dict[str, Tensor] = field(default_factory=dict)  # … → decision differs under vLLM's π
    cells: dict[str, Tensor] = field(default_factory=dict)  # Table 1 cell → its tokens (learner's π)
    rules: dict[str, str] = field(default_factory=dict)  # rule / shadow:<name> → the rule as written


def _slices(rows: int, mini_rows: int) -> list[slice]:
    step = max(int(mini_rows or rows), 1)
    return [slice(s, min(s + step, rows)) for s in range(0, rows, step)]


def _decisions(cfg: Any, rules: tuple, shadows: tuple, cells: tuple, lp: Tensor, old: Tensor, ent: Tensor,
               adv: Tensor, mask: Tensor, mini_rows: int) -> dict[str, Tensor]:
    """Rule name, `shadow:<name>` and `cell:<name>` → bool [N, R] of the tokens each takes, mini-batch
    by mini-batch (the quantiles are the mini-batch's, as in the loss), first match winning as when
    applied. The config's rules and shadows are parsed once by the caller (presets build configs)."""
    out = {r.name: torch.zeros_like(mask) for r in rules}
    out.update({f"shadow:{name}": torch.zeros_like(mask) for name, _ in shadows})
    out.update({f"cell:{c.name}": torch.zeros_like(mask) for c in cells})
    for sl in _slices(len(mask), mini_rows):
        b = PolicyBatch(log_prob=lp[sl], old_log_prob=old[sl], advantages=adv[sl], response_mask=mask[sl],
                        entropy=ent[sl])
        if rules:
            for rule, hit in zip(rules, evaluate_rules(b, cfg, rules).taken):
                out[rule.name][sl] |= hit
            b.context.update(b.recorded)  # the mini-batch's quantiles, computed once for every rule below
        for name, srules in shadows:
            for hit in evaluate_rules(b, cfg, srules).taken:
                out[f"shadow:{name}"][sl] |= hit
            b.context.update(b.recorded)
        for c in cells:
            out[f"cell:{c.name}"][sl] = condition(b, cfg, c)
            b.context.update(b.recorded)
    return out


def _parsed(cfg: Any) -> tuple[tuple, tuple]:
    """(rules, shadows) of a loss config, parsed once per config object (a preset shadow builds configs:
    ~2 ms a parse, each measured step)."""
    if cfg is None:
        return (), ()
    if "_drift_parsed" not in vars(cfg):
        vars(cfg)["_drift_parsed"] = (tuple(cfg.rules()) if hasattr(cfg, "rules") else (),
                                      tuple(cfg.shadows()) if hasattr(cfg, "shadows") else ())
    return vars(cfg)["_drift_parsed"]


def _stats(x: Tensor, m: Tensor) -> tuple[float, float, float]:
    """(mean, p99, max) of x over m; zeros for an empty m."""
    v = x[m].double()
    if v.numel() == 0:
        return 0.0, 0.0, 0.0
    return float(v.mean()), float(masked_quantile(x, m, P)), float(v.max())  # sort-based: no size limit


def drift(cfg: Any, *, learner_log_prob: Tensor, rollout_log_prob: Tensor, entropy: Tensor, advantages: Tensor,
          response_mask: Tensor, mini_rows: int = 0) -> Drift:
    """The drift metrics and per-token results of one batch ([N, R] tensors; Â may be [N])."""
    mask = response_mask.to(torch.bool).cpu()
    old = torch.where(mask, learner_log_prob.detach().float().cpu(), 0.0)
    behav = torch.where(mask, rollout_log_prob.detach().float().cpu(), 0.0)
    ent = entropy.detach().float().cpu()
    adv = advantages.detach().float().cpu()
    adv = adv[:, None].expand_as(old) if adv.dim() == 1 else adv
    d = (old - behav).abs()
    out = Drift(abs_dlogp=d)
    n = int(mask.sum())
    _, p99, _ = _stats(d, mask)
    metrics = {"rollout/logprob_diff_p99": p99}
    rules, shadows = _parsed(cfg)
    cells = cell_rules(cfg.tau_p, cfg.tau_h) if hasattr(cfg, "tau_p") else ()
    learner = _decisions(cfg, rules, shadows, cells, old, old, ent, adv, mask, mini_rows)
    out.cells = {k[len("cell:"):]: learner.pop(k) for k in list(learner) if k.startswith("cell:")}
    vllm = _decisions(cfg, rules, shadows, (), behav, old, ent, adv, mask, mini_rows)
    if cells:
        mean, _, top = _stats(d, mask)
        metrics["rollout_corr/abs_dlogp"] = mean
        for name, cell in out.cells.items():
            c_mean, c_p99, c_max = _stats(d, cell)
            metrics.update({f"rollout_corr/abs_dlogp/{name}": c_mean, f"rollout_corr/abs_dlogp_p99/{name}": c_p99,
                            f"rollout_corr/abs_dlogp_max/{name}": c_max})
    out.acted = learner
    out.rules = {r.name: r.text() for r in rules}
    out.rules.update({f"shadow:{name}": "measured only: " + "; ".join(r.text() for r in srules)
                      for name, srules in shadows})
    out.flipped = {k: learner[k] ^ vllm[k] for k in learner}
    rules = [k for k in learner if not k.startswith("shadow:")]
    if rules:
        any_flip = torch.zeros_like(mask)
        for k in rules:
            any_flip |= out.flipped[k]
            metrics[f"rollout_corr/flips/{k}"] = float(out.flipped[k].sum())
        metrics["rollout_corr/flips"] = float(any_flip.sum())
        metrics["rollout_corr/flip_rate"] = float(any_flip.sum()) / max(n, 1)
    for k in learner:
        if k.startswith("shadow:"):
            name = k[len("shadow:"):]
            metrics[f"shadow/{name}/flips"] = float(out.flipped[k].sum())
            metrics[f"shadow/{name}/abs_dlogp"] = _stats(d, learner[k])[0]
    out.metrics = metrics
    return out
