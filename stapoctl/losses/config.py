"""Config dataclasses shared by the losses.

Every field is Hydra/OmegaConf-friendly (int/float/bool/str/Optional of those) and carries
its help text in ``metadata["help"]`` so `stapoctl losses` and docs/LOSSES.md can show it.
Each registered config redeclares ``name`` so that it stays the first field with the
registry key as default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
STD_MODES = ("population", "unbiased")
ADV_ESTIMATORS = ("grpo", "dr_grpo")
QUANTILE_MODES = ("linear", "lower", "higher", "midpoint")


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _one_of(cfg: Any, attr: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, attr)
    _check(value in allowed, f"{cfg.name}: {attr}={value!r} is not one of {', '.join(allowed)}")


@dataclass
class AdvantageFields:
    """How rewards become advantages (rewards arrive already scored)."""

    name: str = _f("", "registry key of the loss (loss=NAME)")
    adv_estimator: str = _f("grpo", "grpo: (R-mean_G)/(std_G+eps); dr_grpo: R-mean_G (no std division)")
    std_mode: str = _f(
        "population",
        "group std: population (SPEC default) or unbiased (verl's torch.std); record it",
    )
    adv_eps: float = _f(1e-6, "epsilon added to the group std (advantages and PPL standardisation)")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _one_of(self, "adv_estimator", ADV_ESTIMATORS)
        _one_of(self, "std_mode", STD_MODES)
        _check(self.adv_eps >= 0, f"{self.name}: adv_eps must be >= 0")


@dataclass
class DiagnosticFields(AdvantageFields):
    """S2T thresholds: applied by the STAPO family, only measured (metrics) by the others."""

    tau_p: float = _f(2e-3, "S2T absolute probability threshold: candidate iff pi(y_t) < tau_p (000 Remark 3.5)")
    tau_h: float = _f(
        0.2,
        "fraction of high-entropy tokens exempt from S2T: h* = quantile(H over M, 1 - tau_h) (SPEC reading)",
    )
    quantile_interpolation: str = _f("linear", "interpolation of entropy quantiles: linear | lower | higher | midpoint")

    def validate(self) -> None:
        super().validate()
        _check(self.tau_p >= 0 and math.isfinite(self.tau_p), f"{self.name}: tau_p must be a finite value >= 0")
        _check(0.0 <= self.tau_h <= 1.0, f"{self.name}: tau_h must lie in [0, 1]")
        _one_of(self, "quantile_interpolation", QUANTILE_MODES)


@dataclass
class ClipFields(DiagnosticFields):
    """PPO-style ratio clipping."""

    clip_ratio_low: float = _f(0.2, "epsilon_low: ratio floor 1 - clip_ratio_low")
    clip_ratio_high: float = _f(0.28, "epsilon_high: ratio ceiling 1 + clip_ratio_high (clip-higher)")
    clip_ratio_c: Optional[float] = _f(None, "dual-clip constant c > 1 for negative advantages; None = off")

    def validate(self) -> None:
        super().validate()
        _check(0.0 <= self.clip_ratio_low <= 1.0, f"{self.name}: clip_ratio_low must lie in [0, 1]")
        _check(self.clip_ratio_high >= 0.0, f"{self.name}: clip_ratio_high must be >= 0")
        _check(
            self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
            f"{self.name}: clip_ratio_c must be > 1 (or None)",
        )


@dataclass
class AggFields(ClipFields):
    """How token terms become one scalar."""

    loss_agg_mode: str = _f("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum")
    per_microbatch_norm: bool = _f(
        False,
        "normalise by the micro-batch's own count (verl's biased behaviour; the learner then "
        "scales by 1/n_micro) instead of the mini-batch count from prepare_minibatch",
    )

    def validate(self) -> None:
        super().validate()
        _one_of(self, "loss_agg_mode", AGG_MODES)
