"""The driver's bound on a rollout worker that stops making progress (`rollout.stall_timeout_s`).

While the driver waits on calls to the rollout actors (their start-up, a step's rollouts), it reads
the workers' progress board (`rollout/progress.py`) every `POLL_S`. A worker it waits on whose
engine-step count and phase have not moved for `rollout.stall_timeout_s` — counted from when the
driver started waiting, or from its last progress if that came later — ends the run FAILED in one
`EngineFault` line naming it (pid, node), what it was doing and how long it stood still. Slow but
moving generation never trips it: every engine step moves the count.

Which bound wins: a worker inside a weight push (phase "receiving weights") is left to the push's
own bound, `rollout.weight_sync_timeout_s` (`sync/transfer.py`), which names it as "stopped
answering mid-push"; everything else it does is this bound's, also the rollouts an asynchronous
push waits behind (its sends wait until `receiving` shows every worker inside the push, and its
bound counts from them: issue #49 R1). A stall fails the run on every transport: Ray restarts
only a process that died, and a stalled one has not (the object store's restart-and-resend,
`rollout.max_restarts`, stays for dead actors). The engines are then stopped without waiting on
the stalled actor (`Engines.shutdown`'s short grace).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from stapoctl.errors import EngineFault
from stapoctl.rollout.progress import RECEIVING

POLL_S = 1.0


class StallWatch:
    """`wait(refs)` is `ray.wait` for all of them, bounded by the workers' progress."""

    def __init__(self, board: Any, timeout_s: float, label: Callable[[int], str] = lambda i: f"rollout worker {i}"):
        self.board, self.timeout_s, self.label = board, float(timeout_s), label
        self.stalled: Optional[int] = None  # the worker that stalled, once one has
        self._unread_since: Optional[float] = None  # the board has not answered since then

    def wait(self, refs: dict, doing: str, deadline_label: str = "") -> None:
        """Until every ref in `refs` (ref → the rollout worker index it waits on, or None for another
        actor, e.g. a learner rank, bounded by the timeout as a plain deadline) is ready."""
        import ray

        start = time.monotonic()
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            if pending:
                self.check({refs[r] for r in pending}, start, doing, deadline_label)

    def check(self, waiting: set, start: float, doing: str, deadline_label: str = "") -> None:
        """Raise for the first worker of `waiting` that stood still too long (None: the deadline)."""
        waited = time.monotonic() - start
        if waited <= self.timeout_s:
            return
        workers = sorted(w for w in waiting if w is not None)
        board = self.read()
        if board is None:  # no reading is no evidence: only a board silent for the whole bound ends the run
            self._unread_since = self._unread_since or time.monotonic()
            if workers and time.monotonic() - self._unread_since > self.timeout_s:
                raise EngineFault(f"the rollout workers' progress board did not answer for {self.timeout_s:g} s "
                                  f"while {doing} (rollout.stall_timeout_s): the driver cannot see their progress")
            return
        self._unread_since = None
        for w in workers:
            seen = board.get(w)
            still = min(waited, seen["still_s"]) if seen else waited
            if seen and seen["phase"] == RECEIVING:
                continue  # the push's bound (rollout.weight_sync_timeout_s) names it
            if still > self.timeout_s:
                self.stalled = w
                phase = f"; its last report: {seen['phase']}, {seen['count']} engine steps" if seen else \
                    "; it never reported (its process may not have started)"
                raise EngineFault(f"{self.label(w)} made no progress for {still:.0f} s while {doing} "
                                  f"(rollout.stall_timeout_s={self.timeout_s:g}{phase})")
        if None in waiting:
            raise EngineFault(f"{deadline_label or 'an engine actor'} did not finish {doing} within "
                              f"rollout.stall_timeout_s={self.timeout_s:g}")

    def receiving(self) -> Optional[set]:
        """The workers the board shows inside a weight push (None: the board did not answer)."""
        board = self.read()
        return None if board is None else {i for i, seen in board.items() if seen["phase"] == RECEIVING}

    def read(self) -> Optional[dict]:
        """The board, or None when it does not answer in time."""
        import ray

        try:
            return ray.get(self.board.read.remote(), timeout=10.0)
        except Exception:
            return None
