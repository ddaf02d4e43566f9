"""`trainer.alarm_limits`: the thresholds of the run-health alarms (trainer/alarms.py).

Conservative on purpose: the embedded default run (`stapoctl train`, 60 steps) raises none, and a
run whose entropy collapses (docs/RUNS.md "Alarms") raises `entropy_collapse` before its reward
reaches the floor.
"""

from __future__ import annotations

from dataclasses import dataclass

from stapoctl.config.fields import spec
from stapoctl.config.ranges import NON_NEGATIVE, POSITIVE, POSITIVE_INT

SHARE = "[0, 1]"


@dataclass
class AlarmLimits:
    # mean token entropy (actor/entropy, nats) below this: collapsed (the default tiny run ends near 0.2)
    entropy_floor: float = spec(0.03, range=NON_NEGATIVE)
    # or falling by this fraction within entropy_window steps (3-step means compared)
    entropy_drop: float = spec(0.5, range="(0, 1]")
    entropy_window: int = spec(10, range=POSITIVE_INT)
    # or rising: the 3-step mean this multiple of the lowest step seen (a learning rate too high
    # blows the policy up into noise: the embedded default at lr 3e-3, docs/RUNS.md "Alarms")
    entropy_rise: float = spec(3.0, range="(1, inf)")
    # actor/grad_norm this many standard deviations above its trailing grad_window steps …
    grad_z: float = spec(6.0, range=POSITIVE)
    grad_window: int = spec(20, range="[2, inf)")
    # … and at least this multiple of their mean (a flat history has a std near 0)
    grad_ratio: float = spec(3.0, range=NON_NEGATIVE)
    # response_length/clip_ratio (share cut at rollout.max_response_length) at least this …
    length_cap_share: float = spec(0.5, range=SHARE)
    length_cap_steps: int = spec(3, range=POSITIVE_INT)  # … for this many consecutive steps
    # reward/accuracy at 0 or at 1 for this many consecutive steps
    reward_flat_steps: int = spec(10, range=POSITIVE_INT)
    # rollout_corr/kl_k3 (3-step mean) above this and mismatch_rise × its first 5 steps' median
    mismatch_kl: float = spec(0.01, range=NON_NEGATIVE)
    mismatch_rise: float = spec(10.0, range=NON_NEGATIVE)
    # stapo/spurious_ratio above spurious_jump × its trailing 10-step mean and above spurious_floor
    spurious_jump: float = spec(5.0, range=POSITIVE)
    spurious_floor: float = spec(0.005, range=SHARE)
    # a configured term that never changed an update for this many steps (trainer/inert.py: STAPO's
    # mask on no token, a KL term of 0, …) raises inert_knobs, then inert_action (0: never); the run's
    # end names such knobs whatever this is
    inert_steps: int = spec(20, range=NON_NEGATIVE)
    inert_action: str = spec("warn", choices=("warn", "checkpoint", "stop"))
    # the weight-sync canary (trainer/sync_canary.py): the p99 of |Δ log p| between vLLM's and the
    # learner's log-probs over each rollout worker's response tokens (rollout/logprob_diff_p99[/worker_j]).
    # The run's first measured step is its reference (same weights on both sides: the kernels' own
    # mismatch); a later step alarms above max(the dtype's tolerance, sync_canary_factor × reference),
    # the first step above the tolerance alone. Measured on the embedded default (docs/RUNS.md "Alarms"):
    # fp32 p99 ~2e-6; bf16 0.016–0.057 per step, 0.045 at step 1, a later step ≤ 1.28× that. 0 turns
    # the check off (factor 0: the tolerance alone). Its own action, stop by default: a wrong policy is
    # worse than a stopped run
    sync_canary_fp32: float = spec(1e-4, range=NON_NEGATIVE)
    sync_canary_bf16: float = spec(0.4, range=NON_NEGATIVE)
    sync_canary_factor: float = spec(4.0, range=NON_NEGATIVE)
    sync_canary_action: str = spec("stop", choices=("warn", "checkpoint", "stop"))
