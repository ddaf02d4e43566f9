"""The weight-sync canary as an alarm: vLLM's log-probs against the learner's on the steps the
learner measures them, as the p99 of |Δ log p| over the response tokens (`rollout/logprob_diff_p99`,
per rollout worker where there are several).

Why a quantile and not the max: the max over every token of a batch grows with the token count
(~10⁷ tokens of an 8B bf16 batch reach a tail a tiny model's never shows), and a few positions differ
even with exact weights (at top-p < 1 the nucleus kept sets of the two sides may differ: |Δ log p| up
to 1e-1 on ≤ 1e-3 of tokens). A failed push moves most tokens, so the p99 sees it; a rare tail does not.

Why a reference: the first measured step of a run is measured before any push is trusted (both sides
loaded the same files, or a verified reset push), so its statistic is the kernels' own mismatch (bf16:
vLLM's kernels against the learner's). A later step alarms above max(the dtype's tolerance,
`sync_canary_factor` × that reference); the first step against the tolerance alone. Above it, a
worker generates with a policy that is not the learner's: a wrong policy is worse than a stopped run,
so this alarm's own action (`trainer.alarm_limits.sync_canary_action`) is `stop` by default. A step
whose rollouts are stale (async, `async/staleness` > 0) is not checked: they were sampled by an older
policy than the learner's. Measurements behind the defaults: docs/RUNS.md "Alarms". Pure: no engines,
no MLflow.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Mapping, Optional

from stapoctl.config.alarms import AlarmLimits
from stapoctl.trainer.alarms import Alarm

CANARY = "rollout/logprob_diff_p99"  # losses/drift.py logs it over the whole batch
_PER_WORKER = re.compile(r"^rollout/logprob_diff_p99/worker_(\d+)$")


def tolerance(limits: AlarmLimits, dtype: str) -> float:
    return float(limits.sync_canary_fp32 if str(dtype) in ("float32", "fp32") else limits.sync_canary_bf16)


def diff_p99(learner_log_prob, rollout_log_prob, response_mask) -> float:
    """p99 of |learner − vLLM| log-prob over the response tokens ([N, R] tensors): the definition
    losses/drift.py gives `rollout/logprob_diff_p99` (`masked_quantile`, linear, q = drift.P)."""
    from stapoctl.losses.drift import P
    from stapoctl.losses.masks import masked_quantile

    mask = response_mask.bool().cpu()
    d = (learner_log_prob.detach().float().cpu() - rollout_log_prob.detach().float().cpu()).abs()
    return float(masked_quantile(d, mask, P))


def per_worker_p99(learner_log_prob, rollout_log_prob, response_mask, workers: list[int]) -> dict[str, float]:
    """`rollout/logprob_diff_p99/worker_<j>` of each rollout worker's rows (`workers`: the worker of
    each row); empty with one worker (the batch's own p99 is that worker's)."""
    import torch

    if len(set(workers)) < 2 or len(workers) != len(learner_log_prob):
        return {}
    out = {}
    for j in sorted(set(workers)):
        rows = torch.as_tensor([k for k, w in enumerate(workers) if w == j])
        out[f"{CANARY}/worker_{j}"] = diff_p99(learner_log_prob[rows], rollout_log_prob[rows], response_mask[rows])
    return out


class SyncCanary:
    """Feed it each step's metrics; it names the first worker whose canary is above its threshold."""

    def __init__(self, limits: AlarmLimits, dtype: str, method: str,
                 name_worker: Callable[[int], str] = lambda i: f"rollout worker {i}"):
        self.limits, self.dtype, self.method, self.name_worker = limits, str(dtype), str(method), name_worker
        self.tol = tolerance(limits, dtype)
        self.fired = False
        self.reference: Optional[float] = None  # the statistic at the run's first measured step …
        self.reference_step: Optional[int] = None  # … and that step

    def threshold(self) -> float:
        """The dtype's tolerance, or `sync_canary_factor` × the reference where that is higher."""
        if self.reference is None:
            return self.tol
        return max(self.tol, float(self.limits.sync_canary_factor) * self.reference)

    def feed(self, step: int, metrics: Mapping[str, float]) -> list[Alarm]:
        if self.fired or self.tol <= 0 or float(metrics.get("async/staleness", 0) or 0) > 0:
            return []  # stale rollouts (async) were sampled by an older policy: the difference is real
        per_worker = {int(m.group(1)): v for k, v in metrics.items() if (m := _PER_WORKER.match(k))}
        seen = {i: float(v) for i, v in (per_worker or ({0: metrics[CANARY]} if CANARY in metrics else {})).items()
                if math.isfinite(float(v))}
        if not seen:
            return []
        limit = self.threshold()
        over = [(i, v) for i, v in sorted(seen.items()) if v > limit]
        if self.reference is None:  # the first measured step: both sides hold the same weights
            self.reference, self.reference_step = max(seen.values()), step
        if not over:
            return []
        self.fired = True
        return [self._alarm(step, over, limit)]

    def _alarm(self, step: int, over: list[tuple[int, float]], limit: float) -> Alarm:
        worst, value = max(over, key=lambda iv: iv[1])
        others = f" (also {', '.join(self.name_worker(i) for i, _ in over if i != worst)})" if len(over) > 1 else ""
        key = "sync_canary_fp32" if self.tol == self.limits.sync_canary_fp32 else "sync_canary_bf16"
        if self.reference_step is None or self.reference_step == step:
            basis = "the run's first measured step: no reference yet"
        else:
            basis = (f"reference {self.reference:.2e} at step {self.reference_step} × "
                     f"sync_canary_factor {self.limits.sync_canary_factor:g} = "
                     f"{self.limits.sync_canary_factor * self.reference:.2e}")
        message = (f"alarm sync_canary at step {step}: {self.name_worker(worst)}'s log-probs are {value:.2e} from the "
                   f"learner's after the {self.method} push{others} (p99 |Δ log p| over its response tokens; "
                   f"limit {limit:.2e}: tolerance {self.tol:g} in {self.dtype}, trainer.alarm_limits.{key}; {basis}): "
                   f"vLLM may not hold the learner's weights")
        return Alarm("sync_canary", step, message, action=self.limits.sync_canary_action,
                     setting="trainer.alarm_limits.sync_canary_action")
