"""The engines of a run, started once and reused every step: N vLLM rollout actors, the
DeepSpeed learner rank(s) and the weight sync between them. vLLM's start-up and DeepSpeed's
overlap (they are separate actors), which hides most of the ~1 min fixed cost on CPU."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from stapoctl.errors import UserError


def max_model_len(conf: DictConfig, model_path: str) -> int:
    """Prompt + the longest response training or validation asks for, within the model's window."""
    want = int(conf.data.max_prompt_length) + max(
        int(conf.rollout.max_response_length), int(conf.eval.max_response_length)
    )
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        limit = int(cfg.get("max_position_embeddings") or want)
    except (OSError, ValueError):
        limit = want
    return min(want, limit)


def thread_counts(conf: DictConfig) -> tuple[int, int]:
    """Intra-op threads of (each rollout actor, each learner rank).

    0 = auto. In the synchronous loop one phase runs at a time, so the active role may use the
    whole node (its cores shared among the role's actors); in async mode both roles run at once
    and each actor keeps to its CPU share. On a remote cluster the driver does not know the
    nodes' cores, so auto keeps to the share there too.
    """
    import math
    import os

    r, lrn = conf.rollout, conf.learner
    shares = (max(1, math.floor(float(r.cpus_per_worker))), max(1, math.floor(float(lrn.cpus))))
    if conf.trainer.mode == "sync" and not conf.cluster.address:
        cores = int(conf.cluster.num_cpus or len(os.sched_getaffinity(0)) or 1)
        shares = (max(1, cores // max(1, int(r.num_workers))), max(1, cores // max(1, int(lrn.num_ranks or 1))))
    return (int(r.num_threads) or shares[0], int(lrn.num_threads) or shares[1])


def old_logprob_source(conf: DictConfig) -> str:
    """`auto`: vLLM's log-probs where they equal the learner's (synchronous, fp32, T=1: measured to
    ~1e-6 here and watched by the canary), the learner's recompute elsewhere (bf16 kernels differ,
    vLLM's log-probs are untempered, async training needs the proximal policy's)."""
    source = str(conf.rollout.old_logprob_source)
    if source != "auto":
        return source
    exact = (conf.trainer.mode == "sync" and conf.model.dtype in ("float32", "fp32")
             and float(conf.rollout.temperature) == 1.0)
    return "rollout" if exact else "recompute"


def learner_args(conf: DictConfig) -> dict[str, Any]:
    """Everything a learner rank's `setup` / `reset` takes from a run's config."""
    r = conf.rollout
    learner = OmegaConf.to_container(conf.learner, resolve=True)
    learner["num_threads"] = thread_counts(conf)[1]
    return dict(
        learner=learner,
        loss=OmegaConf.to_container(conf.loss, resolve=True),
        n_per_prompt=int(r.n), temperature=float(r.temperature), dtype=conf.model.dtype,
        seed=int(conf.trainer.seed), max_response_length=int(r.max_response_length),
    )


@dataclass
class Engines:
    workers: list
    learners: list
    sync: Any
    placement: Any
    info: dict = field(default_factory=dict)

    @property
    def learner(self):
        """Rank 0: its results are the step's (every rank runs every call)."""
        return self.learners[0]

    def call_learners(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a method on every learner rank; rank 0's result."""
        import ray

        return ray.get([getattr(h, method).remote(*args, **kwargs) for h in self.learners])[0]

    def shutdown(self) -> None:
        """Stop vLLM inside its actors first (shared memory), then the actors themselves."""
        import ray

        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=60)
            except Exception:
                pass
        for h in self.learners:
            try:
                ray.get(h.shutdown.remote(), timeout=30)
            except Exception:
                pass
        for actor in [*self.workers, *self.learners]:
            try:
                ray.kill(actor)
            except Exception:
                pass
        if self.placement is not None:
            self.placement.remove()


def start_engines(conf: DictConfig, policy_path: str, console=None) -> Engines:
    """Ray, then the run's placement, then the vLLM actors and the learner ranks in parallel,
    then the weight-sync link."""
    import ray

    from stapoctl.launch.placement import make_placement, rollout_gpus
    from stapoctl.launch.ray_runtime import ensure_ray
    from stapoctl.learner.deepspeed_learner import make_learner_group
    from stapoctl.rollout.vllm_engine import EngineSpec
    from stapoctl.rollout.vllm_worker import make_rollout_worker
    from stapoctl.sync.transfer import WeightSync, choose_method

    t0 = time.perf_counter()
    started_ray = ensure_ray(conf.cluster)
    t_ray = time.perf_counter() - t0
    r, lrn = conf.rollout, conf.learner
    on_gpu = float(r.gpus_per_worker or 0) > 0 or float(lrn.gpus_per_rank or 0) > 0
    if on_gpu and not ray.cluster_resources().get("GPU"):
        raise UserError(
            "rollout.gpus_per_worker / learner.gpus_per_rank ask for GPUs and the Ray cluster has none: "
            "set both to 0 on a CPU machine (the embedded default does)"
        )
    method = choose_method(r.weight_sync, on_gpu=on_gpu, placement=lrn.placement)
    say = (lambda msg: console.print(f"[yellow]{msg}[/]")) if console is not None else None
    placement = make_placement(r, lrn, timeout_s=float(conf.cluster.placement_timeout_s), on_wait=say)
    spec = EngineSpec(
        model_path=policy_path,
        seed=int(conf.trainer.seed),
        max_model_len=max_model_len(conf, policy_path),
        dtype=conf.model.dtype,
        tensor_parallel_size=int(r.tensor_parallel_size),
        gpu_memory_utilization=float(r.gpu_memory_utilization),
        kv_cache_gb=int(r.kv_cache_gb),
        enforce_eager=bool(r.enforce_eager),
        weight_transfer_backend=method if method in ("nccl", "ipc") else None,
        num_threads=thread_counts(conf)[0] if not on_gpu else 0,
    )
    workers = [make_rollout_worker(spec, num_cpus=float(r.cpus_per_worker), num_gpus=rollout_gpus(r),
                                   options=placement.rollout_options(i))
               for i in range(int(r.num_workers))]
    learners, setup_refs = make_learner_group(policy_path, **learner_args(conf), placement=placement, wait=False)
    partial = Engines(workers=workers, learners=learners, sync=None, placement=placement)
    try:
        worker_info = ray.get([w.info.remote() for w in workers])
        learner_info = ray.get(setup_refs)
        sync = WeightSync(learners, workers, method, vllm_world_size=int(r.tensor_parallel_size))
    except BaseException as exc:
        partial.shutdown()
        cause = getattr(exc, "cause", None)
        if isinstance(cause, UserError):
            raise cause from None
        raise
    info = {
        "ray_s": t_ray,
        "engines_s": time.perf_counter() - t0,
        "vllm_init_s": max(w["init_s"] for w in worker_info),
        "learner_setup_s": max(x["setup_s"] for x in learner_info),
        "sync_method": method,
        "pad_token_id": worker_info[0]["pad_token_id"],
        "eos_token_id": worker_info[0]["eos_token_id"],
        "params": learner_info[0].get("params", -1),
        "threads": dict(zip(("rollout", "learner"), thread_counts(conf))),
        "started_ray": started_ray,
        "nodes": {"rollout": [w.get("node_id", "") for w in worker_info],
                  "learner": [x.get("node_id", "") for x in learner_info]},
    }
    return Engines(workers=workers, learners=learners, sync=sync, placement=placement, info=info)
