"""Typed config schema. Every field here is a knob a run records in MLflow.

Groups mirror the packages (model, data, loss, rollout, learner, reward, eval, tracking,
cluster, trainer). The loss group's nodes come from the loss registry (`stapoctl.losses.LOSSES`),
so a new method needs no edit here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

STAPO_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass
class TinyModelConfig:
    """Shape and warm start of the embedded Qwen3-architecture model (built locally, no download)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 512
    max_position_embeddings: int = 512
    # supervised warm start on the toy task, so the base model emits \boxed{} at all
    # (500 x 64 demos: the held-out arithmetic is ~80% right at T=1.0; 400 steps gave ~60%)
    warm_start_steps: int = 500
    warm_start_batch_size: int = 64
    warm_start_lr: float = 3e-3
    # fraction of warm-start demos that end "answer S" instead of \boxed{S}: designed RL headroom
    # (0.6: the base boxes ~40% of its answers, so T=1.0 accuracy ~30% under a ~80% ceiling)
    unboxed_fraction: float = 0.6


@dataclass
class ModelConfig:
    name: str = "tiny"
    # "" = the embedded tiny model; else an HF id, a local dir, a checkpoint dir or an MLflow run id
    path: str = ""
    dtype: str = "float32"  # bfloat16 for real runs on GPU
    seed: int = 0
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class ToyTaskConfig:
    """The generated arithmetic task the embedded default trains and validates on."""

    num_train: int = 4096  # capped by the problem space minus the held-out split
    num_heldout: int = 256
    seed: int = 1234
    # "Compute a + b * c." with a in [operand_min, addend_max], b, c in [operand_min, factor_max]
    operand_min: int = 2
    addend_max: int = 30
    factor_max: int = 9


@dataclass
class DataConfig:
    name: str = "toy"  # toy | dapo-math-17k
    # folder of <name>.jsonl files used before the hub (env STAPOCTL_DATA)
    root: Optional[str] = None
    # a local jsonl/parquet replacing the hub download
    source: Optional[str] = None
    # how the instruction is wrapped: "chat" (the tokenizer's chat template) or "plain"
    template: str = "chat"
    instruction: str = STAPO_INSTRUCTION
    train_batch_size: int = 8  # prompts per rollout step
    max_prompt_length: int = 64
    shuffle: bool = True
    seed: int = 0
    toy: ToyTaskConfig = field(default_factory=ToyTaskConfig)


@dataclass
class RolloutConfig:
    engine: str = "vllm"
    num_workers: int = 1
    cpus_per_worker: float = 1.0  # fractions allow several actors per core (e.g. 0.5)
    gpus_per_worker: float = 0.0
    # custom Ray resources each worker's bundle asks for: pins the role to nodes that advertise them
    resources: Dict[str, float] = field(default_factory=dict)
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD (Ray placement groups)
    tensor_parallel_size: int = 1
    n: int = 8  # responses per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_length: int = 48
    gpu_memory_utilization: float = 0.5
    kv_cache_gb: int = 1  # VLLM_CPU_KVCACHE_SPACE on a CPU machine
    enforce_eager: bool = True
    # old log-probs for the ratio: "recompute" with the learner (verl style) or take vLLM's "rollout"
    old_logprob_source: str = "recompute"
    # Ray restarts a rollout actor whose process dies this many times (-1: always); the driver
    # then pushes the learner's weights to it and re-sends the lost rollout
    max_restarts: int = 3
    # learner -> vLLM weight transfer: auto (CPU: Ray object store + in-place reload;
    # GPU: CUDA IPC when colocated, NCCL broadcast when disaggregated) | object_store | nccl | ipc
    weight_sync: str = "auto"


@dataclass
class LearnerConfig:
    backend: str = "deepspeed"
    zero_stage: int = 0
    num_ranks: int = 1  # data-parallel ranks (DeepSpeed processes): gloo on CPU, one GPU each on GPU
    gpus_per_rank: float = 0.0  # 1 on a GPU cluster; 0 trains on CPU
    cpus: float = 1.0  # per rank; fractions allow several ranks per core
    resources: Dict[str, float] = field(default_factory=dict)  # custom Ray resources per rank's bundle
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    placement: str = "disaggregated"  # or "colocated" (GPU: learner and rollout share devices)
    lr: float = 1e-6
    warmup_steps: int = 10
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    ppo_mini_batch_size: int = 64  # prompts per optimizer step
    micro_batch_size: int = 8  # sequences per forward/backward
    ppo_epochs: int = 1
    logits_chunk_size: int = 1024
    gradient_checkpointing: bool = False
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer state on CPU (stages 1-3)


