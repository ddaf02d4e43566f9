"""Typed config schema: the root and the groups without a module of their own (model/data,
rollout/learner and cluster live in `model_data.py`, `engines.py`, `cluster.py` and are
re-exported here). Every field is a knob a run records in MLflow.

Groups mirror the packages (model, data, loss, rollout, learner, reward, eval, tracking,
cluster, trainer). A field with a limited set of valid values declares it (`spec(..., range=
"[1, inf)")` or `choices=`, see `config.fields`); `config.validate` checks every run against them. The loss group's nodes come from the loss registry (`stapoctl.losses.LOSSES`),
so a new method needs no edit here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from stapoctl.config.alarms import AlarmLimits
from stapoctl.config.fields import spec
from stapoctl.config.cluster import ClusterConfig
from stapoctl.config.engines import LearnerConfig, RolloutConfig
from stapoctl.config.model_data import STAPO_INSTRUCTION, DataConfig, ModelConfig, TinyModelConfig, ToyTaskConfig
from stapoctl.config.ranges import NON_NEGATIVE, POSITIVE, POSITIVE_INT

__all__ = ["AlarmLimits", "ClusterConfig", "DataConfig", "EvalConfig", "GROUP_SCHEMAS", "LearnerConfig", "ModelConfig", "PlanConfig",
           "RewardConfig", "RolloutConfig", "STAPO_INSTRUCTION", "StapoctlConfig", "TinyModelConfig", "ToyTaskConfig",
           "TrackingConfig", "TrainerConfig"]


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
    # run-health alarms (trainer/alarms.py, docs/RUNS.md "Alarms"): each prints one line and tags the
    # MLflow run stapoctl.alarm.<name>=<step>; then warn: go on; checkpoint: save one now; stop: save
    # one and end the run KILLED, the alarm named
    alarms: bool = True
    alarm_action: str = spec("warn", choices=("warn", "checkpoint", "stop"))
    alarm_limits: AlarmLimits = field(default_factory=AlarmLimits)


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
