"""DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13) and the overlong-filter counts.

A truncated response usually ends mid-thought, so the rule verifier scores it wrong whatever its
reasoning was worth: a noisy signal. DAPO ramps a length penalty over the last `buffer` tokens
before the budget instead, so the policy learns to finish early rather than being punished for
one hard cut. With L_max = max_length and L_cache = buffer:

    R_length(y) = 0                               |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                = -1                              L_max < |y|

times `factor`, added to the rule reward before advantages. buffer 0 turns it off.
Pure Python (no torch): the trainer passes plain lists.
"""

from __future__ import annotations

from typing import Sequence


def soft_overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
    """The penalty (<= 0) of one response of `length` tokens; 0 when `buffer` is 0 (off)."""
    if buffer <= 0:
        return 0.0
    expected = max_length - buffer
    if length <= expected:
        return 0.0
    if length <= max_length:
        return factor * (expected - length) / buffer
    return -factor


def overlong_penalties(lengths: Sequence[int], max_length: int, buffer: int, factor: float = 1.0) -> list[float]:
    return [soft_overlong_penalty(int(n), max_length, buffer, factor) for n in lengths]


def overlong_stats(penalties: Sequence[float], truncated: Sequence[bool], filtered: bool) -> dict[str, float]:
    """`reward/overlong_*` of a batch: the mean penalty, the share penalised, the share truncated and,
    when the overlong filter is on, how many rows (the truncated ones) leave the loss."""
    n = max(1, len(penalties))
    stats = {
        "reward/overlong_penalty_mean": sum(penalties) / n,
        "reward/overlong_frac": sum(p != 0 for p in penalties) / n,
        "reward/truncated_frac": sum(bool(t) for t in truncated) / n,
    }
    if filtered:
        stats["reward/overlong_filtered"] = float(sum(bool(t) for t in truncated))
    return stats
