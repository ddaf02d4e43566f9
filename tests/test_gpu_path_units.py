"""Decisions of the GPU weight path that a CPU can check: every actor's Ray request against the bundle
it lands in (the placement matrix), the layouts refused in one line, the learner's process-group
timeout, restart keys, the dtype of a local model, the interface variables of a multi-node run,
and which transports Ray may restart an actor for. Their engine-side effects are in
tests/test_transport_contracts.py (vLLM's classes) and tests/test_weight_sync_faults.py (real
engines)."""

from __future__ import annotations

import itertools

import pytest
from omegaconf import OmegaConf

from stapoctl.errors import UserError

TRANSPORTS = ("object_store", "gloo", "nccl", "ipc")
LAYOUTS = ("disaggregated", "colocated")
CPUS = ((1.0, 1.0), (0.5, 2.0), (4.0, 1.0))  # (rollout.cpus_per_worker, learner.cpus)


def _cfgs(transport, layout, tp, workers, ranks, cpus):
    gpu = transport in ("nccl", "ipc") or layout == "colocated"
    r = OmegaConf.create({"num_workers": workers, "gpus_per_worker": tp if gpu else 0, "tensor_parallel_size": tp,
                          "cpus_per_worker": cpus[0], "resources": {}, "placement_strategy": "PACK",
                          "weight_sync": transport})
    lrn = OmegaConf.create({"num_ranks": ranks, "gpus_per_rank": 1 if gpu else 0, "cpus": cpus[1], "resources": {},
                            "placement_strategy": "PACK", "placement": layout})
    return r, lrn


MATRIX = list(itertools.product(TRANSPORTS, LAYOUTS, (1, 2, 4), (1, 4), (1, 4, 8), CPUS))


@pytest.mark.parametrize("transport,layout,tp,workers,ranks,cpus", MATRIX)
def test_every_actor_fits_the_bundle_it_lands_in(transport, layout, tp, workers, ranks, cpus):
    """For every layout that is accepted, the resources each actor asks (rollout actor, learner rank,
    and vLLM's own Ray TP workers when colocated) add up to no more than its bundle holds, summed
    here independently of `check_asks_fit`; every actor has exactly one bundle. A layout that cannot
    be placed is refused with one line. (Colocated TP > 1 used to ask cpus_per_worker in a bundle
    holding cpus_per_worker / TP: learner rank 0 never scheduled and the run hung.)"""
    from stapoctl.config.validate import _check_transport_layout
    from stapoctl.launch.placement import actor_asks, check_asks_fit, role_plans

    r, lrn = _cfgs(transport, layout, tp, workers, ranks, cpus)
    try:
        _check_transport_layout(transport, layout)
        plans, asks = role_plans(r, lrn), actor_asks(r, lrn)
    except UserError as exc:
        assert "\n" not in str(exc)
        refused_for = {("ipc", "disaggregated"), ("nccl", "colocated")}
        assert (transport, layout) in refused_for or (layout == "colocated" and workers * tp != ranks), str(exc)
        return
    assert not (layout == "colocated" and workers * tp != ranks)
    assert sorted((a.role, a.index) for a in asks if a.role != "vllm_tp_worker") == sorted(
        [("rollout", i) for i in range(workers)] + [("learner", k) for k in range(ranks)])
    bundles = {p.role: p for p in plans}
    used: dict = {}
    for a in asks:
        assert a.group in bundles and 0 <= a.bundle < bundles[a.group].count, a
        slot = used.setdefault((a.group, a.bundle), [0.0, 0.0])
        slot[0] += a.num_cpus
        slot[1] += a.num_gpus
    for (group, b), (cpu, gpu) in used.items():
        have = bundles[group].bundle
        assert cpu <= have["CPU"] + 1e-9 and gpu <= have.get("GPU", 0.0) + 1e-9, (group, b, cpu, gpu, have)
    if layout == "colocated":  # every shared GPU is used whole: a learner half and a vLLM half
        assert all(abs(gpu - 1.0) < 1e-9 for _, gpu in used.values())
    check_asks_fit(plans, asks)


