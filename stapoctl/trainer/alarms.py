"""Run-health alarms: a watch fed one step's metrics at a time, returning the alarms that fired.

An RLVR run going wrong shows in its per-step metrics long before its validation does: the
policy's token entropy collapsing (000 §3: a few spurious tokens' updates drive it; 003: the
entropy spent buys performance, and what is spent is not got back), gradient-norm spikes, every
response running into the length cap, a reward stuck at its floor or ceiling (no group has a
signal left), the rollout engine's and the learner's probabilities drifting apart, the spurious-
token share jumping. Pure on purpose (no engines, no MLflow): the loop prints, tags and acts on
what `HealthWatch.feed` returns, and tests feed it synthetic streams. Each alarm fires once a run.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from stapoctl.config.alarms import AlarmLimits as Limits

ENTROPY = "actor/entropy"
GRAD_NORM = "actor/grad_norm"
CLIP_RATIO = "response_length/clip_ratio"
ACCURACY = "reward/accuracy"
MISMATCH = "rollout_corr/kl_k3"
SPURIOUS = "stapo/spurious_ratio"
NAMES = ("entropy_collapse", "entropy_blowup", "grad_norm_spike", "length_at_cap", "reward_flat", "rollout_mismatch",
         "spurious_jump")


@dataclass(frozen=True)
class Alarm:
    name: str
    step: int
    message: str  # one line: what was seen, against which threshold
    action: str = ""  # what the loop does after it; "" = trainer.alarm_action (inert_knobs: its own, warn)
    setting: str = ""  # the key that chose `action` when it is the alarm's own


def limits_from(node: Any) -> Limits:
    """`trainer.alarm_limits` as Limits; None or partial (a checkpoint saved before a key existed)
    keeps the defaults."""
    given = dict(node or {})
    return Limits(**{f.name: type(f.default)(given[f.name]) for f in fields(Limits) if given.get(f.name) is not None})


class HealthWatch:
    """Feed it each step's metrics; it returns the alarms that fired at that step (each at most once)."""

    def __init__(self, limits: Optional[Limits] = None):
        self.limits = limits or Limits()
        self.fired: set[str] = set()
        n = self.limits
        self.entropy: deque = deque(maxlen=n.entropy_window + 3)
        self.entropy_recent: deque = deque(maxlen=3)
        self.entropy_min = math.inf  # the lowest entropy before the last 3 steps
        self.grad: deque = deque(maxlen=n.grad_window)
        self.spurious: deque = deque(maxlen=10)
        self.mismatch: deque = deque(maxlen=3)
        self.mismatch_start: list[float] = []
        self.capped = self.flat = 0
        self.flat_at: Optional[float] = None

    def feed(self, step: int, metrics: Mapping[str, float]) -> list[Alarm]:
        found = [(name, why) for name, why in (
            ("entropy_collapse", self._entropy(_value(metrics, ENTROPY))),
            ("entropy_blowup", self._blowup(_value(metrics, ENTROPY))),
            ("grad_norm_spike", self._grad(_value(metrics, GRAD_NORM))),
            ("length_at_cap", self._length(_value(metrics, CLIP_RATIO))),
            ("reward_flat", self._reward(_value(metrics, ACCURACY))),
            ("rollout_mismatch", self._mismatch(_value(metrics, MISMATCH))),
            ("spurious_jump", self._spurious(_value(metrics, SPURIOUS))),
        ) if why and name not in self.fired]
        self.fired.update(name for name, _ in found)
        return [Alarm(name, step, f"alarm {name} at step {step}: {why}") for name, why in found]

    def _entropy(self, h: Optional[float]) -> str:
        if h is None:
            return ""
        n, hist = self.limits, self.entropy
        hist.append(h)
        if h < n.entropy_floor:
            return f"{ENTROPY} {h:.4f} nats is below the floor {n.entropy_floor:g} (trainer.alarm_limits.entropy_floor)"
        if len(hist) < hist.maxlen:
            return ""
        before, now = statistics.fmean(list(hist)[:3]), statistics.fmean(list(hist)[-3:])
        if before > 0 and now < before * (1 - n.entropy_drop):
            return (f"{ENTROPY} fell {1 - now / before:.0%} in {n.entropy_window} steps ({before:.4f} → {now:.4f} "
                    f"nats; limit {n.entropy_drop:.0%}, trainer.alarm_limits.entropy_drop)")
        return ""

    def _blowup(self, h: Optional[float]) -> str:
        """The 3-step mean against the lowest entropy of the steps before those 3."""
        if h is None:
            return ""
        recent, rise = self.entropy_recent, self.limits.entropy_rise
        if len(recent) == recent.maxlen:
            self.entropy_min = min(self.entropy_min, recent[0])
        recent.append(h)
        now = statistics.fmean(recent)
        if len(recent) == recent.maxlen and 0 < self.entropy_min < math.inf and now > rise * self.entropy_min:
            return (f"{ENTROPY} rose to {now:.4f} nats (3-step mean), {now / self.entropy_min:.1f}× its earlier low "
                    f"{self.entropy_min:.4f}: the policy is turning to noise (limit {rise:g}×, "
                    "trainer.alarm_limits.entropy_rise)")
        return ""

    def _grad(self, g: Optional[float]) -> str:
        if g is None:
            return ""
        n, hist = self.limits, self.grad
        why = ""
        if len(hist) >= min(10, n.grad_window):
            mean, std = statistics.fmean(hist), statistics.pstdev(hist)
            z = (g - mean) / std if std > 0 else math.inf
            if z > n.grad_z and g > n.grad_ratio * mean:
                why = (f"{GRAD_NORM} {g:.4g} is {z:.1f} standard deviations above its last {len(hist)} steps' mean "
                       f"{mean:.4g} (limit {n.grad_z:g}, trainer.alarm_limits.grad_z)")
        hist.append(g)
        return why

    def _length(self, share: Optional[float]) -> str:
        if share is None:
            return ""
        n = self.limits
        self.capped = self.capped + 1 if share >= n.length_cap_share else 0
        if self.capped >= n.length_cap_steps:
            return (f"{CLIP_RATIO} {share:.0%}: most responses hit rollout.max_response_length for {self.capped} "
                    f"steps (limit {n.length_cap_share:.0%} for {n.length_cap_steps}, trainer.alarm_limits.length_cap_share)")
        return ""

    def _reward(self, acc: Optional[float]) -> str:
        if acc is None:
            return ""
        at = 0.0 if acc <= 1e-9 else 1.0 if acc >= 1 - 1e-9 else None
        self.flat = self.flat + 1 if at is not None and at == self.flat_at else int(at is not None)
        self.flat_at = at
        if self.flat >= self.limits.reward_flat_steps:
            where = "floor (no response correct)" if at == 0.0 else "ceiling (every response correct)"
            return (f"{ACCURACY} has been at its {where} for {self.flat} steps: no group has an advantage left "
                    f"(trainer.alarm_limits.reward_flat_steps={self.limits.reward_flat_steps})")
        return ""

    def _mismatch(self, kl: Optional[float]) -> str:
        if kl is None:
            return ""
        n = self.limits
        if len(self.mismatch_start) < 5:
            self.mismatch_start.append(kl)
        self.mismatch.append(kl)
        now, base = statistics.fmean(self.mismatch), statistics.median(self.mismatch_start)
        if len(self.mismatch_start) == 5 and now > n.mismatch_kl and now > n.mismatch_rise * base:
            return (f"{MISMATCH} {now:.4g} (3-step mean) rose above {n.mismatch_kl:g} and {n.mismatch_rise:g}× its "
                    f"start {base:.3g}: rollout and learner probabilities drift apart (trainer.alarm_limits.mismatch_kl)")
        return ""

    def _spurious(self, r: Optional[float]) -> str:
        if r is None:
            return ""
        n, hist = self.limits, self.spurious
        why = ""
        if len(hist) == hist.maxlen:
            mean = statistics.fmean(hist)
            if r > n.spurious_floor and r > n.spurious_jump * mean:
                why = (f"{SPURIOUS} jumped to {r:.2%} from a {len(hist)}-step mean of {mean:.2%} (limit "
                       f"{n.spurious_jump:g}× and {n.spurious_floor:.1%}, trainer.alarm_limits.spurious_jump)")
        hist.append(r)
        return why


def _value(metrics: Mapping[str, float], name: str) -> Optional[float]:
    """The metric as a finite float, None when absent or not finite (a NaN is another failure's)."""
    v = metrics.get(name)
    try:
        v = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
