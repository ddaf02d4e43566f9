"""Typed config schema. Every field here is a knob a run records in MLflow.

Groups mirror the packages (model, data, loss, rollout, learner, reward, eval, tracking,
cluster, trainer). A field with a limited set of valid values declares it (`spec(..., range=
"[1, inf)")` or `choices=`, see `config.fields`); `config.validate` checks every run against them. The loss group's nodes come from the loss registry (`stapoctl.losses.LOSSES`),
so a new method needs no edit here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from stapoctl.config.fields import spec

POSITIVE_INT = "[1, inf)"
NON_NEGATIVE = "[0, inf)"
POSITIVE = "(0, inf)"

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
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
    # The demos' phrasing mix = the base model's forks (stapoctl/data/toy.py has the table).
    # Share of demos ending "answer S" instead of \boxed{S}: the rewarded fork, RL's headroom
    # (0.7: the base boxes ~30% of its answers, so T=1.0 accuracy ~20% under a ~65% ceiling)
    unboxed_fraction: float = 0.7
    # reward-neutral high-entropy forks (h* lands among them): c*b, P+a, ";" ending a step
    swapped_product_fraction: float = 0.4
    swapped_sum_fraction: float = 0.35
    semicolon_fraction: float = 0.3
    # reward-neutral low-entropy forks whose sampled variant lands between the swept tau_p:
    # "x" for "*" (pi ~ 5e-2: silenced by tau_p 0.2 only), " = " for "=" (pi ~ 1e-2: 2e-2 and 0.2)
    cross_fraction: float = 0.05
    spaced_eq_fraction: float = 0.015


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
    template: str = spec("chat", choices=("chat", "plain"))
    instruction: str = STAPO_INSTRUCTION
    train_batch_size: int = spec(8, range=POSITIVE_INT)  # prompts per rollout step
    max_prompt_length: int = spec(64, range=POSITIVE_INT)
    shuffle: bool = True
    seed: int = 0
    toy: ToyTaskConfig = field(default_factory=ToyTaskConfig)


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
    temperature: float = spec(1.0, range=NON_NEGATIVE)
    top_p: float = spec(1.0, range="(0, 1]")
    max_response_length: int = spec(48, range=POSITIVE_INT)
    gpu_memory_utilization: float = spec(0.5, range="(0, 1]")
    # CPU: the KV cache in GiB (vLLM's kv_cache_memory_bytes; allocated and zeroed at engine start,
    # freed at its end); on a GPU gpu_memory_utilization sizes it instead
    kv_cache_gb: float = spec(1.0, range=POSITIVE)
    enforce_eager: bool = True
    # old log-probs for the ratio: "recompute" with the learner (verl style), take vLLM's "rollout"
    # (equal to the learner's in fp32 at T=1: one forward pass less per step), or "auto" (rollout
    # where they match — synchronous, fp32, T=1 — recompute elsewhere)
    old_logprob_source: str = spec("auto", choices=("auto", "recompute", "rollout"))
    # with vLLM's log-probs as old ones, measure the learner's anyway every N steps (and at the first):
    # the sync canary rollout/logprob_diff_max and the token diagnostics need that pass
    logprob_check_every: int = spec(10, range=NON_NEGATIVE)
    # intra-op threads of each vLLM actor; 0 = auto (sync loop: the node's cores shared by the workers,
    # since one phase runs at a time; async: the actor's own CPU share)
    num_threads: int = spec(0, range=NON_NEGATIVE)
    # Ray restarts a rollout actor whose process dies this many times (-1: always); the driver
    # then pushes the learner's weights to it and re-sends the lost rollout
    max_restarts: int = spec(3, range="[-1, inf)")
    # learner -> vLLM weight transfer: auto (CPU: Ray object store + in-place reload;
    # GPU: CUDA IPC when colocated, NCCL broadcast when disaggregated) | object_store | nccl | ipc
    weight_sync: str = spec("auto", choices=("auto", "object_store", "nccl", "ipc"))


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


@dataclass
class RewardConfig:
    correct: float = 1.0
    incorrect: float = -1.0
    # hard wall-clock limit per equivalence check (enforced from outside the verifier process)
    verify_timeout_s: float = spec(5.0, range=POSITIVE)
    num_workers: int = spec(2, range=POSITIVE_INT)  # verifier subprocesses checking answers in parallel
    verify_max_memory_gb: float = spec(4.0, range=NON_NEGATIVE)  # address-space cap per verifier subprocess (0 = none)
    # a verifier model (e.g. opencompass/CompassVerifier-3B) that corrects the rule verifier; off by default
    model_verifier: Optional[str] = None
    model_verifier_mode: str = spec("rescue", choices=("rescue", "all"))  # rescue: re-judge rule rejections only; all: judge every response
    model_verifier_prompt: Optional[str] = None  # {question} {gold_answer} {llm_response}; None = built-in
    model_verifier_max_tokens: int = 8
    model_verifier_max_model_len: int = 4096
    model_verifier_dtype: str = "auto"
    model_verifier_cpus: float = 1.0
    model_verifier_gpus: float = 0.0
    # DAPO's soft overlong punishment (reward/overlong.py): the last overlong_buffer tokens before
    # rollout.max_response_length ramp a penalty from 0 to -overlong_penalty (0 = off)
    overlong_buffer: int = spec(0, range=NON_NEGATIVE)  # tokens
    overlong_penalty: float = spec(1.0, range=NON_NEGATIVE)  # the factor: the penalty at the budget
    # DAPO's overlong filtering: truncated responses (hit rollout.max_response_length) leave the loss
    overlong_filter: bool = False


@dataclass
class EvalConfig:
    benches: List[str] = field(default_factory=lambda: ["toy"])
    decoding: str = spec("both", choices=("train", "justrl", "both"))
    # samples per problem; None = the paper's default for each benchmark (32 or 4)
    k: Optional[int] = spec(None, range=POSITIVE_INT)
    max_response_length: int = spec(20480, range=POSITIVE_INT)
    every_n_steps: int = spec(0, range=NON_NEGATIVE)  # 0 = no periodic validation during training
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
    # extra MLflow tags on the run: +tracking.tags.team=rl; dotted names as a dict, as a sweep tags
    # its trials: ++tracking.tags={stapoctl.trial:'1'}
    tags: Dict[str, str] = field(default_factory=dict)
    # at the end, how long to wait for an unreachable MLflow server to take the buffered records
    # (they stay in <run dir>/mlflow_journal.jsonl and are sent by the next resume otherwise)
    flush_timeout_s: float = spec(120.0, range=NON_NEGATIVE)


@dataclass
class ClusterConfig:
    """Where a run executes. `stapoctl train` runs here (local, or joins cluster.address);
    `stapoctl submit cluster=ray|slurm` sends the same run to a Ray cluster's job server or to
    SLURM. SLURM values usually come from a site preset (cluster/slurm/<preset>.yaml); values
    given on the command line win over the preset's."""

    name: str = spec("local", choices=("local", "ray", "slurm"))
    # train: the Ray cluster to join (auto, HOST:PORT, ray://HOST:10001);
    # submit cluster=ray: the job server, http://HOST:8265 (the dashboard's address)
    address: Optional[str] = None
    num_cpus: Optional[int] = spec(None, range=POSITIVE_INT)
    num_gpus: Optional[int] = spec(None, range=NON_NEGATIVE)
    # MKL's AVX-512 kernels for torch on AMD CPUs (launch/mkl_shim.py: a one-line library preloaded into the
    # engine actors; the learner's update at 25M took 1.9 s instead of 3.5 s here). auto: local Ray on an AMD
    # CPU with a C compiler; on: also on a remote Ray cluster (its nodes must see STAPOCTL_HOME); off: never
    mkl_amd_shim: str = spec("auto", choices=("auto", "on", "off"))
    # how long a run waits for busy resources before it gives up (an impossible placement fails at once)
    placement_timeout_s: float = spec(60.0, range=POSITIVE)
    # interpreter with stapoctl's dependencies on the cluster's nodes (default: this one,
    # sys.executable, right when the nodes share this filesystem); "python" on a Ray cluster
    # whose nodes have their own environment
    python: Optional[str] = None
    # Ray jobs: how the code reaches the cluster. path: PYTHONPATH to this checkout (same
    # machine or shared filesystem, nothing uploaded); upload: the checkout as working_dir;
    # auto: path for a loopback address, else upload
    ship_code: str = spec("auto", choices=("auto", "path", "upload"))
    # SLURM (submitit)
    preset: Optional[str] = None  # a site preset: cluster/slurm/<preset>.yaml
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    nodes: int = 1  # > 1: a Ray head on the first node, Ray workers on the others
    gpus_per_node: int = 8
    # one GPU's memory for `stapoctl plan` where no GPU is visible (a login node; SLURM presets set it)
    gpu_mem_gb: float = spec(80.0, range=POSITIVE)
    cpus_per_task: int = 16  # one task per node: the driver (1 node) or a Ray node
    mem_gb: Optional[float] = None  # per node; None: the site's default
    timeout_min: int = 60 * 24
    setup: List[str] = field(default_factory=list)  # shell lines before the job: module load, conda activate
    array_parallelism: int = 16  # sweeps as job arrays: trials running at once
    max_requeues: int = 3  # timeouts/preemptions a job may be requeued after (then it fails)
    ray_port: int = 6379  # the Ray head's port inside a multi-node allocation
    log_dir: Optional[str] = None  # submitit's folder (job scripts, logs); default STAPOCTL_HOME/jobs/<id>


