"""Learner → every rollout actor, after each step; the method is picked from the hardware.

- CPU ("object_store"): the learner's rank 0 puts its named tensors into Ray's object store
  once; every rollout actor reads them (zero-copy on the same node) and loads them in place
  through the vLLM worker extension. Nothing is written to disk.
- GPU ("nccl" | "ipc", UNTESTED here): vLLM's weight-transfer engines, set up once
  (`gpu_transfer.py`); each sync is a broadcast (NCCL) or a handle exchange (CUDA IPC).
"""

from __future__ import annotations

import time
from typing import Any, Sequence


def choose_method(requested: str, *, on_gpu: bool, placement: str) -> str:
    from stapoctl.errors import UserError

    if requested == "auto":
        if not on_gpu:
            return "object_store"
        from stapoctl.sync.gpu_transfer import choose_backend

        return choose_backend(placement)
    if requested not in ("object_store", "nccl", "ipc"):
        raise UserError(f"rollout.weight_sync='{requested}': use auto, object_store, nccl or ipc")
    if requested in ("nccl", "ipc") and not on_gpu:
        raise UserError(f"rollout.weight_sync='{requested}' needs GPUs; on CPU use auto or object_store")
    return requested


class WeightSync:
    def __init__(self, learners: Sequence[Any], workers: Sequence[Any], method: str, *, vllm_world_size: int = 1):
        import ray

        self.learners, self.workers, self.method = list(learners), list(workers), method
        self._inflight: list = []
        if method in ("nccl", "ipc"):
            ray.get([
                lrn.init_weight_transfer.remote(method, self.workers, vllm_world_size * len(self.workers))
                for lrn in self.learners
            ])

    def push_async(self) -> None:
        """Start a push and return at once (asynchronous training): the load queues behind the
        rollouts already sent to each actor, so they finish with the weights they started with.
        `wait()` collects it (errors surface there); a new push waits for the previous one."""
        self.wait()
        if self.method == "object_store":
            refs = [lrn.weights.remote() for lrn in self.learners]
            self._inflight = [w.update_weights.remote(refs[0]) for w in self.workers] + refs[1:]
        else:
            self._inflight = [lrn.send_weights.remote() for lrn in self.learners]

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
        if self.method == "object_store":
            # One object, read by every worker; rank > 0 returns nothing but joins ZeRO-3's gather.
            refs = [lrn.weights.remote() for lrn in self.learners]
            weights_ref = refs[0]
            loads = ray.get([w.update_weights.remote(weights_ref) for w in self.workers])
            if len(refs) > 1:
                ray.get(refs[1:])
            load_s = max(x["sync_load_s"] for x in loads)
        else:
            ray.get([lrn.send_weights.remote() for lrn in self.learners])
            load_s = float("nan")
        return {"timing_s/sync": time.perf_counter() - t0, "timing_s/sync_load": load_s}
