"""The policy learner: a DeepSpeed engine inside a Ray actor, one actor per data-parallel rank.

The actor is assembled from these concepts, each in its own module:
`engine_setup` (process group, model, optimizer, schedule; `reset` for a new sweep trial),
`ppo_step` (recompute old log-probs, PPO mini-batch updates with the configured loss; a typed
`StepResult` back), `forward` (the forward passes), `data_parallel` (rows per rank, gathers),
`micro_batches` (fixed or token-budget micro-batches), `reference` (the KL term's frozen policy)
and `state_io` (weights for the rollout workers, checkpoints). This module places the ranks
(`learner.num_ranks`; one GPU each on GPU, gloo on CPU) and wires their rendezvous.
"""

from __future__ import annotations

from typing import Any, Optional

from stapoctl.learner.data_parallel import DataParallel
from stapoctl.learner.engine_setup import EngineSetup, extensions_dir, process_group_timeout_s, uses_cuda
from stapoctl.learner.forward import PolicyForward
from stapoctl.learner.micro_batches import MicroBatching
from stapoctl.learner.ppo_step import PPOStep
from stapoctl.learner.reference import ReferencePolicy
from stapoctl.learner.state_io import StateIO


class Learner(EngineSetup, PPOStep, PolicyForward, DataParallel, MicroBatching, ReferencePolicy, StateIO):
    """One data-parallel rank. Every rank receives every call (the driver fans them out)."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = int(rank), int(world_size)
        self.engine = None
        self.transfer = None

    def pid(self) -> int:
        import os

        return os.getpid()


def learner_env(use_cuda: bool) -> dict[str, str]:
    from stapoctl.launch.ray_runtime import actor_env

    extra = {"TORCH_EXTENSIONS_DIR": extensions_dir()}
    if not use_cuda:
        extra["DS_ACCELERATOR"] = "cpu"
    return actor_env(extra)


def num_ranks(learner: dict) -> int:
    return max(1, int(learner.get("num_ranks") or 1))


def make_learner_group(
    model_path: str,
    learner: dict,
    loss: dict,
    *,
    n_per_prompt: int,
    temperature: float,
    dtype: str,
    top_p: float = 1.0,
    seed: int,
    max_response_length: Optional[int] = None,
    reference_path: Optional[str] = None,
    placement: Any = None,
    wait: bool = True,
    start_timeout_s: float = 600.0,
) -> tuple[list, Any]:
    """Start learner.num_ranks actors, wire their rendezvous, start DeepSpeed on each.

    Returns (handles, setup refs); with wait=False the caller overlaps the DeepSpeed start-up
    with other work (vLLM's) and waits on the refs itself. The rendezvous address is waited for at
    most `start_timeout_s`.
    """
    import ray

    use_cuda = float(learner.get("gpus_per_rank") or 0) > 0
    world = num_ranks(learner)
    actor_cls = ray.remote(Learner)
    handles = []
    for rank in range(world):
        opts: dict[str, Any] = dict(
            num_cpus=float(learner.get("cpus") or 1),
            num_gpus=float(learner.get("gpus_per_rank") or 0) if use_cuda else 0.0,
            runtime_env={"env_vars": learner_env(use_cuda)},
        )
        if placement is not None:
            opts.update(placement.learner_options(rank))
        handles.append(actor_cls.options(**opts).remote(rank, world))
    try:  # bounded: a rank Ray cannot schedule would otherwise hold the run (and `doctor`) forever
        # rank 0 answers with the port of a store it already listens on: no window for another process
        addr, port = ray.get(handles[0].rendezvous.remote(process_group_timeout_s(learner)), timeout=start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        from stapoctl.errors import EngineFault

        for h in handles:
            ray.kill(h)
        raise EngineFault(f"learner rank 0 did not start within {start_timeout_s:.0f} s (Ray did not schedule it: "
                          f"asked {opts.get('num_cpus', 0):g} CPU, {opts.get('num_gpus', 0):g} GPU): see `ray status` "
                          "for what holds the resources") from None
    refs = [
        h.setup.remote(model_path, learner, loss, n_per_prompt=n_per_prompt, temperature=temperature,
                       top_p=top_p, dtype=dtype, seed=seed, max_response_length=max_response_length,
                       reference_path=reference_path, master_addr=addr, master_port=port)
        for h in handles
    ]
    if wait:
        ray.get(refs)
    return handles, refs


__all__ = ["Learner", "make_learner_group", "learner_env", "num_ranks", "uses_cuda"]
