"""Decisions of the weight path that only a GPU cluster would exercise, checked here without one:
the transport registry against the config's choices, the rank offsets, the gloo byte buckets, the
vLLM keyword arguments and actor environments for TP > 1 (CPU, GPU disaggregated, GPU colocated),
the colocated bundle layout, the GPU defaults, and the ZeRO-3 push's bound in the memory plan."""

from __future__ import annotations

import pytest
import torch

from stapoctl.errors import UserError


def test_the_config_offers_exactly_the_registered_transports():
    from stapoctl.config.engines import GPU_TRANSPORTS, WEIGHT_TRANSPORTS
    from stapoctl.sync.transfer import PUSHES
    from stapoctl.sync.transports import TRANSPORTS

    assert WEIGHT_TRANSPORTS == ("auto", *TRANSPORTS)
    assert set(GPU_TRANSPORTS) == {n for n, t in TRANSPORTS.items() if t.needs_gpu}
    assert all(t.push in PUSHES for t in TRANSPORTS.values())
    assert TRANSPORTS["gloo"].vllm_backend == "stapo_gloo" and not TRANSPORTS["gloo"].needs_gpu


def test_choose_method():
    from stapoctl.sync.transports import choose_method

    assert choose_method("gloo", on_gpu=False, placement="disaggregated") == "gloo"
    assert choose_method("auto", on_gpu=False, placement="disaggregated") == "object_store"
    with pytest.raises(UserError, match="rollout.weight_sync='ipc' needs GPUs; on CPU use auto or object_store or gloo"):
        choose_method("ipc", on_gpu=False, placement="colocated")


def test_each_actor_gets_its_own_rank_offset():
    from stapoctl.sync.client import RolloutActorsClient

    # 3 engines × TP 2: worker processes 1-2, 3-4, 5-6 (rank 0 is the learner's)
    assert RolloutActorsClient([object()] * 3, 2).rank_offsets() == [1, 3, 5]


def test_gloo_buckets_round_trip_every_dtype():
    from stapoctl.sync import buckets

    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.arange(4, dtype=torch.int64),
               torch.randn(2, 2, 2)]
    dts = [str(t.dtype).removeprefix("torch.") for t in tensors]
    shapes = [list(t.shape) for t in tensors]
    # 60 + 14 + 32 + 32 bytes; buckets of 80: [0, 1], [2, 3]; a tensor larger than a bucket alone
    assert buckets.plan(dts, shapes, 80) == [[0, 1], [2, 3]]
    assert buckets.plan(dts, shapes, 10) == [[0], [1], [2], [3]]
    for idx in buckets.plan(dts, shapes, 80):
        buf = buckets.pack([tensors[i] for i in idx])
        assert buf.dtype == torch.uint8 and buf.numel() == sum(buckets.nbytes(dts[i], shapes[i]) for i in idx)
        for i, back in zip(idx, buckets.unpack(buf, [dts[i] for i in idx], [shapes[i] for i in idx])):
            assert back.dtype == tensors[i].dtype and torch.equal(back, tensors[i])


def _spec(**kw):
    from stapoctl.rollout.vllm_engine import EngineSpec

    return EngineSpec(model_path="m", **kw)


@pytest.mark.parametrize("on_gpu,tp,colocated,executor", [
    (False, 1, False, "uni"), (False, 2, False, "mp"),  # vLLM-CPU: TP 2 in worker processes
    (True, 1, False, "uni"), (True, 2, False, "mp"),  # the actor holds its TP GPUs on one node
    (True, 2, True, "ray"),  # colocated: one-GPU bundles, vLLM's Ray executor places each TP worker
])
def test_the_executor_for_each_layout(on_gpu, tp, colocated, executor):
    from stapoctl.rollout.vllm_engine import engine_kwargs

    kw = engine_kwargs(_spec(tensor_parallel_size=tp, colocated=colocated, weight_transfer_backend="nccl"), on_gpu)
    assert kw["distributed_executor_backend"] == executor
    assert kw["weight_transfer_config"] == {"backend": "nccl"}


