"""Learner → vLLM weight transfer on GPUs through vLLM's weight-transfer API.

UNTESTED HERE: this machine has no GPU. The code follows vLLM 0.32's trainer-side engines
(`NCCLTrainerWeightTransferEngine`, `IPCTrainerWeightTransferEngine`) driven through
`RayVLLMWeightSyncClient`, whose four calls our `RolloutWorker` actor implements.
CUDA IPC needs learner and rollout on the same GPU (colocated placement); NCCL broadcast
works across GPUs and nodes (disaggregated placement).
"""

from __future__ import annotations

from typing import Any, Sequence


def choose_backend(placement: str) -> str:
    """IPC when learner and vLLM share a device, NCCL broadcast otherwise."""
    return "ipc" if placement == "colocated" else "nccl"


def make_trainer_engine(
    backend: str,
    module: Any,
    rollout_handles: Sequence[Any],
    *,
    rank: int,
    master_address: str,
    master_port: int,
    vllm_world_size: int,
):
    """The trainer side of the link; rank 0 drives the handshake, other ranks only gather."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    client = RayVLLMWeightSyncClient(list(rollout_handles))
    source = ModuleSource(module)
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerInitInfo,
            IPCTrainerWeightTransferEngine,
        )

        return IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=rank), client=client, source=source
        )
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        info = NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=1 + vllm_world_size,  # the sender plus every vLLM worker
            rank=rank,
        )
        return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
    raise ValueError(f"unknown weight-transfer backend {backend!r}: use nccl or ipc")
