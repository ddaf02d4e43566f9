"""GPUs asked for on a machine without one, more vLLM-CPU tensor-parallel ranks than cores, and a
local placement that can never fit."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

from stapoctl.config.validate import fmt_value
from stapoctl.errors import UserError


def gpus_asked(conf: DictConfig, *, learner: bool = True) -> list[tuple[str, Any]]:
    """The (key, value) pairs of the config that ask for GPUs."""
    gpu_fields = [("rollout.gpus_per_worker", conf.rollout.gpus_per_worker)]
    if learner:
        gpu_fields.append(("learner.gpus_per_rank", conf.learner.get("gpus_per_rank", 0)))
    if conf.reward.model_verifier:
        gpu_fields.append(("reward.model_verifier_gpus", conf.reward.model_verifier_gpus))
    return [(k, v) for k, v in gpu_fields if float(v or 0) > 0]


def check_machine(conf: DictConfig, *, learner: bool = True) -> None:
    """GPUs asked for on a machine without one; a local placement that can never fit."""
    c = conf.cluster
    if c.name != "local" or c.address:
        return  # a Ray cluster or SLURM job: checked where the resources are (make_placement)
    asked = gpus_asked(conf, learner=learner)
    # counting GPUs imports torch (~1 s, then off `stapoctl train`'s path to Ray): without a GPU
    # asked for, the count changes no check
    gpus = local_gpus() if asked else 0
    if asked and gpus == 0:
        names = " ".join(f"{k}=0" for k, _ in asked)
        raise UserError(
            f"{asked[0][0]}={fmt_value(asked[0][1])} asks for GPUs, but this machine has none (torch.cuda."
            f"is_available() is False): set {names} to run on CPU, or run where GPUs are (cluster=slurm)"
        )
    # vLLM runs on CUDA when its worker (or the learner beside it) has GPUs; the judge's do not count
    check_cpu_tensor_parallel(conf, on_gpu=any(k != "reward.model_verifier_gpus" for k, _ in asked))
    from stapoctl.launch.placement import check_fits, role_plans

    cpus = float(c.num_cpus or len(os.sched_getaffinity(0)) or 1)
    have = {"CPU": cpus, "GPU": float(c.num_gpus if c.num_gpus is not None else gpus)}
    plans = [p for p in role_plans(conf.rollout, conf.learner) if learner or p.role == "rollout"]
    check_fits(plans, have, where="this machine")
    if conf.reward.model_verifier:
        need = sum(p.bundle.get("CPU", 0) * p.count for p in plans) + float(conf.reward.model_verifier_cpus)
        if need > cpus:
            raise UserError(
                f"the run needs {need:g} CPU with the verifier model (reward.model_verifier_cpus="
                f"{fmt_value(conf.reward.model_verifier_cpus)}) and this machine has {cpus:g}: lower "
                "reward.model_verifier_cpus (e.g. 0.5) or set cluster.num_cpus"
            )


def check_cpu_tensor_parallel(conf: DictConfig, *, on_gpu: bool) -> None:
    """vLLM-CPU binds each tensor-parallel rank to cores of its own (`rollout.vllm_worker.
    cpu_thread_binding`): with more ranks than this machine's cores the first actor would fail
    after the MLflow run exists, so refuse it here. `VLLM_CPU_OMP_THREADS_BIND` set wins there too."""
    tp = int(conf.rollout.tensor_parallel_size or 1)
    cores = len(os.sched_getaffinity(0))
    if on_gpu or tp <= cores or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return
    raise UserError(
        f"rollout.tensor_parallel_size={tp} needs a CPU core per tensor-parallel rank and this machine has "
        f"{cores}: lower rollout.tensor_parallel_size to {cores} or less, or run on GPUs or a cluster"
    )


def local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0
