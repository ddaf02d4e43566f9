"""Config dataclasses shared by the losses.

Every field is Hydra/OmegaConf-friendly (int/float/bool/str/Optional of those) and carries
its help text in ``metadata["help"]`` so `stapoctl losses` and docs/LOSSES.md can show it, and
its valid values (``range="(0, 1]"`` or ``choices=...``, see `stapoctl.config.fields`): checked
when a config is built and by `stapoctl train` before anything starts. A subclass redeclaring a
field only to change its default keeps the range declared here.
Each registered config redeclares ``name`` so that it stays the first field with the
registry key as default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from stapoctl.config.fields import problems, spec

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
STD_MODES = ("population", "unbiased")
ADV_ESTIMATORS = ("grpo", "dr_grpo")
QUANTILE_MODES = ("linear", "lower", "higher", "midpoint")


def _f(default: Any, help: str, *, range: Optional[str] = None, choices: Optional[tuple] = None,
       why: Optional[str] = None) -> Any:
    return spec(default, help, range=range, choices=choices, why=why)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_fields(cfg: Any) -> None:
    """Every declared range and choice of the config's fields (the first violation raises)."""
    for name, value, why in problems(type(cfg), cfg):
        raise ValueError(f"{cfg.name}: {name}={value!r} {why}")


@dataclass
class AdvantageFields:
    """How rewards become advantages (rewards arrive already scored)."""

    name: str = _f("", "registry key of the loss (loss=NAME)")
    adv_estimator: str = _f("grpo", "grpo: (R-mean_G)/(std_G+eps); dr_grpo: R-mean_G (no std division)",
                            choices=ADV_ESTIMATORS)
    std_mode: str = _f(
        "population",
        "group std: population (SPEC default) or unbiased (verl's torch.std); record it",
        choices=STD_MODES,
    )
    adv_eps: float = _f(1e-6, "epsilon added to the group std (advantages and PPL standardisation)",
                        range="[0, inf)")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Declared ranges and choices; subclasses add cross-field checks after calling this."""
        check_fields(self)


@dataclass
class DiagnosticFields(AdvantageFields):
    """S2T thresholds: applied by the STAPO family, only measured (metrics) by the others."""

    tau_p: float = _f(2e-3, "S2T absolute probability threshold: candidate iff pi(y_t) < tau_p (000 Remark 3.5)",
                      range="(0, 1]", why="a probability; 0 silences nothing, which is loss=dapo")
    tau_h: float = _f(
        0.2,
        "fraction of high-entropy tokens exempt from S2T: h* = quantile(H over M, 1 - tau_h) (SPEC reading)",
        range="[0, 1]",
    )
    quantile_interpolation: str = _f("linear", "interpolation of entropy quantiles: linear | lower | higher | midpoint",
                                     choices=QUANTILE_MODES)


@dataclass
class ClipFields(DiagnosticFields):
    """PPO-style ratio clipping."""

    clip_ratio_low: float = _f(0.2, "epsilon_low: ratio floor 1 - clip_ratio_low", range="[0, 1]")
    clip_ratio_high: float = _f(0.28, "epsilon_high: ratio ceiling 1 + clip_ratio_high (clip-higher)",
                                range="[0, inf)")
    clip_ratio_c: Optional[float] = _f(None, "dual-clip constant c > 1 for negative advantages; None = off",
                                       range="(1, inf)")

    def validate(self) -> None:
        super().validate()
        # clip-higher widens the ceiling; a floor wider than the ceiling is a swapped pair
        _check(
            self.clip_ratio_low <= self.clip_ratio_high,
            f"{self.name}: clip_ratio_low={self.clip_ratio_low} > clip_ratio_high={self.clip_ratio_high} "
            "(swapped? DAPO uses 0.2 and 0.28)",
        )


@dataclass
class AggFields(ClipFields):
    """How token terms become one scalar."""

    loss_agg_mode: str = _f("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum", choices=AGG_MODES)
    per_microbatch_norm: bool = _f(
        False,
        "normalise by the micro-batch's own count (verl's biased behaviour; the learner then "
        "scales by 1/n_micro) instead of the mini-batch count from prepare_minibatch",
    )
