"""The weight-sync canary as an alarm: vLLM's log-probs against the learner's on the steps the
learner measures them (`rollout/logprob_diff_max`, per rollout worker where there are several).

After a correct push the two agree to float noise in fp32 (~5e-6 measured here, 1e-4 is the e2e
tests' bound); in bf16 their kernels differ (the training–inference mismatch: max |Δ log p| up to
`sync_canary_bf16` measured on the embedded default, docs/RUNS.md "Alarms"). Above the tolerance of
the run's dtype, a worker generates with a policy that is not the learner's: a wrong policy is worse
than a stopped run, so this alarm's own action (`trainer.alarm_limits.sync_canary_action`) is
`stop` by default. A step whose rollouts are stale (async, `async/staleness` > 0) is not checked:
they were sampled by an older policy than the learner's. Pure: no engines, no MLflow.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Mapping

from stapoctl.config.alarms import AlarmLimits
from stapoctl.trainer.alarms import Alarm

CANARY = "rollout/logprob_diff_max"
_PER_WORKER = re.compile(r"^rollout/logprob_diff_max/worker_(\d+)$")


def tolerance(limits: AlarmLimits, dtype: str) -> float:
    return float(limits.sync_canary_fp32 if str(dtype) in ("float32", "fp32") else limits.sync_canary_bf16)


class SyncCanary:
    """Feed it each step's metrics; it names the first worker whose canary is above the tolerance."""

    def __init__(self, limits: AlarmLimits, dtype: str, method: str,
                 name_worker: Callable[[int], str] = lambda i: f"rollout worker {i}"):
        self.limits, self.dtype, self.method, self.name_worker = limits, str(dtype), str(method), name_worker
        self.tol = tolerance(limits, dtype)
        self.fired = False

    def feed(self, step: int, metrics: Mapping[str, float]) -> list[Alarm]:
        if self.fired or self.tol <= 0 or float(metrics.get("async/staleness", 0) or 0) > 0:
            return []  # stale rollouts (async) were sampled by an older policy: the difference is real
        per_worker = {int(m.group(1)): v for k, v in metrics.items() if (m := _PER_WORKER.match(k))}
        seen = per_worker or ({0: metrics[CANARY]} if CANARY in metrics else {})
        over = [(i, float(v)) for i, v in sorted(seen.items()) if math.isfinite(float(v)) and float(v) > self.tol]
        if not over:
            return []
        self.fired = True
        worst, value = max(over, key=lambda iv: iv[1])
        others = f" (also {', '.join(self.name_worker(i) for i, _ in over if i != worst)})" if len(over) > 1 else ""
        key = "sync_canary_fp32" if self.tol == self.limits.sync_canary_fp32 else "sync_canary_bf16"
        message = (f"alarm sync_canary at step {step}: {self.name_worker(worst)}'s log-probs are {value:.2e} from the "
                   f"learner's after the {self.method} push{others} (max |Δ log p|; tolerance {self.tol:g} in "
                   f"{self.dtype}, trainer.alarm_limits.{key}): vLLM may not hold the learner's weights")
        return [Alarm("sync_canary", step, message, action=self.limits.sync_canary_action,
                      setting="trainer.alarm_limits.sync_canary_action")]
