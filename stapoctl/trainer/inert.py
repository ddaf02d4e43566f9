"""Inert knobs: configured terms that never changed an update, named so a run that trained as
something else under another name says so (STAPO whose mask acted on no token trained as DAPO).

Driver-side and pure (no engines, no MLflow): each knob is read off metrics the step already has
(`stapo/spurious_count`, `rules/<name>/token_ratio`, `actor/kl_loss`, `actor/entropy_loss`,
`reward/overlong_frac`, `dynamic_sampling/kept_frac`, `rollout_corr/masked_frac`). The loop feeds
`InertWatch` each step; after `trainer.alarm_limits.inert_steps` steps the knobs that never acted
raise one alarm, and at the run's end they are named in one line and tagged
`stapoctl.inert.<knob>` (`stapoctl runs` and `compare` read the tags).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from stapoctl.tracking.keys import INERT_PREFIX as TAG_PREFIX
from stapoctl.trainer.alarms import Alarm

ALARM = "inert_knobs"
# what a run whose preset mask never acted trained as (the preset is that loss plus the mask)
TRAINED_AS = {"stapo": "DAPO", "stapo_prob_only": "DAPO", "stapo_high_entropy": "DAPO"}


@dataclass(frozen=True)
class Knob:
    key: str  # the tag's suffix: stapoctl.inert.<key>
    what: str  # how the end line names it
    evidence: str  # the metric it is read from
    acted: Callable[[float], bool]  # the metric's value → the knob changed this step's update
    means: str = ""  # what its never acting amounts to
    static: bool = False  # inert by its configuration alone (a shadow that is the live loss)
    note: str = ""  # after the evidence, inside its parentheses

    def line(self, steps: int) -> str:
        """`what (evidence)[: means]`: the shape `compare` reads back from the tag."""
        if self.static:
            return f"{self.what}{self.means}"
        return f"{self.what} ({self.evidence} {_zero(self.evidence)} in all {steps} steps{self.note}){self.means}"


def _zero(evidence: str) -> str:
    return "1 (nothing dropped)" if evidence.endswith("kept_frac") else "0"


def _positive(v: float) -> bool:
    return v > 0


def _nonzero(v: float) -> bool:
    return v != 0


def loss_config(loss: Mapping[str, Any]) -> Any:
    """The typed loss config of a `loss` group (`config.loss_settings.build_loss_config`), or None
    for a loss this process does not know."""
    from stapoctl.config.loss_settings import build_loss_config, loss_config_class

    return build_loss_config(loss) if loss_config_class(str(loss.get("name", ""))) is not None else None


def _rule_knobs(cfg: Any) -> list[Knob]:
    from stapoctl.config.token_rules import parse_rules

    out = []
    name = cfg.name
    preset = cfg.preset_rules()
    if preset and getattr(cfg, "PRESET_SILENCES", False):
        rules = "+".join(r.name for r in preset)
        means = (f": the run trained as {TRAINED_AS[name]} ({name} is {TRAINED_AS[name]} plus the mask)"
                 if name in TRAINED_AS else "")
        out.append(Knob(f"loss.{name}.{rules}", f"loss={name}'s mask {rules} acted on no token",
                        "stapo/spurious_count", _positive, means, note=f", τ_p={cfg.tau_p:g}"))
    for rule in parse_rules(cfg.token_rules):
        if rule.action == "scale" and rule.scale == 1.0:
            continue  # a factor of 1 changes nothing wherever it acts
        out.append(Knob(f"loss.token_rules.{rule.name}", f"loss.token_rules {rule.name} ({rule.action}) took no token",
                        f"rules/{rule.name}/token_ratio", _positive))
    live = [dataclasses.replace(r, name="") for r in cfg.rules()]
    for shadow, rules in cfg.shadows():
        if live and [dataclasses.replace(r, name="") for r in rules] == live:
            out.append(Knob(f"loss.shadow.{shadow}", f"loss.shadow {shadow} is the live loss's own rules",
                            f"shadow/{shadow}/token_share", _positive,
                            ": it measures what the loss already applies", static=True))
    return out


def knobs(conf: Any, cfg: Any = None) -> list[Knob]:
    """The configured terms of a run whose acting the driver can see, with their evidence. `cfg`:
    the run's typed loss config when the caller holds it (the step runner's), else built here."""
    from omegaconf import OmegaConf

    loss = OmegaConf.to_container(conf.loss, resolve=True) if not isinstance(conf.loss, dict) else conf.loss
    cfg = cfg if cfg is not None else loss_config(loss)
    out = _rule_knobs(cfg) if cfg is not None and hasattr(cfg, "rules") else []
    if float(loss.get("kl_coef") or 0) > 0:
        out.append(Knob("loss.kl_coef", f"loss.kl_coef={float(loss['kl_coef']):g} with a KL term identically 0",
                        "actor/kl_loss", _nonzero))
    if float(loss.get("entropy_coef") or 0) != 0:
        out.append(Knob("loss.entropy_coef", f"loss.entropy_coef={float(loss['entropy_coef']):g} on an entropy "
                        "term identically 0", "actor/entropy_loss", _nonzero))
    mode = str(loss.get("rollout_correction") or "auto")
    trainer = conf.trainer
    if mode not in ("auto", "off") or (mode == "auto" and str(trainer.get("mode", "sync")) == "async"):
        out.append(Knob("loss.rollout_correction", f"loss.rollout_correction={mode} never clipped or masked a token",
                        "rollout_corr/masked_frac", _positive))
    buffer = int(OmegaConf.select(conf, "reward.overlong_buffer", default=0) or 0)
    if buffer > 0:
        out.append(Knob("reward.overlong_buffer", f"reward.overlong_buffer={buffer} reached by no response",
                        "reward/overlong_frac", _positive))
    if bool(trainer.get("dynamic_sampling", False)):
        out.append(Knob("trainer.dynamic_sampling", "trainer.dynamic_sampling never dropped a group",
                        "dynamic_sampling/kept_frac", lambda v: v < 1))
    return out


class InertWatch:
    """Fed each step's metrics; remembers which knobs have acted. A step without a knob's metric
    (dynamic sampling's empty step, a resumed run's replayed step) is no evidence either way."""

    def __init__(self, knob_list: list[Knob], after_steps: int = 20):
        self.knobs = knob_list
        self.after = int(after_steps)
        self.acted: set[str] = set()
        self.seen: dict[str, int] = {k.key: 0 for k in knob_list}  # steps with evidence, per knob
        self.steps = 0
        self.fired = False

    def observe(self, metrics: Mapping[str, Any]) -> None:
        self.steps += 1
        for k in self.knobs:
            v = _finite(metrics.get(k.evidence))
            if v is None:
                continue
            self.seen[k.key] += 1
            if k.acted(v):
                self.acted.add(k.key)

    def inert(self) -> list[Knob]:
        """The knobs that never acted on a step with evidence (static ones always)."""
        return [k for k in self.knobs if k.static or (self.seen[k.key] and k.key not in self.acted)]

    def feed(self, step: int, metrics: Mapping[str, Any], action: str = "warn") -> list[Alarm]:
        """This step's evidence; the `inert_knobs` alarm once, after `after` steps (0: never)."""
        self.observe(metrics)
        if self.fired or self.after <= 0 or self.steps < self.after:
            return []
        found = self.inert()
        if not found:
            return []
        self.fired = True
        why = "; ".join(k.line(self.seen[k.key]) for k in found)
        return [Alarm(ALARM, step, f"alarm {ALARM} at step {step}: {why} (trainer.alarm_limits.inert_steps="
                                   f"{self.after})", action)]

    def seed(self, buffer: Any, upto: int) -> None:
        """A resumed run: the steps its record already holds count as evidence too."""
        if buffer is None:
            return
        for step in [s for s in buffer.logged_steps() if s <= upto]:
            self.observe({k.evidence: buffer.logged_value(k.evidence, step) for k in self.knobs})

    def summary(self) -> tuple[str, dict[str, str]]:
        """(the end-of-run line, or "" when every knob acted; the tags naming each inert knob)."""
        found = self.inert()
        if not found:
            return "", {}
        lines = [k.line(self.seen[k.key]) for k in found]
        return ("inert: " + "; ".join(lines), {TAG_PREFIX + k.key: line[:4000] for k, line in zip(found, lines)})


def _finite(v: Any) -> Optional[float]:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None