@dataclass
class RewardConfig:
    correct: float = 1.0
    incorrect: float = -1.0
    # hard wall-clock limit per equivalence check (enforced from outside the verifier process)
    verify_timeout_s: float = 5.0
    num_workers: int = 2  # verifier subprocesses checking answers in parallel
    verify_max_memory_gb: float = 4.0  # address-space cap per verifier subprocess (0 = none)
    # a verifier model (e.g. opencompass/CompassVerifier-3B) that corrects the rule verifier; off by default
    model_verifier: Optional[str] = None
    model_verifier_mode: str = "rescue"  # rescue: re-judge rule rejections only; all: judge every response
    model_verifier_prompt: Optional[str] = None  # {question} {gold_answer} {llm_response}; None = built-in
    model_verifier_max_tokens: int = 8
    model_verifier_max_model_len: int = 4096
    model_verifier_dtype: str = "auto"
    model_verifier_cpus: float = 1.0
    model_verifier_gpus: float = 0.0


@dataclass
class EvalConfig:
    benches: List[str] = field(default_factory=lambda: ["toy"])
    decoding: str = "both"  # train | justrl | both
    # samples per problem; None = the paper's default for each benchmark (32 or 4)
    k: Optional[int] = None
    max_response_length: int = 20480
    every_n_steps: int = 0  # 0 = no periodic validation during training
    # per-sample JSONL, summary.json; default STAPOCTL_HOME/eval/<model-slug>/ (reruns resume there)
    output_dir: Optional[str] = None
    seed: int = 0  # sampling seed (per chunk of problems, derived from the first problem id)


@dataclass
class TrackingConfig:
    uri: Optional[str] = None  # else MLFLOW_TRACKING_URI, else sqlite under STAPOCTL_HOME
    experiment: str = "stapoctl"
    run_name: Optional[str] = None
    log_artifacts: bool = True
    # nest this run under another (a sweep's parent run): MLflow tag mlflow.parentRunId
    parent_run_id: Optional[str] = None
    # at the end, how long to wait for an unreachable MLflow server to take the buffered records
    # (they stay in <run dir>/mlflow_journal.jsonl and are sent by the next resume otherwise)
    flush_timeout_s: float = 120.0


@dataclass
class ClusterConfig:
    name: str = "local"  # local | ray | slurm
    address: Optional[str] = None  # Ray cluster address (ray://… or auto)
    num_cpus: Optional[int] = None
    num_gpus: Optional[int] = None
    # how long a run waits for busy resources before it gives up (an impossible placement fails at once)
    placement_timeout_s: float = 60.0
    # SLURM (submitit)
    partition: Optional[str] = None
    account: Optional[str] = None
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int = 16
    timeout_min: int = 60 * 24
    log_dir: str = "slurm_logs"


@dataclass
class TrainerConfig:
    total_steps: int = 60
    save_freq: int = 20
    seed: int = 0
    output_dir: Optional[str] = None  # checkpoints; default under STAPOCTL_HOME/runs/<run id>
    log_every: int = 1
    val_before_train: bool = True  # validate the starting policy (step 0) when eval.every_n_steps > 0
    log_samples: int = 4  # responses saved as an MLflow text artifact at each validation
    # refuse to start when the output dir's disk has less free space (checkpoints need room)
    min_free_gb: float = 1.0


@dataclass
class StapoctlConfig:
    defaults: List[Any] = field(
        default_factory=lambda: [
            {"model": "tiny"},
            {"data": "toy"},
            {"loss": "stapo"},
            {"rollout": "default"},
            {"learner": "default"},
            {"reward": "default"},
            {"eval": "default"},
            {"tracking": "default"},
            {"cluster": "local"},
            {"trainer": "default"},
            "_self_",
        ]
    )
    experiment: str = "tiny"
    resume: Optional[str] = None  # an MLflow run id or a checkpoint dir to continue
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    loss: Any = MISSING
    rollout: RolloutConfig = MISSING
    learner: LearnerConfig = MISSING
    reward: RewardConfig = MISSING
    eval: EvalConfig = MISSING
    tracking: TrackingConfig = MISSING
    cluster: ClusterConfig = MISSING
    trainer: TrainerConfig = MISSING
