"""PolicyBatch: one loss call's tensors plus the mini-batch context.

Statistics that SPEC defines over the whole mini-batch (h*, the token-mean denominator,
WAPO's group normalisers, PPL weights) are read through ``ctx(key, compute)``: taken from
the context when the learner passes it, computed from this call's tensors otherwise. In
``prepare_minibatch`` the same method code runs once on the whole mini-batch in recording
mode, so the micro-batch calls see exactly the values the one-shot call would compute.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor


class PolicyBatch:
    def __init__(
        self,
        *,
        log_prob: Tensor,
        old_log_prob: Optional[Tensor],
        advantages: Tensor,
        response_mask: Tensor,
        entropy: Tensor,
        extras: Optional[dict[str, Any]] = None,
        context: Optional[dict[str, Any]] = None,
    ) -> None:
        if log_prob.dim() != 2:
            raise ValueError(f"log_prob must be [B, T], got shape {tuple(log_prob.shape)}")
        shape = log_prob.shape
        self.B, self.T = int(shape[0]), int(shape[1])
        for key, t in (("old_log_prob", old_log_prob), ("response_mask", response_mask), ("entropy", entropy)):
            if t is not None and t.shape != shape:
                raise ValueError(f"{key} has shape {tuple(t.shape)}, expected {tuple(shape)} like log_prob")
        if advantages.dim() == 1 and advantages.shape[0] == self.B:
            advantages = advantages[:, None].expand(shape)
        if advantages.shape != shape:
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {tuple(shape)} or [B]")
        self.device = log_prob.device
        self.log_prob = log_prob
        self.mask = response_mask.to(torch.bool)
        # fp32 working copies; padding values (possibly -inf/NaN) never reach the arithmetic
        self.lp = torch.where(self.mask, log_prob.float(), 0.0)
        self.old_given = old_log_prob is not None
        old = old_log_prob if old_log_prob is not None else log_prob
        self.old = torch.where(self.mask, old.detach().float(), 0.0)
        self.adv = torch.where(self.mask, advantages.detach().float(), 0.0)
        self.ent = torch.where(self.mask, entropy.detach().float(), 0.0)  # masks and metrics
        self._entropy = entropy  # as passed: carries a gradient only from token_stats(entropy_grad=True)
        self.prob = torch.where(self.mask, self.lp.detach().exp(), 0.0)
        self.extras = dict(extras or {})
        self.context = dict(context or {})
        self.recorded: dict[str, Any] = {}
        self.is_weight: Optional[Tensor] = None  # rollout correction weight (rollout_correction.py)
        self.metric_terms: dict[str, Tensor] = {}  # metrics of the shared terms, read in standard_metrics

    # -- extra inputs -------------------------------------------------------------------
    def extra(self, key: str, *, required_by: Optional[str] = None) -> Any:
        value = self.extras.get(key)
        if value is None and required_by is not None:
            raise ValueError(f"loss {required_by!r} needs the keyword argument {key}=...")
        return value

    def row_tensor(self, key: str, *, required_by: str, dtype: Optional[torch.dtype] = None) -> Tensor:
        value = self.extra(key, required_by=required_by)
        t = torch.as_tensor(value, device=self.device)
        if dtype is not None:
            t = t.to(dtype)
        if t.shape != (self.B,):
            raise ValueError(f"{key} must have shape [B]=({self.B},), got {tuple(t.shape)}")
        return t

    def token_tensor(self, key: str) -> Optional[Tensor]:
        value = self.extras.get(key)
        if value is None:
            return None
        t = torch.as_tensor(value, device=self.device)
        if t.shape != (self.B, self.T):
            raise ValueError(f"{key} must have shape [B, T]=({self.B}, {self.T}), got {tuple(t.shape)}")
        return torch.where(self.mask, t.detach().float(), 0.0)

    def entropy_for_bonus(self) -> Tensor:
        """H [B, T] fp32 with the caller's gradient (none if the caller passed a detached one)."""
        return torch.where(self.mask, self._entropy.float(), 0.0)

    # -- mini-batch context ---------------------------------------------------------------
    def ctx(self, key: str, compute: Callable[[], Tensor]) -> Tensor:
        """Mini-batch statistic ``key``: from the context if given, else computed and recorded."""
        if key in self.context:
            value = self.context[key]
            if key.startswith("row_"):
                t = torch.as_tensor(value, device=self.device).detach().float()
                if t.shape != (self.B,):
                    raise ValueError(
                        f"context {key} has shape {tuple(t.shape)}, expected ({self.B},): slice it "
                        "with the micro-batch rows (slice_context)"
                    )
                return t
            return torch.as_tensor(value, dtype=torch.float32, device=self.device)
        value = compute().detach()
        self.recorded[key] = value
        return value

    def exported_context(self) -> dict[str, Any]:
        """Recorded statistics as passed back by the learner: floats, and [B] tensors for row_*."""
        out: dict[str, Any] = {}
        for key, value in self.recorded.items():
            out[key] = value.float() if key.startswith("row_") else float(value.item())
        return out


def slice_context(context: dict[str, Any], rows: Any) -> dict[str, Any]:
    """The context of a micro-batch: row_* tensors indexed by ``rows`` (slice or index), scalars as is."""
    return {k: (v[rows] if k.startswith("row_") else v) for k, v in context.items()}
