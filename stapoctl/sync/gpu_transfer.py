"""Learner → vLLM weight transfer on GPUs through vLLM's weight-transfer API (the trainer side).

UNTESTED HERE: this machine has no GPU. The code follows vLLM 0.32's trainer-side engines
(`NCCLTrainerWeightTransferEngine`, `IPCTrainerWeightTransferEngine`) driven through
`RayVLLMWeightSyncClient`, whose four calls our `RolloutWorker` actor implements.
CUDA IPC needs learner and rollout on the same GPU (colocated placement); NCCL broadcast
works across GPUs and nodes (disaggregated placement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class TrainerLink:
    """What the learner's rank passes to a trainer engine's `build`."""

    module: Any
    rollout_handles: Sequence[Any]
    rank: int
    master_address: str
    master_port: int
    vllm_world_size: int  # every vLLM worker process: actors × tensor-parallel ranks


class IPCTrainer:
    @staticmethod
    def build(link: TrainerLink):
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        return IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=link.rank), client=RayVLLMWeightSyncClient(list(link.rollout_handles)),
            source=ModuleSource(link.module))


class NCCLTrainer:
    @staticmethod
    def build(link: TrainerLink):
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        info = NCCLTrainerInitInfo(master_address=link.master_address, master_port=link.master_port,
                                   world_size=1 + link.vllm_world_size, rank=link.rank)
        return NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=RayVLLMWeightSyncClient(list(link.rollout_handles)), source=ModuleSource(link.module))


def build_trainer_engine(method: str, link: TrainerLink):
    """The registered transport's trainer engine, on one learner rank."""
    import importlib

    from stapoctl.sync.transports import transport

    module, _, cls = str(transport(method).trainer).partition(":")
    return getattr(importlib.import_module(module), cls).build(link)
