"""The generated toy task the embedded model warm-starts on and RL trains on.

"Compute a + b * c." answered step by step ("b*c=P. a+P=S.") then either `\\boxed{S}` or,
for a configured fraction of warm-start demos, a plain "answer S". The unboxed demos are
the designed RL headroom: the base model gets the arithmetic right far more often than it
boxes the result, and the rule reward only credits a boxed answer, so RL has a real
(learnable, measurable) gap to close in minutes on a CPU.

Measured with the defaults (459k-param model, 500 warm-start steps): the held-out
arithmetic is right 81% of the time at T=1.0 (greedy 89%) but only 38% of answers are
boxed, so the reward's accuracy is 31% at T=1.0 and 0% greedy (greedy takes the majority
"answer" ending). A plain on-policy GRPO loop (lr 1e-4, 8x8 samples) lifted it to 71%
in 50 steps.

Problems are drawn without replacement from the whole (a, b, c) space with `toy.seed`:
the held-out split (`toy`, the toy benchmark) is disjoint from the training pool (`toy-train`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Iterable

from stapoctl.errors import UserError

BOXED_END = "\\boxed{{{}}}"
UNBOXED_END = "answer {}"
_UNBOXED_TAIL = re.compile(r"answer (-?\d+)\s*$")


@dataclass(frozen=True)
class ToyProblem:
    a: int
    b: int
    c: int

    @property
    def id(self) -> str:
        return f"toy-{self.a}+{self.b}*{self.c}"

    @property
    def product(self) -> int:
        return self.b * self.c

    @property
    def answer(self) -> int:
        return self.a + self.b * self.c

    @property
    def problem(self) -> str:
        return f"Compute {self.a} + {self.b} * {self.c}."

    def solution(self, boxed: bool = True) -> str:
        """The worked answer the warm start imitates (what a correct rollout looks like)."""
        p, s = self.product, self.answer
        end = (BOXED_END if boxed else UNBOXED_END).format(s)
        return f"{self.b}*{self.c}={p}. {self.a}+{p}={s}. {end}"


def _space(toy_cfg) -> list[ToyProblem]:
    lo = toy_cfg.operand_min
    if not 0 <= lo <= min(toy_cfg.addend_max, toy_cfg.factor_max):
        raise UserError(
            f"data.toy.operand_min={lo} must be >= 0 and <= addend_max ({toy_cfg.addend_max}) "
            f"and factor_max ({toy_cfg.factor_max})"
        )
    return [
        ToyProblem(a, b, c)
        for a in range(lo, toy_cfg.addend_max + 1)
        for b in range(lo, toy_cfg.factor_max + 1)
        for c in range(lo, toy_cfg.factor_max + 1)
    ]


def split_problems(toy_cfg) -> tuple[list[ToyProblem], list[ToyProblem]]:
    """(train pool, held-out): one seeded shuffle of the whole space, cut in two."""
    space = _space(toy_cfg)
    if toy_cfg.num_heldout >= len(space):
        raise UserError(
            f"data.toy.num_heldout={toy_cfg.num_heldout} leaves no training problems "
            f"(the space has {len(space)}): lower it or widen data.toy.addend_max"
        )
    random.Random(toy_cfg.seed).shuffle(space)
    heldout = space[: toy_cfg.num_heldout]
    pool = space[toy_cfg.num_heldout :]
    return pool[: toy_cfg.num_train], heldout


def problems(toy_cfg, split: str) -> list[ToyProblem]:
    """`train` (the RL prompts, also the warm-start pool) or `heldout` (the toy benchmark)."""
    train, heldout = split_problems(toy_cfg)
    if split == "train":
        return train
    if split == "heldout":
        return heldout
    raise UserError(f"toy split '{split}': use train or heldout")


def demos(pool: list[ToyProblem], count: int, unboxed_fraction: float, seed: int) -> Iterable[tuple[ToyProblem, str]]:
    """Warm-start (problem, worked answer) pairs, a seeded fraction of them unboxed."""
    rng = random.Random(seed)
    for _ in range(count):
        prob = pool[rng.randrange(len(pool))]
        yield prob, prob.solution(boxed=rng.random() >= unboxed_fraction)


def rebox(response: str) -> str:
    """The response with a trailing toy-format "answer S" turned into `\\boxed{S}`.

    Scoring the reboxed text with the ordinary reward gives the arithmetic-only accuracy:
    the ceiling RL can reach by learning to box.
    """
    return _UNBOXED_TAIL.sub(lambda m: BOXED_END.format(m.group(1)), response)


def tokenizer_corpus(toy_cfg, instruction: str, count: int = 4000, seed: int = 0) -> list[str]:
    """Text the embedded BPE tokenizer is trained on: problems, both answer endings, the
    instruction, the chat roles. Depends only on the number ranges, not on the splits."""
    rng = random.Random(seed)
    space = _space(toy_cfg)
    texts = ["user\n", "assistant\n", "system\n"] * 50
    for _ in range(count):
        prob = space[rng.randrange(len(space))]
        texts.append(prob.problem + "\n" + instruction)
        texts.append(prob.solution(boxed=True))
        texts.append(prob.solution(boxed=False))
    return texts


def rows(toy_cfg, split: str) -> list[dict]:
    """Source rows (before templating) in the normalized schema."""
    return [
        {"id": p.id, "problem": p.problem, "answer": str(p.answer), "a": p.a, "b": p.b, "c": p.c}
        for p in problems(toy_cfg, split)
    ]
