"""Every port is bound by its owner before it is announced (issue #49 R4), as the gloo weight link's
store already was (tests/test_weight_transport_units.py): the learners' torch.distributed rendezvous
(DeepSpeed's process group) and the NCCL weight link. A port found free and bound later may be taken
in between (vLLM's actors pick theirs on the same node; another test session): here the port
`free_port` would give is taken on purpose, and both still come up, on a port their store holds.
NCCL itself needs a GPU: its communicator is replaced by a stand-in that uses the group as vLLM's
`PyNcclCommunicator` does (rank 0 broadcasts the unique id over the store)."""

from __future__ import annotations

import errno
import multiprocessing as mp
import socket

import pytest


def _taken() -> socket.socket:
    """A port held by someone else (listening, as a process that took it would be)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _bind_errno(host: str, port: int) -> int:
    """0 when `port` could be bound at `host` now, else the error (EADDRINUSE: someone holds it)."""
    with socket.socket() as s:
        try:
            s.bind((host, int(port)))
        except OSError as exc:
            return int(exc.errno)
    return 0


def _learner_rank(rank: int, held: int, home: str, addresses, results) -> None:
    """One learner rank in its own process, as `LearnerGroup.start` drives it: rank 0 answers
    `rendezvous()`, every rank joins the process group (DeepSpeed's `init_distributed` included) with
    rank 0's address, then an all-reduce through DeepSpeed's comm."""
    import os

    os.environ["STAPOCTL_HOME"] = home
    try:
        import torch

        from stapoctl.learner import engine_setup, rendezvous
        from stapoctl.learner.deepspeed_learner import Learner

        engine_setup.free_port = rendezvous.free_port = lambda host="127.0.0.1": held  # found "free", taken
        engine_setup.node_ip = lambda: "127.0.0.1"
        learner = Learner(rank=rank, world_size=2)
        if rank == 0:
            addr, port = learner.rendezvous(60.0)
            addresses.put((addr, port, None))
        else:
            addr, port, _ = addresses.get(timeout=120)
        learner._join_process_group({"gpus_per_rank": 0, "process_group_timeout_s": 60.0}, addr, port)
        import deepspeed.comm as ds_comm

        t = torch.full((4,), float(rank + 1))
        ds_comm.all_reduce(t)
        results.put((rank, float(t.sum()), ds_comm.get_world_size(), learner.pg_timeout_s(), None))
        learner.shutdown()
    except BaseException as exc:  # reported to the parent, which fails the test
        results.put((rank, None, None, None, repr(exc)))
        if rank == 0:  # the parent may still wait for the answer
            addresses.put((None, None, repr(exc)))


def test_the_learner_rendezvous_holds_its_port_from_the_answer_on(tmp_path):
    """Rank 0's answer names a port its store already listens on (not the taken one `free_port`
    finds), rank 1 joins it, and DeepSpeed wraps the process group: the all-reduce sums 1 + 2."""
    taken = _taken()
    held = taken.getsockname()[1]
    ctx = mp.get_context("spawn")
    to_rank1, to_test, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_learner_rank, args=(0, held, str(tmp_path), to_test, results))]
    try:
        procs[0].start()
        addr, port, error = to_test.get(timeout=180)  # rank 0's answer, before rank 1 exists
        assert error is None and port != held, (port, held, error)
        assert _bind_errno(addr, port) == errno.EADDRINUSE  # its store holds the port it announced
        to_rank1.put((addr, port, None))
        procs.append(ctx.Process(target=_learner_rank, args=(1, held, str(tmp_path), to_rank1, results)))
        procs[1].start()
        got = sorted(results.get(timeout=180) for _ in procs)
    finally:
        taken.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [g[4] for g in got] == [None, None], got
    assert [g[:4] for g in got] == [(0, 12.0, 2, 60.0), (1, 12.0, 2, 60.0)]


def test_the_store_each_rank_starts_from():
    """Rank 0 keeps its listening store; without one (a learner started outside Ray) it binds one
    now, on any port when none is given; other ranks connect, and need rank 0's port."""
    from stapoctl.learner import rendezvous

    held = rendezvous.listen("127.0.0.1", 2, 5.0)
    assert rendezvous.store_for(0, 2, "127.0.0.1", 1, 5.0, held=held) is held
    fresh = rendezvous.store_for(0, 2, "127.0.0.1", None, 5.0)
    assert fresh.port > 0 and _bind_errno("127.0.0.1", fresh.port) == errno.EADDRINUSE
    client = rendezvous.store_for(1, 2, "127.0.0.1", fresh.port, 5.0)
    client.set("k", b"v")
    assert fresh.get("k") == b"v"
    with pytest.raises(ValueError, match="learner rank 1 needs rank 0's port"):
        rendezvous.store_for(1, 2, "127.0.0.1", None, 5.0)


def test_the_nccl_link_store_listens_before_its_port_is_announced(monkeypatch):
    """The learner's NCCL end binds its store before the workers are told the port (vLLM's
    `trainer_init` bound it only inside `StatelessProcessGroup.create`, after): the port the workers
    get is held, is not the taken one, and vLLM's own worker-side `create` joins it."""
    from vllm.distributed.utils import StatelessProcessGroup

    from stapoctl.learner import engine_setup
    from stapoctl.learner.state_io import StateIO
    from stapoctl.sync import trainer_engines

    class Communicator:  # PyNcclCommunicator's use of the group without NCCL: rank 0 sends the unique id
        def __init__(self, group):
            self.group = group
            group.broadcast_obj(b"nccl-unique-id", src=0)

    class Worker:  # vLLM's NCCL worker engine, as rank 1 (`worker_init_process_group`)
        def __init__(self, handles, tp_size, **kw):
            self.told = None

        def init_weight_transfer_engine(self, info: dict) -> None:
            self.told = dict(info, bind_errno=_bind_errno(info["master_address"], info["master_port"]))
            group = StatelessProcessGroup.create(info["master_address"], info["master_port"], 1, info["world_size"],
                                                 store_timeout=20)
            self.unique_id = group.broadcast_obj(None, src=0)

    taken = _taken()
    held = taken.getsockname()[1]
    monkeypatch.setattr(trainer_engines, "nccl_communicator", Communicator)
    monkeypatch.setattr(trainer_engines, "RolloutActorsClient", Worker)
    monkeypatch.setattr(engine_setup, "free_port", lambda host="127.0.0.1": held)
    monkeypatch.setattr(engine_setup, "node_ip", lambda: "127.0.0.1")
    learner = type("Rank0", (StateIO,), {"rank": 0, "zero_stage": 0, "module": None})()
    try:
        learner.init_weight_transfer("nccl", [object()], tp_size=1, timeout_s=20.0)
    finally:
        taken.close()
    engine = learner.transfer
    told = engine.client.told
    assert told["master_port"] != held and told["bind_errno"] == errno.EADDRINUSE
    assert told["master_port"] == engine._store.port and told["world_size"] == 2
    assert engine.client.unique_id == b"nccl-unique-id"
    assert engine.group.group.store is engine._store  # rank 0's group is on the store it bound first
