"""A rollout actor lost: when Ray restarts one, which failed calls are its loss, and when a loss
ends the run at once instead of a recovery (a transport that cannot re-link a new vLLM process)."""

from __future__ import annotations

from typing import Any

from stapoctl.errors import EngineFault
from stapoctl.launch.actor_errors import describe_actor_death


def rollout_max_restarts(rollout_cfg: Any, method: str) -> int:
    """`rollout.max_restarts`, or 0 where the transport cannot re-link a new vLLM process (gloo,
    NCCL, IPC): a restart would only wait for a process that can never be given the weights."""
    from stapoctl.sync.transports import transport

    return int(rollout_cfg.get("max_restarts", 0) or 0) if transport(method).relinks else 0


def is_rollout_loss(exc: BaseException) -> bool:
    """A rollout call lost to its actor dying (or coming back without the current weights)."""
    import ray

    from stapoctl.rollout.vllm_worker import StaleWeightsError

    return isinstance(exc, (ray.exceptions.RayActorError, StaleWeightsError))


def lost_for_good(sync: Any, label: str, exc: BaseException) -> None:
    """A lost rollout actor under a linked transport (gloo, NCCL, IPC): named now, by the call that
    lost it. A recovery would ask the live actors first, and they may sit in the next queued push
    waiting for the dead one (issue #49, BUG-1)."""
    from stapoctl.sync.transports import transport

    if sync is not None and not transport(sync.method).relinks:
        sync.broken = True  # the live peers may sit in the next push's collective: shut down without waiting
        raise EngineFault(f"{label} died while generating and weight_sync={sync.method} cannot re-link a new "
                          f"vLLM process: {describe_actor_death(exc)}") from exc
