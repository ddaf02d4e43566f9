"""Clipped policy-gradient baselines: GRPO, DAPO and the JustRL preset (000 §2.2-2.3), and the
shared body that applies a config's token rules (a preset's, then ``token_rules``: rules.py)."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from stapoctl.config.losses import DAPOConfig, GRPOConfig, JustRLConfig

from .batch import PolicyBatch
from .diagnostics import standard_metrics
from .registry import register_loss
from .rules import RuleOutcome, evaluate_rules, rule_metrics
from .surrogate import Surrogate, aggregate, clipped_surrogate, normaliser


def surrogate_of(batch: PolicyBatch, cfg: Any, *, advantages: Optional[Tensor] = None,
                 weight: Optional[Tensor] = None) -> Surrogate:
    return clipped_surrogate(
        batch.lp,
        batch.old,
        batch.adv if advantages is None else advantages,
        batch.mask,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        weight=weight,
        is_weight=batch.is_weight,
    )


def aggregate_with_context(
    batch: PolicyBatch, cfg: Any, token_loss: Tensor, *, loss_mask: Tensor, norm_mask: Tensor
) -> Tensor:
    """Aggregate with the mini-batch normaliser (context ``loss_denominator``) unless per-micro-batch."""
    t_max = batch.extra("max_response_length") or None  # seq-mean-token-sum-norm's constant (default T)
    if cfg.per_microbatch_norm:
        denominator = normaliser(norm_mask, cfg.loss_agg_mode, t_max=t_max)
    else:
        denominator = batch.ctx("loss_denominator", lambda: normaliser(norm_mask, cfg.loss_agg_mode, t_max=t_max))
    return aggregate(token_loss, loss_mask, cfg.loss_agg_mode, norm_mask=norm_mask, denominator=denominator)


def apply_rules(batch: PolicyBatch, cfg: Any) -> tuple[Optional[RuleOutcome], Optional[Tensor], dict]:
    """(outcome or None without rules, the preset's silenced tokens for stapo/* metrics, rules/* metrics
    of the user's ``token_rules``)."""
    preset = cfg.preset_rules() if hasattr(cfg, "preset_rules") else ()
    rules = cfg.rules() if hasattr(cfg, "rules") else ()
    if not rules:
        return None, None, {}
    outcome = evaluate_rules(batch, cfg, rules)
    silenced = None
    if preset and getattr(cfg, "PRESET_SILENCES", False):
        silenced = outcome.taken[0]
        for hit in outcome.taken[1:len(preset)]:
            silenced = silenced | hit
    return outcome, silenced, rule_metrics(batch, rules[len(preset):], outcome.taken[len(preset):])


def clipped_pg_loss(batch: PolicyBatch, cfg: Any, *, advantages: Optional[Tensor] = None,
                    weight: Optional[Tensor] = None, extra_token_loss: Optional[Tensor] = None,
                    extra_metrics: Optional[dict] = None):
    """-(aggregated clipped surrogate) over the response tokens the config's rules leave (all of them
    without rules): the shared body of the baselines and of the rule presets (STAPO, 20-Entropy)."""
    sur = surrogate_of(batch, cfg, advantages=advantages, weight=weight)
    token_loss = -sur.objective if extra_token_loss is None else extra_token_loss - sur.objective
    outcome, silenced, metrics = apply_rules(batch, cfg)
    keep, norm = (batch.mask, batch.mask) if outcome is None else (outcome.keep, outcome.norm)
    if outcome is not None:
        token_loss = outcome.scaled(token_loss)
    loss = aggregate_with_context(batch, cfg, token_loss, loss_mask=keep, norm_mask=norm)
    extra = {**(extra_metrics or {}), **metrics} or None
    return loss, standard_metrics(batch, cfg, sur, loss, keep=keep, silenced=silenced, extra=extra)


@register_loss("grpo", GRPOConfig)
def grpo_loss(batch: PolicyBatch, cfg: GRPOConfig):
    """GRPO: clipped surrogate, eps 0.2, seq-mean-token-mean (000 §2.2)."""
    return clipped_pg_loss(batch, cfg)


@register_loss("dapo", DAPOConfig)
def dapo_loss(batch: PolicyBatch, cfg: DAPOConfig):
    """DAPO: clip-higher (0.2, 0.28), token-mean over the mini-batch, optional dual clip (000 §2.3)."""
    return clipped_pg_loss(batch, cfg)


@register_loss("justrl", JustRLConfig)
def justrl_loss(batch: PolicyBatch, cfg: JustRLConfig):
    """JustRL: a preset of DAPO (clip-higher + token-mean, no KL, no entropy bonus)."""
    return clipped_pg_loss(batch, cfg)