def test_gpu_engine_memory_settings():
    from stapoctl.rollout.vllm_engine import engine_kwargs

    own = engine_kwargs(_spec(gpu_memory_utilization=0.9, enforce_eager=False), True)
    assert own["gpu_memory_utilization"] == 0.9 and own["enforce_eager"] is False
    assert "kv_cache_memory_bytes" not in own
    shared = engine_kwargs(_spec(colocated=True, kv_cache_bytes=3 * 2**30, gpu_memory_utilization=0.5), True)
    # the KV cache is the plan's bytes; the share still goes in: vLLM checks at start that that much of the
    # GPU is free (vllm/v1/worker/utils.py request_memory), and its default 0.9 is not what a shared GPU has
    assert shared["kv_cache_memory_bytes"] == 3 * 2**30 and shared["gpu_memory_utilization"] == 0.5
    cpu = engine_kwargs(_spec(kv_cache_gb=0.5, weight_transfer_backend="stapo_gloo"), False)
    assert cpu["kv_cache_memory_bytes"] == 2**29 and cpu["weight_transfer_config"] == {"backend": "stapo_gloo"}
    assert "weight_transfer_config" not in engine_kwargs(_spec(), False)  # the object store links nothing


def test_gpu_defaults_auto():
    from omegaconf import OmegaConf

    from stapoctl.config.engines import rollout_eager, rollout_utilization

    auto = OmegaConf.create({"gpu_memory_utilization": None, "enforce_eager": None})
    assert rollout_utilization(auto, colocated=False) == 0.9 and rollout_utilization(auto, colocated=True) == 0.5
    assert rollout_eager(auto, on_gpu=True) is False and rollout_eager(auto, on_gpu=False) is True
    old = OmegaConf.create({})  # a config saved before the auto values: read with .get
    assert rollout_utilization(old, colocated=False) == 0.9
    given = OmegaConf.create({"gpu_memory_utilization": 0.6, "enforce_eager": True})
    assert rollout_utilization(given, colocated=False) == 0.6 and rollout_eager(given, on_gpu=True) is True


