"""What a learner rank returns to the driver from one training step: scalar metrics for MLflow,
and the per-token tensors of the measuring pass as typed fields (never inside the metrics dict)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class StepResult:
    """`metrics`: name → float, every value MLflow logs. The tensors are rank 0's, all ranks' rows:

    - `old_log_probs`, `entropy` [N, R]: the learner's no-grad pass over the batch (None when the
      step skipped it); the token diagnostics read them.
    - `logprob_diff_rows` [N]: per row, max |learner − vLLM| log-prob (the sync canary per worker).
    """

    metrics: dict[str, float] = field(default_factory=dict)
    old_log_probs: Optional[Any] = None
    entropy: Optional[Any] = None
    logprob_diff_rows: Optional[Any] = None
