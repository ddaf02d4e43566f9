"""The `model` and `data` groups: which policy a run trains (the embedded tiny Qwen3 or a hub /
local model) and on which prompts (the generated toy task or a math dataset)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from stapoctl.config.fields import spec
from stapoctl.config.ranges import POSITIVE_INT

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
