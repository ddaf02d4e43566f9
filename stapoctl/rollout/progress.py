"""A rollout worker's progress, readable while it is busy (issue #49: every wait bounded).

The rollout actor runs one call at a time (`max_concurrency=1`: the sync client's per-caller
order relies on it), so nothing can ask it how far it got while it generates, and a process that
is stopped (SIGSTOP, a wedged kernel or collective, a swapped-out node) answers nothing at all.
So the worker reports instead of being asked: `Heartbeat` counts vLLM's engine steps (a wrapper
around `llm.llm_engine.step`, the one call `LLM.generate`'s loop makes per step; at TP > 1 a step
also waits on every tensor-parallel worker process) and its phases (starting, generating,
receiving weights, idle), and sends them fire-and-forget to a `ProgressBoard` actor — at most
every `every_s`, at once on a phase change, a Ray call of ~0.1 ms. The driver reads the board
(`trainer/stall.py`): a worker whose count and phase stand still while the driver waits on it is
stalled, whether or not its process still answers.
"""

from __future__ import annotations

import os
import time
from typing import Any

# the push's own bound (rollout.weight_sync_timeout_s) covers this phase; an asynchronous push's sends
# wait until every worker reports it (sync/transfer.py, DeferredSends)
RECEIVING = "receiving weights"


class ProgressBoard:
    """A Ray actor (no CPU) holding each worker's last report; ages on the board's own clock."""

    def __init__(self) -> None:
        self._seen: dict[int, dict[str, Any]] = {}

    def beat(self, index: int, count: int, phase: str, pid: int) -> None:
        old = self._seen.get(index)
        now = time.monotonic()
        changed = now if old is None or (old["count"], old["phase"], old["pid"]) != (count, phase, pid) else old["changed"]
        self._seen[index] = {"count": count, "phase": phase, "pid": pid, "changed": changed}

    def read(self) -> dict[int, dict[str, Any]]:
        """index → count, phase, pid and `still_s`: seconds since its count or phase last moved."""
        now = time.monotonic()
        return {i: {**{k: v for k, v in s.items() if k != "changed"}, "still_s": now - s["changed"]}
                for i, s in list(self._seen.items())}


class Heartbeat:
    """In the rollout actor: phases and engine steps, sent to the board (never raises). `board`: the
    board's handle, or its actor name (what a rollout actor is given: a handle among its constructor
    arguments would put them in the object store, where Ray warns a restart may not find them)."""

    def __init__(self, board: Any, index: int, every_s: float = 0.5):
        self.board, self.index, self.every_s = board, int(index), float(every_s)
        self.count, self.current, self._sent = 0, "starting", 0.0
        self.pid = os.getpid()

    def phase(self, name: str) -> None:
        self.current = name
        self._send()

    def tick(self) -> None:
        self.count += 1
        if time.monotonic() - self._sent >= self.every_s:
            self._send()

    def _send(self) -> None:
        self._sent = time.monotonic()
        try:
            if isinstance(self.board, str):  # looked up once, by name (a GCS call of ~1 ms)
                import ray

                self.board = ray.get_actor(self.board)
            self.board.beat.remote(self.index, self.count, self.current, self.pid)
        except Exception:  # the board is an aid to the driver's bound: a worker never fails on it
            pass

    def watch(self, llm: Any) -> None:
        """Count each of vLLM's engine steps (the instance's `step`, wrapped once)."""
        engine = getattr(llm, "llm_engine", None)
        step = getattr(engine, "step", None)
        if step is None or getattr(step, "_stapoctl_heartbeat", False):
            return

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.tick()
            return step(*args, **kwargs)

        counted._stapoctl_heartbeat = True  # type: ignore[attr-defined]
        engine.step = counted


def make_board() -> tuple[Any, str]:
    """The board actor and its name, on the driver's node (no CPU asked: it must never wait for a
    placement). One call at a time: a worker's beats arrive in the order it sent them."""
    import uuid

    import ray

    from stapoctl.launch.ray_runtime import runtime_context

    name = f"stapoctl-progress-{uuid.uuid4().hex[:12]}"
    opts: dict[str, Any] = dict(num_cpus=0, max_concurrency=1, name=name)
    node = getattr(runtime_context(), "get_node_id", lambda: None)()
    if node:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
    return ray.remote(ProgressBoard).options(**opts).remote(), name
