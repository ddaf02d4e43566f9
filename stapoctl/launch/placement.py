"""Where a run's actors go: one Ray placement group per role, reserved before any actor starts.

Each role (the vLLM rollout workers, the learner ranks) asks for one bundle per actor with its
CPUs, GPUs and custom resources, placed with the role's strategy (PACK / SPREAD / STRICT_PACK /
STRICT_SPREAD, as verl and OpenRLHF configure them). Custom resources pin a role to nodes that
advertise them (`ray start --resources='{"rollout_node": 1}'`). On GPU, `learner.placement=
colocated` puts learner rank i and a rollout worker on one shared GPU bundle instead.

A run that cannot fit fails in seconds with one line naming what it needs, what the cluster
has and the fix; one that fits but waits for busy resources says so while it waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from stapoctl.errors import UserError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class RolePlan:
    role: str  # "rollout" | "learner" | "colocated"
    count: int
    bundle: dict[str, float]  # resources of one bundle
    strategy: str = "PACK"


def _bundle(cpus: float, gpus: float, resources: Optional[dict]) -> dict[str, float]:
    out = {"CPU": float(cpus)}
    if gpus > 0:
        out["GPU"] = float(gpus)
    for k, v in dict(resources or {}).items():
        out[str(k)] = float(v)
    return out


def rollout_gpus(rollout_cfg: Any) -> float:
    """GPUs one rollout worker holds: its own share, at least one per tensor-parallel rank."""
    gpus = float(rollout_cfg.gpus_per_worker or 0)
    return max(gpus, float(max(1, int(rollout_cfg.tensor_parallel_size)))) if gpus > 0 else 0.0


def role_plans(rollout_cfg: Any, learner_cfg: Any) -> list[RolePlan]:
    """The bundles each role asks for, as the run will request them."""
    ranks = max(1, int(learner_cfg.get("num_ranks") or 1))
    workers = int(rollout_cfg.num_workers)
    r_gpu, l_gpu = rollout_gpus(rollout_cfg), float(learner_cfg.get("gpus_per_rank") or 0)
    if learner_cfg.placement == "colocated" and l_gpu > 0:
        if workers * r_gpu != ranks:
            raise UserError(
                f"learner.placement=colocated needs rollout GPUs (rollout.num_workers {workers} × {r_gpu:g}) "
                f"== learner.num_ranks ({ranks}): change one of them, or use learner.placement=disaggregated"
            )
        tp = max(1, int(rollout_cfg.tensor_parallel_size))
        if r_gpu != tp or l_gpu != 1:
            raise UserError(
                f"learner.placement=colocated shares one GPU between a learner rank and a vLLM tensor-parallel rank: "
                f"set rollout.gpus_per_worker={tp} (= rollout.tensor_parallel_size; now {r_gpu:g}) and "
                f"learner.gpus_per_rank=1 (now {l_gpu:g}), or use learner.placement=disaggregated"
            )
        cpus = float(rollout_cfg.cpus_per_worker) / tp + float(learner_cfg.cpus)
        return [RolePlan("colocated", ranks, _bundle(cpus, 1.0, learner_cfg.get("resources")),
                         str(learner_cfg.get("placement_strategy") or "PACK"))]
    return [
        RolePlan("rollout", workers, _bundle(float(rollout_cfg.cpus_per_worker), r_gpu, rollout_cfg.get("resources")),
                 str(rollout_cfg.get("placement_strategy") or "PACK")),
        RolePlan("learner", ranks, _bundle(float(learner_cfg.cpus), l_gpu, learner_cfg.get("resources")),
                 str(learner_cfg.get("placement_strategy") or "PACK")),
    ]


def total_need(plans: list[RolePlan]) -> dict[str, float]:
    need: dict[str, float] = {}
    for p in plans:
        for k, v in p.bundle.items():
            need[k] = need.get(k, 0.0) + v * p.count
    return need


def _describe(plans: list[RolePlan], resource: str) -> str:
    names = {"rollout": "rollout workers", "learner": "learner ranks", "colocated": "colocated GPU bundles"}
    return " + ".join(f"{p.count} {names[p.role]} × {p.bundle.get(resource, 0):g}" for p in plans
                      if p.bundle.get(resource, 0) > 0)


FIXES = {
    "CPU": ("set cluster.num_cpus to at least {need:g} (Ray then oversubscribes the cores), use fractional "
            "CPUs (rollout.cpus_per_worker=0.5 learner.cpus=0.5), or fewer rollout.num_workers / learner.num_ranks"),
    "GPU": "lower rollout.num_workers / rollout.gpus_per_worker / learner.num_ranks, or add GPU nodes",
}


def check_fits(plans: list[RolePlan], have: dict[str, float], where: str = "the Ray cluster") -> None:
    """One line per the first resource the run needs more of than `have` holds in all."""
    for resource, need in sorted(total_need(plans).items(), key=lambda kv: kv[0] not in ("CPU", "GPU")):
        available = float(have.get(resource, 0.0))
        if need > available + 1e-9:
            fix = FIXES.get(resource, "start a node with --resources='{{\"{res}\": N}}' or drop it from "
                                       "rollout.resources / learner.resources").format(need=need, res=resource)
            raise UserError(
                f"the run needs {need:g} {resource} ({_describe(plans, resource)}) and {where} has "
                f"{available:g}: {fix}"
            )


@dataclass(frozen=True)
class ActorAsk:
    """What one actor asks Ray for, and the bundle of which role's group it lands in. vLLM's own Ray
    workers (colocated TP > 1: `vllm_tp_worker`, num_cpus=0 and VLLM_RAY_PER_WORKER_GPUS each, as
    vllm/v1/executor/ray_executor_v2.py asks) are counted too: they share the bundles."""

    role: str  # "rollout" | "learner" | "vllm_tp_worker"
    index: int
    group: str  # the RolePlan role of its placement group
    bundle: int
    num_cpus: float
    num_gpus: float


COLOCATED_GPU_SHARE = 0.5  # learner rank and vLLM worker each take half of their shared GPU bundle
# Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone in an actor given no GPU unless this variable is true; Ray reads it
# in the worker process as it creates the actor (ray/_private/utils.py set_visible_accelerator_ids), so an actor's
# runtime_env value wins over the one the site's raylet passes down (ray/_private/accelerators/accelerator.py)
ZERO_GPU_ENV = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


def actor_asks(rollout_cfg: Any, learner_cfg: Any) -> list[ActorAsk]:
    """Every actor of the run with its resources and bundle, as `Placement` will start them."""
    plans = role_plans(rollout_cfg, learner_cfg)
    workers, ranks = int(rollout_cfg.num_workers), plans[-1].count
    cpus_r, cpus_l = float(rollout_cfg.cpus_per_worker), float(learner_cfg.cpus)
    if plans[0].role == "colocated":
        stride, half = max(1, int(rollout_gpus(rollout_cfg))), COLOCATED_GPU_SHARE
        asks = [ActorAsk("learner", k, "colocated", k, cpus_l, half) for k in range(ranks)]
        for i in range(workers):
            if stride == 1:  # the actor holds vLLM's one worker and half the GPU itself
                asks.append(ActorAsk("rollout", i, "colocated", i, cpus_r, half))
                continue
            # TP > 1: the actor only drives vLLM's Ray workers, one in each of its TP bundles; its CPUs
            # are the bundle's rollout share (each bundle holds cpus_per_worker / TP of them)
            asks.append(ActorAsk("rollout", i, "colocated", i * stride, cpus_r / stride, 0.0))
            asks += [ActorAsk("vllm_tp_worker", i * stride + k, "colocated", i * stride + k, 0.0, half)
                     for k in range(stride)]
        return asks
    return ([ActorAsk("rollout", i, "rollout", i, cpus_r, plans[0].bundle.get("GPU", 0.0)) for i in range(workers)]
            + [ActorAsk("learner", k, "learner", k, cpus_l, plans[1].bundle.get("GPU", 0.0)) for k in range(ranks)])


def check_asks_fit(plans: list[RolePlan], asks: list[ActorAsk]) -> None:
    """Each bundle holds what the actors placed in it ask (else Ray never schedules one of them and
    the run waits forever: colocated TP > 1 did); every actor has a bundle. One line otherwise."""
    by_role = {p.role: p for p in plans}
    used: dict[tuple[str, int], dict[str, float]] = {}
    for a in asks:
        plan = by_role.get(a.group)
        if plan is None or not 0 <= a.bundle < plan.count:
            raise UserError(f"{a.role} {a.index} has no bundle in the {a.group} placement group: report this "
                            "(launch/placement.py)")
        slot = used.setdefault((a.group, a.bundle), {"CPU": 0.0, "GPU": 0.0})
        slot["CPU"] += a.num_cpus
        slot["GPU"] += a.num_gpus
    for (group, bundle), need in sorted(used.items()):
        have = by_role[group].bundle
        for resource, amount in need.items():
            if amount > have.get(resource, 0.0) + 1e-9:
                who = ", ".join(f"{a.role} {a.index} {getattr(a, 'num_' + resource.lower() + 's'):g}"
                                for a in asks if (a.group, a.bundle) == (group, bundle))
                raise UserError(f"the actors placed in {group} bundle {bundle} ask {amount:g} {resource} ({who}) "
                                f"and the bundle holds {have.get(resource, 0.0):g}: report this (launch/placement.py)")


@dataclass
class Placement:
    """The reserved groups and, per actor, the Ray options that put it in its bundle."""

    groups: dict[str, Any] = field(default_factory=dict)  # role → placement group
    colocated: bool = False
    rollout_stride: int = 1  # colocated: a tensor-parallel worker spans this many GPU bundles
    asks: list = field(default_factory=list)  # every ActorAsk (actor_asks)

    def _strategy(self, role: str, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.groups[role], placement_group_bundle_index=index,
            placement_group_capture_child_tasks=True)}

    def options(self, role: str, index: int) -> dict[str, Any]:
        """The full Ray options of one actor (resources and bundle), from its `ActorAsk`."""
        ask = next(a for a in self.asks if (a.role, a.index) == (role, index))
        return {**self._strategy(ask.group, ask.bundle), "num_cpus": ask.num_cpus, "num_gpus": ask.num_gpus}

    def rollout_options(self, i: int) -> dict[str, Any]:
        return self.options("rollout", i)

    def rollout_env(self, i: int) -> dict[str, str]:
        """Colocated TP > 1 (GPU): rollout worker i spans the one-GPU bundles i·TP … i·TP + TP − 1, half
        of each (learner ranks hold the other halves); vLLM's Ray executor puts one TP worker in each
        (OpenRLHF's layout). The actor itself asks num_gpus=0 and must still see CUDA to build vLLM's
        GPU engine: ZERO_GPU_ENV keeps a site's RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1 from blanking its
        CUDA_VISIBLE_DEVICES. Nothing otherwise: the actor holds its GPUs or cores itself."""
        if not (self.colocated and self.rollout_stride > 1):
            return {}
        first = i * self.rollout_stride
        return {"VLLM_RAY_BUNDLE_INDICES": ",".join(str(first + k) for k in range(self.rollout_stride)),
                "VLLM_RAY_PER_WORKER_GPUS": f"{COLOCATED_GPU_SHARE:g}", **ZERO_GPU_ENV}

    def learner_options(self, rank: int) -> dict[str, Any]:
        return self.options("learner", rank)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.groups = {}


def make_placement(rollout_cfg: Any, learner_cfg: Any, *, timeout_s: float = 60.0,
                   on_wait: Optional[Callable[[str], None]] = None) -> Placement:
    """Reserve every role's bundles up front, so a run that cannot be placed fails now, not at step 1."""
    import ray
    from ray.util.placement_group import placement_group

    plans = role_plans(rollout_cfg, learner_cfg)
    for p in plans:
        if p.strategy not in STRATEGIES:
            raise UserError(f"{p.role}.placement_strategy='{p.strategy}': use one of {', '.join(STRATEGIES)}")
    asks = actor_asks(rollout_cfg, learner_cfg)
    check_asks_fit(plans, asks)
    check_fits(plans, ray.cluster_resources())
    placement = Placement(colocated=plans[0].role == "colocated",
                          rollout_stride=max(1, int(rollout_gpus(rollout_cfg))), asks=asks)
    for p in plans:
        placement.groups[p.role] = placement_group([dict(p.bundle) for _ in range(p.count)], strategy=p.strategy,
                                                   name=f"stapoctl-{p.role}-{id(placement):x}")
    refs = [pg.ready() for pg in placement.groups.values()]
    t0 = time.monotonic()
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=2.0)
    if pending and on_wait:
        on_wait(f"waiting up to {timeout_s:.0f} s for resources ({_fmt(total_need(plans))}; free now: "
                f"{_fmt(ray.available_resources())})")
    if pending:
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, timeout_s - (time.monotonic() - t0)))
    if pending:
        free = _fmt(ray.available_resources())
        placement.remove()
        raise UserError(
            f"the run's actors ({_fmt(total_need(plans))}) could not be placed within {timeout_s:.0f} s "
            f"(free now: {free}; other jobs hold the rest, or a {plans[0].strategy} strategy cannot be met): "
            "wait for them, raise cluster.placement_timeout_s, or ask for less"
        )
    return placement


def _fmt(resources: dict) -> str:
    keys = sorted(resources, key=lambda k: (k not in ("CPU", "GPU"), k))
    return ", ".join(f"{float(resources[k]):g} {k}" for k in keys
                     if not k.startswith(("node:", "memory", "object_store_memory", "accelerator_type")))
