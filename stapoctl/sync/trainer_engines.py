"""The trainer side of each engine transport (`sync.transports`), on every learner rank.

gloo and NCCL share stapoctl's code: the client with per-actor rank offsets, the state-dict source
(tied weights kept; ZeRO-3 gathered one parameter at a time), the rendezvous (the workers join on a
side thread while rank 0 opens its end) and the send loop; they differ only in how rank 0 opens
its end and broadcasts. vLLM's own NCCL trainer engine cannot be used: it gives every worker
`rank_offset=1`. CUDA IPC is vLLM's engine as it is.

NCCL and IPC are UNTESTED here (no GPU with vLLM was ever available); gloo runs in CI through the
same `CollectiveTrainer`.
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from stapoctl.sync import buckets, gloo_group
from stapoctl.sync.client import RolloutActorsClient
from stapoctl.sync.source import weight_source


@dataclass
class TrainerLink:
    """What a learner rank passes to a transport's trainer engine."""

    module_of: Callable[[], Any]  # the rank's current module (a sweep's reset replaces it)
    zero_stage: int
    rollout_handles: Sequence[Any]
    rank: int
    master_address: str
    master_port: int
    tp_size: int  # vLLM worker processes per rollout actor
    timeout_s: float = 1800.0

    @property
    def world_size(self) -> int:
        return 1 + len(self.rollout_handles) * int(self.tp_size)


@dataclass
class CollectiveInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "stapo_collective"
    master_address: str = ""
    master_port: int = 0
    world_size: int = 1
    timeout_s: float = 1800.0


class CollectiveTrainer(TrainerWeightTransferEngine[CollectiveInitInfo]):
    """Rank 0 sends every tensor to ranks 1.. of a group it shares with every vLLM worker."""

    init_info_cls = CollectiveInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None

    @classmethod
    def trainer_init(cls, init_info: CollectiveInitInfo, *, client: Any, source: Any = None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine  # other ranks only join the source's gathers
        with ThreadPoolExecutor(max_workers=1) as exe:  # the workers block in the rendezvous meanwhile
            joined = exe.submit(client.init_weight_transfer_engine, engine.worker_init(init_info))
            engine.group = engine.open_endpoint(init_info)
            joined.result()
        return engine

    @classmethod
    def build(cls, link: TrainerLink) -> "CollectiveTrainer":
        info = CollectiveInitInfo(rank=link.rank, master_address=link.master_address, master_port=link.master_port,
                                  world_size=link.world_size, timeout_s=link.timeout_s)
        return cls.trainer_init(info, client=RolloutActorsClient(link.rollout_handles, link.tp_size),
                                source=weight_source(link.module_of, link.zero_stage))

    def update_info(self) -> dict:
        meta = self.source.metadata()
        return {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).removeprefix("torch.") for m in meta],
                "shapes": [list(m.shape) for m in meta]}

    def send_weights(self) -> None:
        if not self.is_sender:
            for _ in self.source:  # ZeRO-3: join each parameter's gather
                pass
            return
        info = self.update_info()
        self.client.start_weight_update()  # vLLM's round; nothing here when the driver queued it (see client.py)
        with ThreadPoolExecutor(max_workers=1) as exe:
            received = exe.submit(self.client.update_weights, info)
            self.broadcast_all(iter(self.source), info)
            received.result()
        self.client.finish_weight_update()

    # -- per backend -----------------------------------------------------------------------------
    def worker_init(self, info: CollectiveInitInfo) -> dict:
        raise NotImplementedError

    def open_endpoint(self, info: CollectiveInitInfo) -> Any:
        raise NotImplementedError

    def broadcast_all(self, pairs, info: dict) -> None:
        raise NotImplementedError


class GlooTrainer(CollectiveTrainer):
    bucket_bytes = buckets.DEFAULT_BUCKET_BYTES

    def worker_init(self, info: CollectiveInitInfo) -> dict:
        return {"master_address": info.master_address, "master_port": info.master_port,
                "world_size": info.world_size, "timeout_s": info.timeout_s, "bucket_bytes": self.bucket_bytes}

    def open_endpoint(self, info: CollectiveInitInfo) -> Any:
        return gloo_group.open_group(info.master_address, info.master_port, 0, info.world_size, info.timeout_s)

    def broadcast_all(self, pairs, info: dict) -> None:
        """Bucket by bucket; a bucket's tensors are copied into its buffer while each is gathered."""
        for idx in buckets.plan(info["dtype_names"], info["shapes"], self.bucket_bytes):
            gloo_group.broadcast(self.group, buckets.pack([next(pairs)[1] for _ in idx]))


class NCCLTrainer(CollectiveTrainer):
    """UNTESTED HERE. Workers run vLLM's `NCCLWeightTransferEngine` unpacked: one broadcast per
    tensor in metadata order, received into a buffer of its dtype and shape."""

    def worker_init(self, info: CollectiveInitInfo) -> dict:
        return {"master_address": info.master_address, "master_port": info.master_port,
                "world_size": info.world_size, "packed": False}

    def open_endpoint(self, info: CollectiveInitInfo) -> Any:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        return trainer_init({"master_address": info.master_address, "master_port": info.master_port,
                             "world_size": info.world_size}, rank=0)

    def broadcast_all(self, pairs, info: dict) -> None:
        import torch

        stream = torch.cuda.current_stream()
        for _name, tensor in pairs:
            self.group.broadcast(tensor.contiguous(), src=0, stream=stream)
        stream.synchronize()


class IPCTrainer:
    """UNTESTED HERE. vLLM's CUDA IPC engine; the client makes each actor's one update call itself
    (the IPC handles exist only once the learner shares its tensors), so its push is synchronous."""

    @staticmethod
    def build(link: TrainerLink):
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        client = RolloutActorsClient(link.rollout_handles, link.tp_size, queued_by_driver=False)
        return IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=link.rank), client=client, source=weight_source(link.module_of, link.zero_stage))


def build_trainer_engine(method: str, link: TrainerLink):
    """The registered transport's trainer engine, on one learner rank."""
    from stapoctl.sync.transports import transport

    module, _, cls = str(transport(method).trainer).partition(":")
    return getattr(importlib.import_module(module), cls).build(link)
