"""stapoctl's `VLLMWeightSyncClient` over the rollout actors (the four calls of vLLM's protocol).

Unlike vLLM's `RayVLLMWeightSyncClient`, which sends one init request to every actor, each actor
gets its own rank offset, 1 + i × TP ranks: independent `LLM`s all have data-parallel index 0, so
with one shared offset every engine's first worker would claim the same rank and the rendezvous
would hang. Only a transport with a rendezvous (`rank_offsets=True`: gloo, NCCL) gets offsets; CUDA
IPC's init payload is vLLM's own `{"packed": ...}`, which its worker parses strictly
(`IPCWeightTransferInitInfo(**d)`: an extra `rank_offset` key fails the link).

With `queued_by_driver` (gloo, NCCL) an update is one call on each actor, `receive_weights`
(start, receive, finish), which the driver has already queued behind the rollouts it sent before
(Ray orders calls per caller only): the client's update calls do nothing and the learner only
sends. Between start and finish vLLM's model is half-loaded, so three separate calls could let a
rollout in between. Otherwise (CUDA IPC, whose handles exist only once the learner shares its
tensors) the client makes the three calls itself, in a push the driver waits for.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


class RolloutActorsClient:
    def __init__(self, handles: Sequence[Any], tp_size: int, *, queued_by_driver: bool = True,
                 rank_offsets: bool = True, timeout_s: Optional[float] = None):
        self.handles, self.tp_size, self.queued_by_driver = list(handles), int(tp_size), queued_by_driver
        self.with_offsets, self.timeout_s = rank_offsets, timeout_s

    def rank_offsets(self) -> list[int]:
        return [1 + i * self.tp_size for i in range(len(self.handles))]

    def init_payloads(self, init_info: dict[str, Any]) -> list[dict[str, Any]]:
        """What each actor's `init_weight_transfer_engine` receives, in actor order."""
        if not self.with_offsets:
            return [dict(init_info) for _ in self.handles]
        return [dict(init_info, rank_offset=offset) for offset in self.rank_offsets()]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        import ray

        ray.get([h.init_weight_transfer_engine.remote(payload)
                 for h, payload in zip(self.handles, self.init_payloads(init_info))], timeout=self.timeout_s)

    def start_weight_update(self) -> None:
        """Driver-queued: part of `receive_weights` on the actor."""
        self._each("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._each("update_weight_chunk", update_info)

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._each("finish_weight_update")

    def _each(self, method: str, *args: Any) -> None:
        """Learner-driven only (CUDA IPC, whose push the driver waits for): one call per actor."""
        import ray

        if not self.queued_by_driver:
            ray.get([getattr(h, method).remote(*args) for h in self.handles], timeout=self.timeout_s)

    def shutdown_weight_transfer_engine(self) -> None:
        import ray

        ray.get([h.shutdown_weight_transfer_engine.remote() for h in self.handles])