def test_the_fit_check_names_an_overfull_bundle():
    """What colocated TP 2 asked before the fix: 1 CPU for the actor + 1 for the learner in a bundle of 1.5."""
    from stapoctl.launch.placement import ActorAsk, RolePlan, check_asks_fit

    plans = [RolePlan("colocated", 2, {"CPU": 1.5, "GPU": 1.0})]
    asks = [ActorAsk("learner", 0, "colocated", 0, 1.0, 0.5), ActorAsk("learner", 1, "colocated", 1, 1.0, 0.5),
            ActorAsk("rollout", 0, "colocated", 0, 1.0, 0.0)]
    with pytest.raises(UserError, match=r"colocated bundle 0 ask 2 CPU \(learner 0 1, rollout 0 1\) and the bundle "
                                        r"holds 1.5"):
        check_asks_fit(plans, asks)
    with pytest.raises(UserError, match="rollout 3 has no bundle"):
        check_asks_fit(plans, [ActorAsk("rollout", 3, "colocated", 2, 0.0, 0.0)])


def test_the_ray_options_each_actor_is_started_with_are_its_ask():
    """One function gives every actor's full options (resources and bundle): the rollout actor and the
    learner rank alike."""
    from stapoctl.launch.placement import Placement, actor_asks

    r, lrn = _cfgs("ipc", "colocated", 2, 2, 4, (1.0, 1.0))
    placement = Placement(groups={"colocated": "pg"}, colocated=True, rollout_stride=2, asks=actor_asks(r, lrn))
    opts = placement.rollout_options(1)
    assert (opts["num_cpus"], opts["num_gpus"]) == (0.5, 0.0)
    assert opts["scheduling_strategy"].placement_group_bundle_index == 2
    learner = placement.learner_options(3)
    assert (learner["num_cpus"], learner["num_gpus"], learner["scheduling_strategy"].placement_group_bundle_index) \
        == (1.0, 0.5, 3)
    assert placement.rollout_env(1) == {"VLLM_RAY_BUNDLE_INDICES": "2,3", "VLLM_RAY_PER_WORKER_GPUS": "0.5",
                                        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


@pytest.mark.parametrize("gpus_per_worker,gpus_per_rank,ranks", [(2, 1, 4), (1, 2, 2)])
def test_colocated_needs_one_shared_gpu_per_rank(gpus_per_worker, gpus_per_rank, ranks):
    from stapoctl.launch.placement import role_plans

    r, lrn = _cfgs("ipc", "colocated", 1, 2, ranks, (1.0, 1.0))
    r.gpus_per_worker, lrn.gpus_per_rank = gpus_per_worker, gpus_per_rank
    with pytest.raises(UserError, match="shares one GPU between a learner rank and a vLLM tensor-parallel rank"):
        role_plans(r, lrn)


@pytest.mark.parametrize("method,restarts", [("object_store", 3), ("gloo", 0), ("nccl", 0), ("ipc", 0)])
def test_ray_restarts_an_actor_only_where_the_transport_can_relink_it(method, restarts):
    from stapoctl.trainer.engines import rollout_max_restarts

    assert rollout_max_restarts(OmegaConf.create({"max_restarts": 3}), method) == restarts


def test_the_process_group_timeout_is_twice_the_sync_timeout_unless_set():
    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.engine_settings import learner_args

    conf = compose_config(["rollout.weight_sync_timeout_s=90"])
    assert learner_args(conf)["learner"]["process_group_timeout_s"] == 180.0
    conf = compose_config(["rollout.weight_sync_timeout_s=90", "learner.process_group_timeout_s=500"])
    assert learner_args(conf)["learner"]["process_group_timeout_s"] == 500.0
    assert learner_args(compose_config([]))["learner"]["process_group_timeout_s"] == 3600.0  # not DeepSpeed's 600
    with pytest.raises(UserError, match="learner.process_group_timeout_s=60 is below rollout.weight_sync_timeout_s=90"):
        compose_config(["rollout.weight_sync_timeout_s=90", "learner.process_group_timeout_s=60"])


def test_a_change_of_zero_stage_starts_new_engines():
    """The weight link captured the stage; a ZeRO-2 source under a ZeRO-3 learner would send shards."""
    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.session import RESTART_KEYS

    assert "learner.zero_stage" in RESTART_KEYS
    a, b = compose_config(["learner.zero_stage=2"]), compose_config(["learner.zero_stage=3"])
    from stapoctl.trainer.session import engine_key

    assert engine_key(a, "/m") != engine_key(b, "/m")


@pytest.mark.parametrize("overrides,dtype", [
    (["model=/data/qwen3"], "float32"),
    (["model=./qwen3", "rollout.gpus_per_worker=1", "learner.gpus_per_rank=1"], "bfloat16"),
    (["model=/data/qwen3", "rollout.gpus_per_worker=1", "learner.gpus_per_rank=1", "model.dtype=float32"], "float32"),
    (["model=Qwen/Qwen3-8B-Base"], "bfloat16")])
def test_a_local_model_trains_in_bf16_on_gpus(overrides, dtype):
    from stapoctl.config.compose import compose_config

    assert compose_config(overrides).model.dtype == dtype


def test_the_interface_of_a_multi_node_run_reaches_every_actor_and_job(monkeypatch, tmp_path):
    from stapoctl.launch.ray_runtime import actor_env, interface_env

    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert interface_env(OmegaConf.create({"socket_ifname": None})) == {}
    cluster = OmegaConf.create({"socket_ifname": "ib0"})
    assert interface_env(cluster) == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")  # a site's export is forwarded when the config says nothing
    assert interface_env(OmegaConf.create({"socket_ifname": None})) == {"NCCL_SOCKET_IFNAME": "eth1"}
    assert actor_env()["NCCL_SOCKET_IFNAME"] == "eth1"
    from stapoctl.config.compose import compose_config
    from stapoctl.jobs import slurm

    conf = compose_config(["cluster=slurm", "cluster.socket_ifname=ib0", "cluster.nodes=2"])
    setup = slurm.plan(conf, ["trainer.total_steps=1"], tmp_path, "sqlite:////x.db", "job").parameters["setup"]
    assert "export NCCL_SOCKET_IFNAME=ib0" in setup and "export GLOO_SOCKET_IFNAME=ib0" in setup


def test_the_doctor_meets_on_the_named_interface():
    from stapoctl.doctor.comm import rendezvous_address

    assert rendezvous_address(OmegaConf.create({"cluster": {"socket_ifname": None}}))[0] == "127.0.0.1"
    assert rendezvous_address(OmegaConf.create({"cluster": {"socket_ifname": "lo"}})) == (
        "127.0.0.1", {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"})
    with pytest.raises(UserError, match="cluster.socket_ifname=nosuch0: no interface of that name"):
        rendezvous_address(OmegaConf.create({"cluster": {"socket_ifname": "nosuch0"}}))


def test_the_plan_counts_the_ipc_push_buffer():
    """Colocated (CUDA IPC) Qwen3-8B: the packed buffer holds the 1.24 GB embedding, more than vLLM's
    default 1 GiB; the learner's figure is at least the push's peak."""
    from stapoctl.config.compose import compose_config
    from stapoctl.preflight.memory_plan import build_plan

    conf = compose_config(["experiment=stapo_qwen3_8b", "learner.placement=colocated", "learner.num_ranks=8",
                           "rollout.num_workers=8", "rollout.gpus_per_worker=1", "learner.gpus_per_rank=1",
                           "learner.zero_stage=3", "learner.max_tokens_per_micro_batch=0"])
    learner = build_plan(conf).role("learner")
    assert learner.parts["weight_push_buffer"] == pytest.approx(151936 * 4096 * 2 / 2**30)
    push = sum(learner.parts[k] for k in ("model_states", "deepspeed_buffers", "runtime", "weight_push_gather",
                                           "weight_push_buffer"))
    assert learner.per_device_gib >= push
    disaggregated = compose_config(["experiment=stapo_qwen3_8b"])
    assert "weight_push_buffer" not in build_plan(disaggregated).role("learner").parts


def test_a_push_that_does_not_match_what_the_workers_expect_raises_instead_of_hanging():
    """A tensor of another shape (a ZeRO-3 shard under full-shape metadata) or a missing one."""
    import torch

    from stapoctl.sync.trainer_engines import checked

    info = {"names": ["a", "b"], "dtype_names": ["float32", "float32"], "shapes": [[2, 3], [4]]}
    good = [("a", torch.zeros(2, 3)), ("b", torch.zeros(4))]
    assert [n for n, _ in checked(iter(good), info)] == ["a", "b"]
    with pytest.raises(ValueError, match=r"tensor 1 is \('b', 'float32', \[0\]\), the workers expect \('b', 'float32', \[4\]\)"):
        list(checked(iter([good[0], ("b", torch.zeros(0))]), info))
    with pytest.raises(ValueError, match="the source gave 1 tensors, the workers expect 2"):
        list(checked(iter(good[:1]), info))


def test_a_worker_that_fails_to_join_the_link_is_raised_at_once():
    """Rank 0's end of the rendezvous would wait (NCCL's init has no timeout): the workers' error wins."""
    import threading
    import time

    from stapoctl.sync.trainer_engines import CollectiveInitInfo, GlooTrainer

    class FailingClient:
        def init_weight_transfer_engine(self, info):
            raise RuntimeError("worker 1 could not join: address in use")

    blocked = threading.Event()

    class Stuck(GlooTrainer):
        def open_endpoint(self, info):
            blocked.wait(30)  # the endpoint waiting for a worker that never comes

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 1 could not join"):
        Stuck.trainer_init(CollectiveInitInfo(rank=0, master_address="127.0.0.1", master_port=1, world_size=2,
                                              timeout_s=20.0), client=FailingClient())
    assert time.monotonic() - t0 < 5
    blocked.set()


def test_the_interface_name_is_one_interface():
    from stapoctl.config.compose import compose_config
    from stapoctl.doctor.comm import rendezvous_address

    with pytest.raises(UserError, match=r"cluster.socket_ifname=\^lo,docker0: name one network interface"):
        compose_config(["cluster.socket_ifname='^lo,docker0'"])
    # a site's NCCL pattern in the environment is forwarded as it is, but names no address to meet on
    import os

    old = os.environ.get("NCCL_SOCKET_IFNAME")
    os.environ["NCCL_SOCKET_IFNAME"] = "^lo,docker0"
    try:
        assert rendezvous_address(OmegaConf.create({"cluster": {"socket_ifname": None}}))[0] == "127.0.0.1"
    finally:
        os.environ.pop("NCCL_SOCKET_IFNAME") if old is None else os.environ.__setitem__("NCCL_SOCKET_IFNAME", old)


def test_colocated_tp2_rollout_actor_keeps_cuda_whatever_the_site_sets(monkeypatch):
    """#49 R9: the colocated TP-2 rollout actor asks num_gpus=0. Ray 2.60 blanks CUDA_VISIBLE_DEVICES of
    such an actor when RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO is true, read in the worker process at the
    actor's creation (ray/_private/utils.py set_visible_accelerator_ids); vLLM then builds its CPU
    engine. The actor's runtime_env sets it false, and that value wins over the site's."""
    import os

    import ray
    from ray._private import utils as ray_utils

    from stapoctl.launch.placement import Placement

    env = Placement(colocated=True, rollout_stride=2).rollout_env(1)
    assert env["VLLM_RAY_BUNDLE_INDICES"] == "2,3" and env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "0"
    assert Placement(colocated=True, rollout_stride=1).rollout_env(0) == {}  # TP 1 holds half a GPU itself
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Ctx", (), {
        "get_accelerator_ids": lambda self: {"GPU": []}})())  # what a num_gpus=0 actor is given
    monkeypatch.delenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "1")  # the site's raylet environment
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    ray_utils.set_visible_accelerator_ids()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # without the actor's value: no GPU in the actor
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    for key in env:  # restored after the test
        monkeypatch.setenv(key, "")
    ray_utils.update_envs(env)  # as Ray applies an actor's runtime_env env_vars to its worker
    ray_utils.set_visible_accelerator_ids()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
