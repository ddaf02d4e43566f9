"""The reward path of training and evaluation: extract each response's final answer, check it
against the reference in the deadline-bounded `EquivalenceChecker`, and (when one is given) let
a judge model correct the verdicts (`rollout.model_verifier`, an engine user built by the caller).
"""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass
from typing import Any, Sequence

from stapoctl.reward.checker import EquivalenceChecker
from stapoctl.reward.extract import extract_answer


@dataclass
class Verdict:
    """One response judged against its reference: auditable in the eval JSONL."""

    extracted: str | None
    correct: bool
    timed_out: bool = False
    error: bool = False  # the check crashed its verifier process or raised: scored incorrect


# what an evaluation protocol records of the verifier (eval/protocol.py): bump the version whenever
# a verdict could change (normalization, equivalence rules), so tables never mix the two.
# 2: bare list golds compare as tuple / multiset by their answer kind, not as math-verify's set
VERIFIER = {"name": "dapo_rule_verifier", "version": 2}


class RewardPool:
    """Scores responses against references with the DAPO rule (and the model verifier if set)."""

    name = VERIFIER["name"]  # logged by the trainer as the reward scorer

    def __init__(self, reward_cfg, model_verifier: Any = None):
        self.correct = float(reward_cfg.correct)
        self.incorrect = float(reward_cfg.incorrect)
        self.timeout_s = float(reward_cfg.verify_timeout_s)
        if self.timeout_s <= 0:
            from stapoctl.errors import UserError

            raise UserError(f"reward.verify_timeout_s must be > 0 (got {self.timeout_s}): set e.g. reward.verify_timeout_s=5")
        self.checker = EquivalenceChecker(
            num_workers=int(reward_cfg.num_workers),
            max_memory_gb=float(getattr(reward_cfg, "verify_max_memory_gb", 4.0)),
        )
        self.model_verifier = model_verifier  # `rollout.model_verifier.reward_pool` attaches the judge
        atexit.register(self.close)

    def judge(
        self,
        responses: Sequence[str],
        references: Sequence[str],
        questions: Sequence[str] | None = None,
        kinds: Sequence[str | None] | None = None,
    ) -> list[Verdict]:
        """Extract, check (in parallel, time-limited) and optionally let the verifier model correct.

        `kinds`: each reference's answer kind as data prep wrote it (`answer_kind`: scalar /
        multiset / tuple, how a bare list gold compares); None: each gold's form decides."""
        if len(responses) != len(references):
            raise ValueError(f"{len(responses)} responses but {len(references)} references")
        extracted = [extract_answer(r) for r in responses]
        pairs = [("" if e is None else e, ref) for e, ref in zip(extracted, references)]
        checked = self.checker.check_detailed(pairs, self.timeout_s, kinds)
        verdicts = [Verdict(e, ok and e is not None, to, err) for e, (ok, to, err) in zip(extracted, checked)]
        if self.model_verifier is not None and questions is not None:
            verdicts = self.model_verifier.correct(questions, references, responses, verdicts)
        return verdicts

    def score(
        self,
        responses: Sequence[str],
        references: Sequence[str],
        questions: Sequence[str] | None = None,
        kinds: Sequence[str | None] | None = None,
    ) -> tuple[list[float], dict[str, float]]:
        """Rewards (correct/incorrect values from the config) and reward/* stats for the batch."""
        start = time.perf_counter()
        verdicts = self.judge(responses, references, questions, kinds)
        rewards = [self.correct if v.correct else self.incorrect for v in verdicts]
        n = max(1, len(verdicts))
        stats = {
            "reward/mean": sum(rewards) / n,
            "reward/accuracy": sum(v.correct for v in verdicts) / n,
            "reward/no_answer": sum(v.extracted is None for v in verdicts) / n,
            "reward/verify_timeouts": float(sum(v.timed_out for v in verdicts)),
            "reward/verify_errors": float(sum(v.error for v in verdicts)),
            "timing_s/reward": time.perf_counter() - start,
        }
        return rewards, stats

    def close(self) -> None:
        self.checker.close()
        if self.model_verifier is not None:
            self.model_verifier.close()

    def __getstate__(self):
        raise TypeError("RewardPool holds subprocesses: build one inside the actor from reward_cfg")
