"""The DAPO rule reward used by STAPO: +1 for a correct final boxed answer, -1 otherwise."""

from __future__ import annotations

from stapoctl.reward.checker import is_equivalent
from stapoctl.reward.equivalence import DEFAULT_TIMEOUT_S
from stapoctl.reward.extract import extract_answer


def dapo_reward(
    response: str,
    reference: str,
    correct: float = 1.0,
    incorrect: float = -1.0,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> float:
    """`correct` if the last \\boxed{} answer matches `reference`, else `incorrect` (no box: incorrect).

    STAPO uses R in {-1, 1}; other recipes set e.g. correct=1, incorrect=0. Batches belong in
    `RewardPool.score`, which checks in parallel.
    """
    answer = extract_answer(response)
    if answer is None:
        return incorrect
    return correct if is_equivalent(answer, reference, timeout_s=timeout_s) else incorrect
