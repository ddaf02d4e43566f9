"""The verl loss assembly around every method's surrogate: loss = pg − c·agg(H) + β·agg(KL).

agg is the loss's ``loss_agg_mode`` over *all* response tokens (its denominator recorded on the
mini-batch as ``reg_denominator``), except where the config names its own (``REGULARIZER_AGG``:
token-mean for WAPO, which has no mode, and the STAPO family, whose surrogate divides by the
unsilenced count): the KL and the entropy are never silenced by a method's mask. With β = c = 0
nothing is computed or added, so those losses are bit-equal to the plain surrogate.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from .batch import PolicyBatch
from .kl import DEFAULT_K3_CLAMP, kl_estimate
from .surrogate import aggregate, normaliser


def regularizer_mode(cfg: Any) -> str:
    return getattr(type(cfg), "REGULARIZER_AGG", None) or getattr(cfg, "loss_agg_mode", "token-mean")


def _active(cfg: Any) -> tuple[bool, bool]:
    """(KL term here, entropy term): TR-GRPO's tr_weighted KL lives inside its own token loss. The
    entropy term is a bonus for c > 0 and entropy minimisation for c < 0 (verl takes either sign)."""
    kl_on = getattr(cfg, "kl_coef", 0.0) > 0 and getattr(cfg, "kl_estimator", "k3") != "tr_weighted"
    return kl_on, getattr(cfg, "entropy_coef", 0.0) != 0


def _denominator(batch: PolicyBatch, cfg: Any, mode: str) -> Tensor:
    t_max = batch.extra("max_response_length") or None

    def compute() -> Tensor:
        return normaliser(batch.mask, mode, t_max=t_max)

    if getattr(cfg, "per_microbatch_norm", False):
        return compute()
    return batch.ctx("reg_denominator", compute)


def record_context(batch: PolicyBatch, cfg: Any) -> None:
    """prepare_minibatch: the terms' mini-batch denominator (no reference log-probs needed)."""
    if any(_active(cfg)):
        _denominator(batch, cfg, regularizer_mode(cfg))


def regularizer_loss(batch: PolicyBatch, cfg: Any) -> Optional[Tensor]:
    """β·agg(KL) − c·agg(H), or None when both are off; logs ``actor/kl_loss`` / ``actor/entropy_loss``
    (the aggregates before their coefficient) into ``batch.metric_terms``."""
    kl_on, ent_on = _active(cfg)
    if not (kl_on or ent_on):
        return None
    mode = regularizer_mode(cfg)
    den = _denominator(batch, cfg, mode)  # carries seq-mean-token-sum-norm's T_max

    def agg(x: Tensor) -> Tensor:
        return aggregate(x, batch.mask, mode, norm_mask=batch.mask, denominator=den)

    total: Optional[Tensor] = None
    if kl_on:
        ref = batch.token_tensor("ref_log_prob")
        if ref is None:
            raise ValueError(f"loss {cfg.name!r} with kl_coef > 0 needs the keyword argument ref_log_prob=... "
                             "(the reference policy's log-probs)")
        clamp = float(getattr(cfg, "kl_clamp", DEFAULT_K3_CLAMP) or 0.0)
        kl = agg(kl_estimate(batch.lp, ref, cfg.kl_estimator, clamp=clamp))
        batch.metric_terms["actor/kl_loss"] = kl.detach()
        total = cfg.kl_coef * kl
    if ent_on:
        h = agg(batch.entropy_for_bonus())
        batch.metric_terms["actor/entropy_loss"] = h.detach()
        total = -cfg.entropy_coef * h if total is None else total - cfg.entropy_coef * h
    return total
