"""Where each dataset comes from and how its rows become {id, problem, answer, answer_kind, ...}.

One table of sources (hub id, split, local file names) and one normalizer that accepts the
schemas met in practice: the hub's DAPO-Math-17k (chat-message `prompt` in DAPO's
"Answer:" wrapper, `reward_model.ground_truth`), the local copies in ../shared/data
(`problem`, `answer`), and the benchmark hubs (`question`/`Problem`, `final_answer` lists).
A row that cannot be normalized raises `MalformedRow` with the reason; callers count it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from stapoctl.data.answer_kinds import answer_kind
from stapoctl.errors import UserError
from stapoctl.reward.lists import KINDS


@dataclass(frozen=True)
class Source:
    name: str
    hub_id: str
    hub_split: str
    hub_config: str | None = None
    dedupe: bool = False  # collapse repeated problems (DAPO-Math-17k repeats each ~100x on the hub)
    kind: str = "benchmark"  # benchmark | train | toy


# Hub ids: HuggingFaceH4's AIME-2024 and MATH-500 copies, MathArena's AIME-2025 (where the
# matharena repo moved its data), and math-ai's AMC23 / Minerva / OlympiadBench test sets
# (the ids used by common RLVR eval harnesses; not reachable from the machine this was
# written on, so checked against public loader code, not downloaded).
SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source("dapo-math-17k", "BytedTsinghua-SIA/DAPO-Math-17k", "train", dedupe=True, kind="train"),
        Source("aime24", "HuggingFaceH4/aime_2024", "train"),
        Source("aime25", "MathArena/aime_2025", "train"),
        Source("amc23", "math-ai/amc23", "test"),
        Source("math500", "HuggingFaceH4/MATH-500", "test"),
        Source("minerva", "math-ai/minervamath", "test"),
        Source("olympiadbench", "math-ai/olympiadbench", "test"),
        Source("toy", "", "", kind="toy"),
        Source("toy-train", "", "", kind="toy"),
    )
}
BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
ALIASES = {"dapo_math_17k": "dapo-math-17k", "dapo": "dapo-math-17k", "toy_train": "toy-train",
           "math-500": "math500", "minerva_math": "minerva"}

# DAPO's own prompt wrapper around each problem (hub rows carry it; we re-instruct with STAPO's).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


# Field our prep writes next to `prompt`; a row carrying it was prepped by us, so its prompt
# is re-rendered on load instead of being kept as the source's own wrapping.
PREPPED = "prompt_template"


class MalformedRow(ValueError):
    """A source row without a usable problem or answer (the message says which)."""


def canonical_name(name: str) -> str:
    """Registry name for what a user typed; UserError with the closest match otherwise."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in SOURCES:
        return key
    import difflib

    near = difflib.get_close_matches(key, list(SOURCES) + list(ALIASES), n=1, cutoff=0.5)
    hint = f"; did you mean '{ALIASES.get(near[0], near[0])}'?" if near else ""
    raise UserError(f"unknown dataset '{name}'{hint} (known: {', '.join(SOURCES)})")


def local_file(name: str, root: Path) -> Path | None:
    """`<root>/<name>.jsonl` (or .parquet), accepting dapo_math_17k for dapo-math-17k."""
    stems = dict.fromkeys([name, name.replace("-", "_")])
    for stem in stems:
        for ext in (".jsonl", ".parquet"):
            path = root / f"{stem}{ext}"
            if path.is_file():
                return path
    return None


def read_file(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, row) for jsonl (1-based lines; a bad line yields a MalformedRow) or parquet."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
        return
    if suffix not in (".jsonl", ".json"):
        raise UserError(f"--source {path}: unsupported file type '{suffix}'; use .jsonl or .parquet")
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as exc:
                yield i, MalformedRow(f"invalid JSON ({exc.msg} at column {exc.colno})")


def read_hub(source: Source, split: str | None = None) -> Iterator[tuple[int, Any]]:
    """(row number, row) from the Hugging Face hub via `datasets` (real download, cached by it)."""
    try:
        import datasets

        ds = datasets.load_dataset(source.hub_id, source.hub_config, split=split or source.hub_split)
    except Exception as exc:  # offline, gated, renamed: all are "cannot get it from the hub"
        raise UserError(
            f"dataset '{source.name}': cannot load {source.hub_id} from the hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}); "
            f"pass --source FILE or set data.root / STAPOCTL_DATA to a folder with {source.name}.jsonl"
        ) from exc
    for i, row in enumerate(ds, start=1):
        yield i, row


