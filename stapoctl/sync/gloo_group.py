"""A gloo process group of the learner's rank 0 and every vLLM worker process, outside every
default process group (the learner ranks' own DeepSpeed group, vLLM's tensor-parallel one).

`torch.distributed.broadcast(group=pg)` refuses such a group ("not initialized in the world"), so
the group's own `broadcast` is called. The rendezvous is a TCPStore on rank 0; its timeout bounds
how long a missing or duplicate rank can hang a run (tests use 60 s)."""

from __future__ import annotations

import datetime


def listen(host: str, world_size: int, timeout_s: float):
    """Rank 0's store, listening now on a port the OS picks (its `.port`, for the other ranks):
    a port found free first and bound later may be taken meanwhile (EADDRINUSE, seen when two
    test sessions shared a machine). It waits for no one: `open_group(..., store=)` does."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, int(world_size), True, timeout=datetime.timedelta(seconds=float(timeout_s)),
                         wait_for_workers=False)


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, store=None):
    """The group, once every rank has joined; rank 0 passes its `listen` store (`port` unused)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(timeout_s))
    if store is None:
        store = dist.TCPStore(host, int(port), int(world_size), rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("stapoctl-weights", store), int(rank), int(world_size), timeout)


def broadcast(group, tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def worker_rank(parallel_config, rank_offset: int) -> int:
    """This vLLM worker's rank in the weight group: its engine's offset (1 + actor index × TP ranks,
    given by the driver) plus its rank inside the engine (data-parallel index × TP + TP rank, as
    vLLM's own NCCL engine counts)."""
    within = int(parallel_config.data_parallel_index) * int(parallel_config.world_size) + int(parallel_config.rank)
    return int(rank_offset) + within
