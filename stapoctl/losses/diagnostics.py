"""Token categories, spurious ratio and LM-head gradient-norm proxies (000 §3, Tables 3-5).

The per-token proxy is G_t = |coef_t| * ||e(y_t) - pi||_2 * ||h_t||_2 with
||e(y_t) - pi||_2^2 = 1 - 2 pi(y_t) + sum_k pi_k^2 (000 App. A). coef_t is the token's
surrogate coefficient d s_t / d log pi_t *before* any S2T silencing and without the
aggregation normaliser, so the numbers say how hard each category would pull and stay
comparable across losses and batch sizes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .masks import entropy_threshold, s2t_mask
from .shadow import mismatch_metrics, shadow_metrics
from .surrogate import Surrogate


def token_categories(
    advantages: Tensor, prob: Tensor, entropy: Tensor, mask: Tensor, *, tau_p: float, threshold: Tensor | float
) -> dict[str, Tensor]:
    """The 8 rows of 000's table: (pi vs tau_p) x (A sign) x (H vs h*), as bool [B, T] masks.

    Tokens with A = 0 belong to none (they carry no policy gradient).
    """
    m = mask.to(torch.bool)
    out: dict[str, Tensor] = {}
    for p_name, p_sel in (("p>=tau", prob >= tau_p), ("p<tau", prob < tau_p)):
        for a_name, a_sel in (("A>0", advantages > 0), ("A<0", advantages < 0)):
            for h_name, h_sel in (("H>=h", entropy >= threshold), ("H<h", entropy < threshold)):
                out[f"{p_name},{a_name},{h_name}"] = m & p_sel & a_sel & h_sel
    return out


def lmhead_grad_norm(
    coef: Tensor, prob: Tensor, sum_p2: Optional[Tensor] = None, hidden_norm: Optional[Tensor] = None
) -> Tensor:
    """G_t = |coef| * sqrt(1 - 2 pi + sum_k pi_k^2) * ||h_t||; without sum_p2 the (1 - pi)^2 lower bound."""
    p = prob.detach().float()
    s2 = p * p if sum_p2 is None else sum_p2.detach().float()
    e_minus_pi = (1.0 - 2.0 * p + s2).clamp(min=0.0).sqrt()
    g = coef.detach().float().abs() * e_minus_pi
    if hidden_norm is not None:
        g = g * hidden_norm.detach().float()
    return g


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    """Mean of x over m as a 0-dim tensor; 0 for an empty m."""
    return torch.where(m, x.float(), 0.0).sum() / m.sum().clamp(min=1)


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    return num.float() / den.float().clamp(min=1.0)


def to_floats(values: dict[str, Any]) -> dict[str, float]:
    """Python floats with one device sync: stack the tensor values and read them back once."""
    keys = [k for k, v in values.items() if torch.is_tensor(v)]
    out = {k: float(v) for k, v in values.items() if not torch.is_tensor(v)}
    if keys:
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in keys]).tolist()
        out.update(zip(keys, stacked))
    return {k: out[k] for k in values}


def standard_metrics(
    batch: Any,
    cfg: Any,
    sur: Surrogate,
    loss: Tensor,
    *,
    keep: Tensor,
    silenced: Optional[Tensor] = None,
    extra: Optional[dict[str, Any]] = None,
) -> dict[str, float]:
    """The metrics every loss returns (names are API). Ratios and means of empty sets are 0.0.

    ``silenced``: the mask a STAPO-family loss applied; for other losses the S2T criterion is
    computed with the config's tau_p/tau_h and reported without being applied. ``extra``:
    method-specific metrics (tensors or floats), converted in the same single device sync.
    """
    mask = batch.mask
    h = batch.ctx(
        "entropy_threshold",
        lambda: entropy_threshold(batch.ent, mask, cfg.tau_h, cfg.quantile_interpolation),
    )
    spurious = s2t_mask(batch.adv, batch.prob, batch.ent, mask, tau_p=cfg.tau_p, threshold=h, kind="s2t")
    if silenced is None:
        silenced = spurious
    n_resp = mask.sum()
    n_pos = (mask & (batch.adv > 0)).sum()
    n_sil = silenced.sum()
    g = lmhead_grad_norm(sur.coef, batch.prob, batch.token_tensor("sum_p2"), batch.token_tensor("hidden_norm"))
    pos_normal = mask & (batch.adv > 0) & ~spurious
    neg = mask & (batch.adv < 0)
    values: dict[str, Any] = {
        "actor/pg_loss": loss.detach(),
        "actor/pg_clipfrac": _masked_mean(sur.clipped, mask),
        "actor/ppo_kl": _masked_mean(-sur.log_ratio, mask),
        "actor/entropy": _masked_mean(batch.ent, mask),
        "stapo/spurious_ratio": _ratio(n_sil, n_resp),
        "stapo/spurious_count": n_sil,
        "stapo/entropy_threshold": h,
        "stapo/masked_pos_adv_ratio": _ratio(n_sil, n_pos),
        "grad/lmhead_norm/spurious": _masked_mean(g, spurious),
        "grad/lmhead_norm/pos_normal": _masked_mean(g, pos_normal),
        "grad/lmhead_norm/neg": _masked_mean(g, neg),
        "grad/lmhead_norm/exact": 1.0 if batch.extras.get("sum_p2") is not None else 0.0,
        "loss/active_token_ratio": _ratio((keep & mask).sum(), n_resp),
        "loss/response_tokens": n_resp,
    }
    values.update(shadow_metrics(batch, cfg, g))  # shadow/<name>/*: measured, never applied
    values.update(mismatch_metrics(batch, cfg))  # rollout_corr/abs_dlogp/<cell>, with behaviour log-probs
    values.update(getattr(batch, "metric_terms", {}))  # rollout_corr/*, actor/kl_loss, actor/entropy_loss
    values.update(extra or {})
    return to_floats(values)
