"""The policy learner: a DeepSpeed engine inside a Ray actor, one actor per data-parallel rank.

The actor is assembled from these concepts, each in its own module:
`engine_setup` (process group, model, optimizer, schedule; `reset` for a new sweep trial),
`ppo_step` (recompute old log-probs, PPO mini-batch updates with the configured loss; a typed
`StepResult` back), `forward` (the forward passes), `data_parallel` (rows per rank, gathers),
`micro_batches` (fixed or token-budget micro-batches), `reference` (the KL term's frozen policy)
and `state_io` (weights for the rollout workers, checkpoints). This module holds the class and
each rank's environment; `group.LearnerGroup` starts the ranks (`learner.num_ranks`; one GPU
each on GPU, gloo on CPU), wires their rendezvous and is the driver's only way to call them.
"""

from __future__ import annotations

from stapoctl.learner.data_parallel import DataParallel
from stapoctl.learner.engine_setup import EngineSetup, extensions_dir, uses_cuda
from stapoctl.learner.forward import PolicyForward
from stapoctl.learner.micro_batches import MicroBatching
from stapoctl.learner.ppo_step import PPOStep
from stapoctl.learner.reference import ReferencePolicy
from stapoctl.learner.state_io import StateIO


class Learner(EngineSetup, PPOStep, PolicyForward, DataParallel, MicroBatching, ReferencePolicy, StateIO):
    """One data-parallel rank. Every rank receives every call (`group.LearnerGroup` fans them out)."""

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


__all__ = ["Learner", "learner_env", "num_ranks", "uses_cuda"]
