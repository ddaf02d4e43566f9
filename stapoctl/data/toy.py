"""The generated toy task the embedded model warm-starts on and RL trains on.

"Compute a + b * c." answered in two worked steps, a product and a sum, then either
`\\boxed{S}` or a plain "answer S". The warm-start demos write the same answer several ways
(`Phrasing`), so the base model has what an LLM's chain of thought has: most tokens forced
(the digits, the layout) and a minority of forks where several continuations are valid:

| fork | canonical | variant | demo share of the variant (model.tiny.*) | band |
|---|---|---|---|---|
| product order | `8*7=56` | `7*8=56` | swapped_product_fraction 0.4 | high entropy |
| step separator (x2) | `.` | `;` | semicolon_fraction 0.3 each | high entropy |
| sum order | `27+56=83` | `56+27=83` | swapped_sum_fraction 0.35 | high entropy |
| ending | `\\boxed{83}` | `answer 83` | unboxed_fraction 0.7 | high entropy, rewarded |
| times sign | `*` | `x` | cross_fraction 0.05 | low entropy, pi ~ 5e-2 |
| equals sign (x2) | `=` | ` = ` | spaced_eq_fraction 0.015 each | low entropy, pi ~ 1e-2 |

About a quarter of the response tokens are the high-entropy forks, so h* (the 80th
percentile of token entropy, STAPO's default tau_h = 0.2) lies among them, and the sampled
minority of the low-entropy forks lands in distinct tau_p bands: `x` below 0.2 but above
2e-2, ` = ` below 2e-2 but above 2e-3, arithmetic slips mostly below 2e-3. A tau_p sweep
then silences different tokens (STAPO's mechanism has something to act on); only the
ending is rewarded, the other forks are reward-neutral phrasing, as most of an LLM's are.

The unboxed demos are the designed RL headroom: the base model gets the arithmetic right far
more often than it boxes the result, and the rule reward only credits a boxed answer, so
RL has a real (learnable, measurable) gap to close in minutes on a CPU. The build measures
both and the entropy profile (`base_eval.json`; docs/RESULTS.md "The testbed").

Problems are drawn without replacement from the whole (a, b, c) space with `toy.seed`:
the held-out split (`toy`, the toy benchmark) is disjoint from the training pool (`toy-train`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable

from stapoctl.errors import UserError

BOXED_END = "\\boxed{{{}}}"
UNBOXED_END = "answer {}"
_UNBOXED_TAIL = re.compile(r"answer (-?\d+)\s*$")

# model.tiny fields giving each fork's variant share in the warm-start demos
FORK_FIELDS = ("unboxed_fraction", "swapped_product_fraction", "swapped_sum_fraction",
               "semicolon_fraction", "cross_fraction", "spaced_eq_fraction")


@dataclass(frozen=True)
class Phrasing:
    """One way to write the worked answer; the default is the canonical one."""

    boxed: bool = True
    swap_product: bool = False  # c*b instead of b*c
    swap_sum: bool = False  # P+a instead of a+P
    semicolons: tuple[bool, bool] = (False, False)  # each step ends ";" instead of "."
    cross: bool = False  # "x" instead of "*"
    spaced_eq: tuple[bool, bool] = (False, False)  # " = " instead of "=" in each step


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
        """The canonical worked answer (what a correct rollout most often looks like)."""
        return self.write(Phrasing(boxed=boxed))

    def write(self, ph: Phrasing) -> str:
        """The worked answer in a given phrasing: every phrasing is correct and gets the same
        reward when boxed."""
        p, s = self.product, self.answer
        f1, f2 = (self.c, self.b) if ph.swap_product else (self.b, self.c)
        t1, t2 = (p, self.a) if ph.swap_sum else (self.a, p)
        eq1, eq2 = (" = " if sp else "=" for sp in ph.spaced_eq)
        sep1, sep2 = (";" if semi else "." for semi in ph.semicolons)
        times = "x" if ph.cross else "*"
        end = (BOXED_END if ph.boxed else UNBOXED_END).format(s)
        return f"{f1}{times}{f2}{eq1}{p}{sep1} {t1}+{t2}{eq2}{s}{sep2} {end}"


def draw_phrasing(rng: random.Random, mix) -> Phrasing:
    """A phrasing with each fork's variant drawn independently at its share in `mix`
    (an object with the FORK_FIELDS, e.g. model.tiny). The draw order is fixed."""
    return Phrasing(
        boxed=rng.random() >= mix.unboxed_fraction,
        swap_product=rng.random() < mix.swapped_product_fraction,
        swap_sum=rng.random() < mix.swapped_sum_fraction,
        semicolons=(rng.random() < mix.semicolon_fraction, rng.random() < mix.semicolon_fraction),
        cross=rng.random() < mix.cross_fraction,
        spaced_eq=(rng.random() < mix.spaced_eq_fraction, rng.random() < mix.spaced_eq_fraction),
    )


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


def demos(pool: list[ToyProblem], count: int, mix, seed: int) -> Iterable[tuple[ToyProblem, str]]:
    """Warm-start (problem, worked answer) pairs, phrased at the shares in `mix` (model.tiny)."""
    rng = random.Random(seed)
    for _ in range(count):
        prob = pool[rng.randrange(len(pool))]
        yield prob, prob.write(draw_phrasing(rng, mix))


def rebox(response: str) -> str:
    """The response with a trailing toy-format "answer S" turned into `\\boxed{S}`.

    Scoring the reboxed text with the ordinary reward gives the arithmetic-only accuracy:
    the ceiling RL can reach by learning to box.
    """
    return _UNBOXED_TAIL.sub(lambda m: BOXED_END.format(m.group(1)), response)


# Every variant at half share: the tokenizer sees each phrasing often, whatever the demo mix of
# a given build (the tokenizer depends on the number ranges only). Derived from FORK_FIELDS, so
# a new fork needs no second list.
_EVEN_MIX = SimpleNamespace(**{name: 0.5 for name in FORK_FIELDS})


def tokenizer_corpus(toy_cfg, instruction: str, count: int = 4000, seed: int = 0) -> list[str]:
    """Text the embedded BPE tokenizer is trained on: problems, worked answers in every
    phrasing, the instruction, the chat roles. Depends only on the number ranges."""
    rng = random.Random(seed)
    space = _space(toy_cfg)
    texts = ["user\n", "assistant\n", "system\n"] * 50
    for _ in range(count):
        prob = space[rng.randrange(len(space))]
        texts.append(prob.problem + "\n" + instruction)
        texts.append(prob.solution(boxed=True))
        texts.append(prob.write(draw_phrasing(rng, _EVEN_MIX)))
    return texts


def rows(toy_cfg, split: str) -> list[dict]:
    """Source rows (before templating) in the normalized schema."""
    return [
        {"id": p.id, "problem": p.problem, "answer": str(p.answer), "answer_kind": "scalar", "a": p.a, "b": p.b,
         "c": p.c}
        for p in problems(toy_cfg, split)
    ]
