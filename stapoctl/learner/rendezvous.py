"""torch.distributed's rendezvous of the learner ranks, on a store rank 0 holds before it announces
the port (issue #49 R4). A port found free and bound later, after the seconds of imports in
`setup`, may be taken meanwhile (vLLM's actors pick their own ports on the same node): EADDRINUSE
ends the start. Every rank initialises its default group from a store (`store=`), so all use the
same keys; DeepSpeed then wraps the initialised group (`deepspeed.init_distributed` skips its own
init when torch.distributed is initialised)."""

from __future__ import annotations

import datetime
import socket
from typing import Any, Optional


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (tests and benchmarks starting a learner outside Ray; the run's
    rendezvous listens first instead, `listen`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(timeout_s))


def listen(host: str, world_size: int, timeout_s: float, port: int = 0):
    """Rank 0's store, listening now (on a port the OS picks unless `port` is given: its `.port`
    is what the other ranks are told). It waits for no one: the process group's creation does."""
    import torch.distributed as dist

    return dist.TCPStore(host, int(port), int(world_size), True, timeout=_timeout(timeout_s), wait_for_workers=False)


def connect(host: str, port: int, world_size: int, timeout_s: float):
    """A client of rank 0's store (retries until it listens, at most `timeout_s`)."""
    import torch.distributed as dist

    return dist.TCPStore(host, int(port), int(world_size), False, timeout=_timeout(timeout_s))


def store_for(rank: int, world_size: int, host: str, port: Optional[int], timeout_s: float, held: Any = None):
    """The store this rank initialises from: rank 0's `held` one (listening since `rendezvous`), else
    rank 0 binds `port` now (any when None: a single rank started outside Ray); ranks > 0 connect."""
    if rank == 0:
        store = held if held is not None else listen(host, world_size, timeout_s, port=int(port or 0))
        store.set_timeout(_timeout(timeout_s))  # as env:// does: the group's timeout
        return store
    if not port:
        raise ValueError(f"learner rank {rank} needs rank 0's port (master_port): ask rank 0's rendezvous() first")
    return connect(host, int(port), world_size, timeout_s)


def init_default_group(backend: str, store: Any, rank: int, world_size: int, timeout_s: float,
                       device_id: Any = None) -> None:
    """torch.distributed's default group on `store` (what DeepSpeed's `init_distributed` would call,
    with its `device_id` on CUDA)."""
    import torch.distributed as dist

    if dist.is_initialized():  # a second learner in one process (tests, benchmarks): as DeepSpeed's own init
        return
    kwargs = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(backend, store=store, rank=int(rank), world_size=int(world_size),
                            timeout=_timeout(timeout_s), **kwargs)