@dataclass
class TrainerConfig:
    total_steps: int = spec(60, range=POSITIVE_INT)
    save_freq: int = spec(20, range=NON_NEGATIVE)
    keep_checkpoints: int = spec(0, "the newest N step dirs stay (the rest are deleted once a newer one verifies)", range=NON_NEGATIVE, why="0 = keep all")
    seed: int = 0
    output_dir: Optional[str] = None  # checkpoints; default under STAPOCTL_HOME/runs/<run id>
    log_every: int = spec(1, range=POSITIVE_INT)
    val_before_train: bool = True  # validate the starting policy (step 0) when eval.every_n_steps > 0
    log_samples: int = 4  # responses saved as an MLflow text artifact at each validation
    # sync: rollout → update → sync, one phase at a time. async: the rollouts of the next
    # max_staleness steps are generated while the learner updates (verl's one-step off-policy
    # at 1); stale batches get the truncated importance weight min(π_old/π_behav, C) of
    # loss.rollout_correction=auto, C = loss.rollout_is_cap.
    mode: str = spec("sync", choices=("sync", "async"))
    max_staleness: int = spec(1, range=NON_NEGATIVE, why="0 = synchronous")
    # renamed loss.rollout_is_cap; a value given here is moved there with a one-line notice
    is_cap: Optional[float] = spec(None, range="[1, inf)", why="the truncation of the importance weight")
    # 000 §3 token diagnostics (categories, prob–entropy histogram, spurious tokens) as MLflow
    # artifacts diagnostics/step_NNNNNN/ every N steps; 0 = off
    diagnostics_every: int = 20
    # refuse to start when the output dir's disk has less free space (checkpoints need room)
    min_free_gb: float = spec(1.0, range=NON_NEGATIVE)
    # DAPO dynamic sampling (trainer/dynamic_sampling.py): drop every prompt group whose n values
    # of dynamic_sampling_metric are all equal (acc: the rule verdicts; score: the final rewards,
    # shaping included) and generate rounds of data.train_batch_size new prompts until a batch is full
    dynamic_sampling: bool = False
    dynamic_sampling_metric: str = spec("acc", choices=("acc", "score"))
    # rounds per step at most (0 = no limit); then the step trains on the largest multiple of
    # learner.ppo_mini_batch_size groups it kept (none: no update), where verl stops the run
    max_gen_batches: int = spec(10, range=NON_NEGATIVE, why="0 = no limit")


@dataclass
class PlanConfig:
    """`stapoctl plan` (preflight/memory_plan.py): train, submit and sweep refuse a run whose plan
    cannot fit a GPU, the host or the checkpoint disk; false turns that into a warning."""

    enforce: bool = True


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
            {"plan": "default"},
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
    plan: PlanConfig = MISSING


# the config groups a user overrides as `group.key=value`, and the schema of each
GROUP_SCHEMAS = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "learner": LearnerConfig,
    "reward": RewardConfig,
    "eval": EvalConfig,
    "tracking": TrackingConfig,
    "cluster": ClusterConfig,
    "trainer": TrainerConfig,
    "plan": PlanConfig,
}
