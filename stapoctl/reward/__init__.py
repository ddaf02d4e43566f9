"""Rule-based verifier and rewards: boxed-answer extraction, equivalence, the DAPO reward."""

from stapoctl.reward.dapo import dapo_reward
from stapoctl.reward.checker import is_equivalent
from stapoctl.reward.equivalence import normalize
from stapoctl.reward.extract import extract_answer

__all__ = ["extract_answer", "is_equivalent", "dapo_reward", "normalize"]