def _text(value: Any) -> str | None:
    if isinstance(value, list) and value and isinstance(value[0], dict) and "content" in value[0]:
        value = next((m.get("content") for m in value if m.get("role", "user") == "user"), None)
    return value if isinstance(value, str) else None


def strip_dapo_wrapper(text: str) -> str:
    """The bare problem out of DAPO's "Answer:" prompt wrapper (unchanged if not wrapped)."""
    if text.startswith(DAPO_PREFIX):
        text = text[len(DAPO_PREFIX) :]
    if text.endswith(DAPO_SUFFIX):
        text = text[: -len(DAPO_SUFFIX)]
    return text.strip()


def _answer(raw: dict) -> Any:
    for key in ("answer", "Answer", "final_answer", "ground_truth"):
        if raw.get(key) is not None:
            return raw[key]
    reward_model = raw.get("reward_model")
    if isinstance(reward_model, dict):
        return reward_model.get("ground_truth")
    return None


def answer_text(value: Any) -> str:
    """A reference answer as a string: 27.0 → "27", ["$5$"] → "5"; MalformedRow if none."""
    if isinstance(value, list):
        value = value[0] if len(value) == 1 else ", ".join(str(v) for v in value) if value else None
        if isinstance(value, str):
            value = value.replace("$", "")
    if isinstance(value, bool) or value is None:
        raise MalformedRow("missing answer")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MalformedRow(f"answer is {value}")
        value = str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        value = str(value)
    if not isinstance(value, str):
        raise MalformedRow(f"answer is a {type(value).__name__}, not a string or number")
    value = value.strip()
    if not value:
        raise MalformedRow("missing answer")
    return value


def normalize(source: Source, raw: Any, index: int) -> dict:
    """{id, problem, answer, <source fields>}; MalformedRow when problem or answer is unusable."""
    if isinstance(raw, MalformedRow):
        raise raw
    if not isinstance(raw, dict):
        raise MalformedRow(f"row is a {type(raw).__name__}, not an object")
    if "problem" in raw:
        problem = raw["problem"]
    elif "question" in raw or "Problem" in raw:
        problem = raw.get("question", raw.get("Problem"))
    else:
        problem = _text(raw.get("prompt"))
        problem = strip_dapo_wrapper(problem) if problem is not None else None
    if not isinstance(problem, str):
        raise MalformedRow(
            "missing problem" if problem is None else f"problem is a {type(problem).__name__}, not a string"
        )
    if not problem.strip():
        raise MalformedRow("empty problem")
    answer = answer_text(_answer(raw))
    extra = {k: v for k, v in raw.items() if k not in ("id", "problem", "answer", "prompt", PREPPED)}
    if "prompt" in raw and PREPPED not in raw and "source_prompt" not in raw:
        extra["source_prompt"] = raw["prompt"]  # the source's own wrapping (e.g. DAPO's "Answer:")
    row_id = str(raw.get("id") or raw.get("unique_id") or _hub_index(raw) or f"{source.name}-{index}")
    extra["answer_kind"] = _answer_kind(raw, row_id, problem, answer)
    return {"id": row_id, "problem": problem.strip(), "answer": answer, **extra}


def _answer_kind(raw: dict, row_id: str, problem: str, answer: str) -> str:
    """A row's own `answer_kind` (a prepped file's, or the user's), else the project's decision."""
    given = raw.get("answer_kind")
    if given is None:
        return answer_kind(row_id, problem, answer)
    if given not in KINDS:
        raise MalformedRow(f"answer_kind {given!r} is not one of {', '.join(KINDS)} (fix it, or drop the field)")
    return given


def _hub_index(raw: dict) -> str | None:
    info = raw.get("extra_info")
    if isinstance(info, dict) and info.get("index") is not None:
        return f"dapo-{info['index']}"
    return None


_SPACE = re.compile(r"\s+")


def dedupe_key(problem: str) -> str:
    """Problems equal up to whitespace are one prompt (DAPO-Math-17k has double-space twins)."""
    return _SPACE.sub(" ", problem).strip()