def test_actor_environments(monkeypatch):
    from stapoctl.rollout.vllm_worker import cpu_thread_binding, rollout_env

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, list(range(16))) == "0-7|8-15"
    assert cpu_thread_binding(2, [0, 2, 4, 6]) == "0,2|4,6"
    with pytest.raises(UserError, match="rollout.tensor_parallel_size=4 needs a CPU core per tensor-parallel rank"):
        cpu_thread_binding(4, [0, 1])
    cpu_tp2 = rollout_env(_spec(tensor_parallel_size=2), on_gpu=False, cores=[0, 1])
    assert cpu_tp2["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and cpu_tp2["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in rollout_env(_spec(), on_gpu=False)
    ipc = rollout_env(_spec(weight_transfer_backend="ipc"), on_gpu=True)
    assert ipc["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"  # IPC handles cross vLLM's msgpack hop
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in rollout_env(_spec(weight_transfer_backend="nccl"), on_gpu=True)


def test_tp2_bundle_layouts():
    from omegaconf import OmegaConf

    from stapoctl.launch.placement import Placement, role_plans

    r = OmegaConf.create({"num_workers": 2, "gpus_per_worker": 1, "tensor_parallel_size": 2, "cpus_per_worker": 1,
                          "resources": {}, "placement_strategy": "PACK"})
    lrn = OmegaConf.create({"num_ranks": 4, "gpus_per_rank": 1, "cpus": 1, "resources": {},
                            "placement_strategy": "PACK", "placement": "disaggregated"})
    rollout, learner = role_plans(r, lrn)
    assert (rollout.count, rollout.bundle["GPU"]) == (2, 2.0)  # each actor's TP GPUs in one bundle (mp executor)
    assert (learner.count, learner.bundle["GPU"]) == (4, 1.0)
    [colocated] = role_plans(r, OmegaConf.merge(lrn, {"placement": "colocated"}))
    assert (colocated.count, colocated.bundle["GPU"]) == (4, 1.0)  # 2 actors × TP 2 = 4 shared GPUs
    layout = Placement(colocated=True, rollout_stride=2)
    assert layout.rollout_env(1) == {"VLLM_RAY_BUNDLE_INDICES": "2,3", "VLLM_RAY_PER_WORKER_GPUS": "0.5",
                                     "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    assert Placement(colocated=True, rollout_stride=1).rollout_env(0) == {}
    assert Placement(colocated=False, rollout_stride=2).rollout_env(0) == {}


def test_the_plan_bounds_a_zero3_push_by_one_parameter():
    from stapoctl.config.shapes import QWEN3_SHAPES
    from stapoctl.preflight.memory import GIB, learner_memory

    shape = QWEN3_SHAPES["Qwen/Qwen3-14B-Base"]
    args = dict(num_ranks=8, dtype="bfloat16", micro_tokens=16384, gradient_checkpointing=True, logits_chunk=1024)
    z3 = learner_memory(shape, zero_stage=3, **args)
    embed = shape["vocab_size"] * shape["hidden_size"] * 2  # the largest parameter, bf16
    assert z3["weight_push_gather"] == pytest.approx(embed / GIB)
    assert z3["weight_push_gather"] < 2.0  # one parameter (~1.5 GiB), not the model's ~28 GiB
    assert z3["total"] == pytest.approx(sum(v for k, v in z3.items() if k not in
                                            ("total", "activations_if_checkpointing_flipped", "weight_push_gather")))
    assert learner_memory(shape, zero_stage=2, **args)["weight_push_gather"] == 0.0  # weights already whole


def test_the_ipc_push_is_driven_by_the_learner_and_waited_for(monkeypatch):
    """CUDA IPC: no update info fixed at link time (the learner builds each one with its handles) and
    no call queued on the actors by the driver; the push is synchronous."""
    import ray

    from stapoctl.sync.transfer import PUSHES
    from stapoctl.sync.transports import transport

    calls = []

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args, **kwargs):
            calls.append(self.name)
            return self.name

    class Learner:
        init_weight_transfer, transfer_update_info, send_weights = Method("init"), Method("info"), Method("send")

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    push = PUSHES[transport("ipc").push]([Learner()], [object()], "ipc", {"tp_size": 1, "timeout_s": 1.0})
    assert push.synchronous and push.update_info is None and calls == ["init"]
    assert push.start([]) == ["send"]


def test_the_gloo_link_listens_on_a_port_it_holds_before_the_workers_join():
    """Rank 0's store binds first, on a port the OS picks, and the workers are told that one: the
    port the learner found free earlier may be taken by then (EADDRINUSE in a rehearsal with two
    test sessions on one machine). Here it is taken on purpose."""
    import socket

    import torch

    from stapoctl.sync import gloo_group
    from stapoctl.sync.trainer_engines import CollectiveInitInfo, GlooTrainer

    class Worker:  # vLLM's worker side of `init_weight_transfer_engine`, as rank 1
        def init_weight_transfer_engine(self, info: dict) -> None:
            self.port = info["master_port"]
            self.group = gloo_group.open_group(info["master_address"], info["master_port"], 1, info["world_size"],
                                               info["timeout_s"])

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    worker = Worker()
    try:
        info = CollectiveInitInfo(rank=0, master_address="127.0.0.1", master_port=taken.getsockname()[1],
                                  world_size=2, timeout_s=20)
        engine = GlooTrainer.trainer_init(info, client=worker)
    finally:
        taken.close()
    assert worker.port != info.master_port
    sent, got = torch.arange(4.0), torch.zeros(4)
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    handles = [engine.group.broadcast([sent], opts), worker.group.broadcast([got], opts)]
    for h in handles:
        h.wait()
    assert torch.equal(got, sent)
