"""Learner → every rollout actor, after each step, by the transport `sync.transports` registers
under the run's `rollout.weight_sync` (auto: picked from the hardware).

The driver's strategies (`PUSHES`), named by each transport:
- "object_store" (CPU): the learner's rank 0 puts its named tensors into Ray's object store once;
  every rollout actor reads them (zero-copy on the same node) and loads them in place through the
  vLLM worker extension. Nothing is written to disk.
- "engine" (gloo, NCCL): vLLM's weight-transfer engines, linked once (`init_weight_transfer` on
  every learner rank). Each push queues one `receive_weights` call on every rollout actor — from
  the driver, so it runs after the rollouts the driver sent before (Ray orders calls per caller)
  and before any sent after — then every learner rank's `send_weights`.
- "engine_learner_driven" (CUDA IPC): the learner makes the actors' update call itself (its IPC
  handles exist only once it shares its tensors), so a push is always waited for.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from stapoctl.sync.transports import choose_method, transport

__all__ = ["WeightSync", "choose_method", "PUSHES"]


class ObjectStorePush:
    synchronous = False

    def __init__(self, learners: Sequence[Any], workers: Sequence[Any], method: str, link: dict):
        self.learners = list(learners)

    def start(self, workers: Sequence[Any]) -> list:
        """The loads, queued on each actor behind its earlier calls; rank > 0's `weights` call joins
        ZeRO-3's gather and returns nothing."""
        refs = [lrn.weights.remote() for lrn in self.learners]
        return [w.update_weights.remote(refs[0]) for w in workers] + refs[1:]


class EnginePush:
    synchronous = False

    def __init__(self, learners: Sequence[Any], workers: Sequence[Any], method: str, link: dict):
        import ray

        self.learners, self.workers = list(learners), list(workers)
        ray.get([lrn.init_weight_transfer.remote(method, self.workers, **link) for lrn in self.learners])
        self.update_info = self.fixed_update_info()

    def fixed_update_info(self):
        """What every actor's queued call receives: names, dtypes, shapes (fixed for the link's life)."""
        import ray

        return ray.get(self.learners[0].transfer_update_info.remote())

    def start(self, workers: Sequence[Any]) -> list:
        received = [w.receive_weights.remote(self.update_info) for w in self.workers]
        return received + [lrn.send_weights.remote() for lrn in self.learners]


class LearnerDrivenPush(EnginePush):
    synchronous = True

    def fixed_update_info(self):
        return None  # the learner builds each update (CUDA IPC handles) and sends it itself

    def start(self, workers: Sequence[Any]) -> list:
        return [lrn.send_weights.remote() for lrn in self.learners]


PUSHES = {"object_store": ObjectStorePush, "engine": EnginePush, "engine_learner_driven": LearnerDrivenPush}


class WeightSync:
    """`link`: what a linked transport needs besides the actors (`tp_size`, `timeout_s`)."""

    def __init__(self, learners: Sequence[Any], workers: Sequence[Any], method: str, *, tp_size: int = 1,
                 timeout_s: float = 1800.0):
        self.learners, self.workers, self.method = list(learners), list(workers), method
        self._inflight: list = []
        link = {"tp_size": int(tp_size), "timeout_s": float(timeout_s)}
        self._push = PUSHES[transport(method).push](self.learners, self.workers, method, link)

    def push_async(self) -> None:
        """Start a push and return at once (asynchronous training): the load queues behind the
        rollouts already sent to each actor, so they finish with the weights they started with.
        `wait()` collects it (errors surface there); a new push waits for the previous one."""
        self.wait()
        self._inflight = self._push.start(self.workers)
        if self._push.synchronous:
            self.wait()

    def wait(self) -> None:
        import ray

        inflight, self._inflight = self._inflight, []
        if inflight:
            ray.get(inflight)

    def push(self) -> dict[str, float]:
        """Send the learner's current weights to every rollout actor; returns timings."""
        import ray

        self.wait()
        t0 = time.perf_counter()
        results = ray.get(self._push.start(self.workers))
        loads = [r["sync_load_s"] for r in results if isinstance(r, dict) and "sync_load_s" in r]
        return {"timing_s/sync": time.perf_counter() - t0, "timing_s/sync_load": max(loads, default=float("nan"))}

    def push_to(self, workers: Sequence[Any]) -> None:
        """Current weights to some actors only (restarted ones), where the transport can re-link them."""
        import ray

        ray.get(self._push.start(list(workers)))
