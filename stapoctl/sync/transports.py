"""The registry of learner → vLLM weight transports: a name (`rollout.weight_sync`) → the trainer
side, the vLLM worker side and how the driver pushes. `choose_method` consults it; `WeightSync`,
the learner's `StateIO` and the rollout actor dispatch through it instead of branching on names.

A transport that rides vLLM's weight-transfer API names its worker engine (`vllm_backend`, a name
in vLLM's `WeightTransferEngineFactory`) and its trainer engine (`trainer`, "module:Class" of a
`TrainerWeightTransferEngine` subclass built on the learner's rank 0). `push` names the driver's
strategy in `sync.transfer.PUSHES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from stapoctl.errors import UserError


@dataclass(frozen=True)
class Transport:
    name: str
    summary: str
    push: str  # a key of sync.transfer.PUSHES
    needs_gpu: bool = False
    vllm_backend: Optional[str] = None  # the worker engine's name in vLLM's WeightTransferEngineFactory
    trainer: Optional[str] = None  # "module:Class" of the trainer engine (a TrainerWeightTransferEngine)
    relinks: bool = False  # a restarted rollout actor can be given the weights alone (else: resume the run)
    # the workers join a process group with the learner's rank 0 (gloo, NCCL): each init payload
    # carries the actor's `rank_offset`, and each worker process holds a rank. CUDA IPC has none: its
    # init payload is vLLM's `{"packed": ...}` exactly (an extra key fails vLLM's parse).
    rendezvous: bool = False


TRANSPORTS: dict[str, Transport] = {}


def register_transport(transport: Transport) -> Transport:
    if transport.name in TRANSPORTS or transport.name == "auto":
        raise ValueError(f"weight transport {transport.name!r} is already registered")
    TRANSPORTS[transport.name] = transport
    return transport


def transport(name: str) -> Transport:
    return TRANSPORTS[name]


def choose_method(requested: str, *, on_gpu: bool, placement: str) -> str:
    """`rollout.weight_sync` → a registered transport: auto = the object store on CPU, CUDA IPC when
    learner and vLLM share a GPU (colocated), NCCL broadcast otherwise."""
    if requested == "auto":
        if not on_gpu:
            return "object_store"
        return "ipc" if placement == "colocated" else "nccl"
    if requested not in TRANSPORTS:
        raise UserError(f"rollout.weight_sync='{requested}': use auto, {', '.join(TRANSPORTS)}")
    if TRANSPORTS[requested].needs_gpu and not on_gpu:
        cpu = [n for n, t in TRANSPORTS.items() if not t.needs_gpu]
        raise UserError(f"rollout.weight_sync='{requested}' needs GPUs; on CPU use auto or {' or '.join(cpu)}")
    return requested


register_transport(Transport(
    "object_store", "CPU: rank 0's tensors put once into Ray's object store, read in place by every actor",
    push="object_store", relinks=True))
register_transport(Transport(
    "gloo", "CPU or GPU: byte buckets broadcast over torch.distributed gloo from the learner's rank 0 to every vLLM "
    "worker process (stapoctl's vLLM engine `stapo_gloo`; the collective path CI runs)",
    push="engine", vllm_backend="stapo_gloo", trainer="stapoctl.sync.trainer_engines:GlooTrainer", rendezvous=True))
register_transport(Transport(
    "nccl", "GPU, disaggregated: a broadcast from the learner's rank 0 to every vLLM worker (vLLM's NCCL engine)",
    push="engine", needs_gpu=True, vllm_backend="nccl", trainer="stapoctl.sync.trainer_engines:NCCLTrainer",
    rendezvous=True))
register_transport(Transport(
    "ipc", "GPU, colocated: CUDA IPC handles of the learner's tensors opened by vLLM on the same GPU",
    push="engine_learner_driven", needs_gpu=True, vllm_backend="ipc",
    trainer="stapoctl.sync.trainer_engines:IPCTrainer"))
