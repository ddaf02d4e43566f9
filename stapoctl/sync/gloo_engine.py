"""The worker side of the gloo weight transport, as a vLLM `WeightTransferEngine` (registered under
`stapo_gloo` by `sync.worker_extension`, which vLLM imports into every worker process).

A real transport on CPU: torch.distributed gloo over TCP, the same round as vLLM's NCCL engine —
start (vLLM's layerwise reload begins), receive (byte buckets broadcast from the learner's rank 0,
each tensor loaded through the model's `load_weights`), finish (the reload is finalised). Between
start and finish the model is half-loaded: the rollout actor runs the three in one call
(`RolloutWorker.receive_weights`), so no generation can land in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from stapoctl.sync import buckets, gloo_group

BACKEND = "stapo_gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 1800.0
    bucket_bytes: int = buckets.DEFAULT_BUCKET_BYTES


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list
    dtype_names: list
    shapes: list

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have one entry per tensor")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.bucket_bytes = buckets.DEFAULT_BUCKET_BYTES
        self.rank = -1

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.rank = gloo_group.worker_rank(self.parallel_config, init_info.rank_offset)
        self.bucket_bytes = int(init_info.bucket_bytes)
        self.group = gloo_group.open_group(init_info.master_address, init_info.master_port, self.rank,
                                           init_info.world_size, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on CPU; gloo's
        # broadcast has completed when `wait()` returns, so there is nothing to synchronise
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        import torch

        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: init_weight_transfer_engine first")
        for idx in buckets.plan(update_info.dtype_names, update_info.shapes, self.bucket_bytes):
            dts = [update_info.dtype_names[i] for i in idx]
            shapes = [update_info.shapes[i] for i in idx]
            buf = torch.empty(sum(buckets.nbytes(d, s) for d, s in zip(dts, shapes)), dtype=torch.uint8)
            gloo_group.broadcast(self.group, buf)
            self.model.load_weights(list(zip([update_info.names[i] for i in idx], buckets.unpack(buf, dts, shapes))))

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Into vLLM's factories, once per process (a second registration raises there)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
