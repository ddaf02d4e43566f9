"""The evaluation protocol of STAPO §5.1: which benchmarks, how many samples, which decodings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from stapoctl.data.sources import BENCHMARKS, canonical_name
from stapoctl.errors import UserError

PAPER_BENCHES: tuple[str, ...] = tuple(BENCHMARKS)  # aime24 aime25 amc23 math500 minerva olympiadbench
EVAL_BENCHES: tuple[str, ...] = PAPER_BENCHES + ("toy",)
# N samples per problem in the paper: 32 for the small contest sets, 4 for the large ones
PAPER_K = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4, "olympiadbench": 4}
TOY_K = 4
TITLES = {"aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23", "math500": "MATH500",
          "minerva": "Minerva", "olympiadbench": "Olympiad", "toy": "Toy"}


@dataclass(frozen=True)
class Decoding:
    name: str
    temperature: float
    top_p: float


# "train": the rollout's own sampling (T=1.0, top-p=1.0); "justrl": JustRL's eval setting
DECODINGS = {
    "train": Decoding("train", 1.0, 1.0),
    "justrl": Decoding("justrl", 0.7, 0.9),
}


def expand_benches(names: Sequence[str]) -> list[str]:
    """Benchmark names in protocol order; 'all' = the six paper benchmarks (not toy)."""
    if not names:
        raise UserError("--bench: give at least one of " + ", ".join(EVAL_BENCHES) + " or all")
    chosen: list[str] = []
    for raw in names:
        for part in str(raw).split(","):
            part = part.strip()
            if not part:
                continue
            if part.lower() == "all":
                chosen.extend(PAPER_BENCHES)
                continue
            try:
                name = canonical_name(part)
            except UserError as exc:  # a typo: name the option, keep the suggestion
                raise UserError(f"--bench {part}: {exc}") from None
            if name not in EVAL_BENCHES:
                raise UserError(
                    f"--bench {part}: '{name}' is a training set, not a benchmark; use one of "
                    + ", ".join(EVAL_BENCHES) + " or all"
                )
            chosen.append(name)
    order = {b: i for i, b in enumerate(EVAL_BENCHES)}
    return sorted(dict.fromkeys(chosen), key=order.__getitem__)


def select_decodings(choice: str) -> list[Decoding]:
    """'train', 'justrl' or 'both' (train first, as Table 2 prints T=1.0 then (T=0.7))."""
    key = (choice or "").strip().lower()
    if key == "both":
        return [DECODINGS["train"], DECODINGS["justrl"]]
    if key in DECODINGS:
        return [DECODINGS[key]]
    raise UserError(f"--decoding {choice!r}: use train (T=1.0, top-p=1.0), justrl (T=0.7, top-p=0.9) or both")


def samples_per_problem(bench: str, k: int | None) -> int:
    """--k / eval.k when given, else the paper's N for that benchmark (toy: 4)."""
    if k is not None:
        if int(k) < 1:
            raise UserError(f"--k {k}: samples per problem must be >= 1 (e.g. --k 4)")
        return int(k)
    return PAPER_K.get(bench, TOY_K)
