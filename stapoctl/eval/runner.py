"""Evaluation: sample k responses per problem with vLLM rollout actors, verify, aggregate.

Two layers, so training can validate with the actors it already has:
- `judge_problems` / `validation_metrics` (here): given running `RolloutWorker` handles and a
  `RewardPool`, generate and verify a list of problems and return per-sample records / metrics.
- `run_eval` (`eval/command.py`, what `stapoctl eval` calls): resolve the model, start Ray and
  the actors, resume from the JSONL already written, report (console table, summary.json, MLflow run).

Prompts longer than the model's context cannot be answered: they are not sent to the engine,
are written as `skipped` records (k incorrect samples, length 0) and counted in `skipped`,
so every benchmark keeps its full problem count in the denominator (the conservative reading).
Responses that hit the token budget or the context end are `truncated`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from stapoctl.data.benches import Decoding
from stapoctl.eval.metrics import mlflow_key, summarize
from stapoctl.rollout.vllm_engine import prompt_seed

TARGET_SAMPLES_PER_CALL = 256  # per worker and generate call: big enough to batch, small enough to resume


@dataclass
class Problem:
    """One benchmark row ready for the engine."""

    id: str
    prompt_ids: list[int]
    answer: str
    question: str
    too_long: bool = False  # prompt does not fit the model's context: skipped, scored incorrect
    kind: str | None = None  # the answer kind data prep wrote (how a list gold compares); None: its form


def prepare_problems(rows: Sequence[dict], tokenizer: Any, max_model_len: int) -> list[Problem]:
    """Tokenize the templated prompts (the template already holds any special tokens)."""
    out = []
    for row in rows:
        ids = list(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
        out.append(Problem(str(row["id"]), ids, str(row["answer"]), str(row.get("problem", row["prompt"])),
                           too_long=len(ids) >= max_model_len, kind=row.get("answer_kind")))
    return out


def _skipped_records(p: Problem, k: int, bench: str, decoding: str) -> list[dict]:
    return [
        {"bench": bench, "decoding": decoding, "id": p.id, "sample_index": j, "response": "",
         "extracted": None, "reference": p.answer, "answer_kind": p.kind, "correct": False, "length": 0,
         "truncated": False, "finish_reason": "skipped", "skipped": True, "timed_out": False,
         "prompt_tokens": len(p.prompt_ids)}
        for j in range(k)
    ]


def judge_problems(
    workers: Sequence[Any],
    scorer: Any,
    problems: Sequence[Problem],
    *,
    bench: str,
    decoding: Decoding,
    k: int,
    max_tokens: int,
    seed: int = 0,
    on_chunk: Callable[[list[dict], int], None] | None = None,
) -> list[dict]:
    """Generate k samples per problem on the workers, verify them, return per-sample records.

    Work goes out in chunks (each split across the workers) and the next chunk is generating
    while the previous one is verified; `on_chunk(records, n_problems)` sees each finished chunk
    (whole problems only), which is what makes an interrupted eval resumable.
    """
    import ray

    per_chunk = max(1, (TARGET_SAMPLES_PER_CALL * max(1, len(workers))) // max(1, k))
    fits = [p for p in problems if not p.too_long]
    skipped = [p for p in problems if p.too_long]
    records: list[dict] = []
    if skipped:
        recs = [r for p in skipped for r in _skipped_records(p, k, bench, decoding.name)]
        records += recs
        if on_chunk:
            on_chunk(recs, len(skipped))
    chunks = [fits[i : i + per_chunk] for i in range(0, len(fits), per_chunk)]

    def submit(chunk: list[Problem]) -> list[tuple[list[Problem], Any]]:
        per = math.ceil(len(chunk) / len(workers))
        calls = []
        for j, worker in enumerate(workers):
            part = chunk[j * per : (j + 1) * per]
            if part:
                seeds = [prompt_seed(seed, bench, decoding.name, p.id) for p in part]
                ref = worker.generate.remote([p.prompt_ids for p in part], n=k, temperature=decoding.temperature,
                                             top_p=decoding.top_p, max_tokens=max_tokens, seed=seeds)
                calls.append((part, ref))
        return calls

    pending = submit(chunks[0]) if chunks else []
    for i in range(len(chunks)):
        current = pending
        pending = submit(chunks[i + 1]) if i + 1 < len(chunks) else []
        parts = [(part, ray.get(ref)) for part, ref in current]
        recs = _verify(scorer, parts, bench, decoding.name, k)
        records += recs
        if on_chunk:
            on_chunk(recs, len(chunks[i]))
    return records


def _verify(scorer: Any, parts: list[tuple[list[Problem], list]], bench: str, decoding: str, k: int) -> list[dict]:
    flat = [(p, j, s) for part, outs in parts for p, samples in zip(part, outs) for j, s in enumerate(samples)]
    for part, outs in parts:
        for p, samples in zip(part, outs):
            if len(samples) != k:
                raise RuntimeError(f"engine returned {len(samples)} samples for {p.id}, asked for {k}")
    verdicts = scorer.judge([s.text for _, _, s in flat], [p.answer for p, _, _ in flat],
                            [p.question for p, _, _ in flat], [p.kind for p, _, _ in flat])
    return [
        {"bench": bench, "decoding": decoding, "id": p.id, "sample_index": j, "response": s.text,
         "extracted": v.extracted, "reference": p.answer, "answer_kind": p.kind, "correct": bool(v.correct),
         "length": len(s.token_ids), "truncated": s.finish_reason == "length",
         "finish_reason": s.finish_reason, "skipped": False, "timed_out": bool(v.timed_out),
         "prompt_tokens": len(p.prompt_ids)}
        for (p, j, s), v in zip(flat, verdicts)
    ]


def validation_metrics(
    workers: Sequence[Any],
    scorer: Any,
    problems: Sequence[Problem],
    *,
    bench: str,
    decodings: Sequence[Decoding],
    k: int,
    max_tokens: int,
    seed: int = 0,
    prefix: str = "val",
) -> dict[str, float]:
    """Periodic validation inside training: `<prefix>/<bench>/<decoding>/avg_at_<k>` and friends."""
    out: dict[str, float] = {}
    for dec in decodings:
        stats = summarize(judge_problems(workers, scorer, problems, bench=bench, decoding=dec, k=k,
                                         max_tokens=max_tokens, seed=seed), k)
        for key in (f"avg@{k}", f"pass@{k}", f"maj@{k}", "response_length", "truncation_rate", "no_answer_rate"):
            out[f"{prefix}/{bench}/{dec.name}/{mlflow_key(key)}"] = stats[key]
    return out
