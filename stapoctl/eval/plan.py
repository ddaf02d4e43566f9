"""What each (benchmark, decoding) of an eval still needs, read from its JSONL store.

A job is a plain dict (bench, decoding, k, problems, todo, store, reused, generated,
max_model_len) that generation, the summary and the MLflow log then read and update.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from stapoctl.data.benches import Decoding, samples_per_problem
from stapoctl.eval.runner import prepare_problems
from stapoctl.eval.store import SampleStore, settings_key


def model_context(model_path: str) -> int | None:
    """max_position_embeddings of the model (None if the config does not say)."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_path)
    except Exception:
        return None
    cfg = getattr(cfg, "text_config", cfg)
    value = getattr(cfg, "max_position_embeddings", None)
    return int(value) if value else None


def plan_jobs(conf: Any, bench_names: Sequence[str], decodings: Sequence[Decoding], k: int, limit: int | None,
              model_path: str, out_dir: Path, max_response: int, console: Any) -> list[dict]:
    """One job per (bench, decoding): its problems, its store and the problems not yet in it."""
    from stapoctl.data.registry import load_rows
    from stapoctl.data.templates import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    context = model_context(model_path)

    # rows, prompts and the stores (what is already done) for every (bench, decoding)
    jobs = []
    for bench in bench_names:
        rows = load_rows(bench, conf.data, tokenizer_path=model_path, console=console)
        rows = rows[:limit] if limit else rows
        bench_k = samples_per_problem(bench, k)
        problems = prepare_problems(rows, tokenizer, context or 10**9)
        longest = max([len(p.prompt_ids) for p in problems if not p.too_long], default=1)
        # KV cache sized for what this eval needs, never past the model's own context
        max_model_len = min(context or longest + max_response, longest + max_response)
        for dec in decodings:
            settings = {"model": model_path, "bench": bench, "decoding": dec.name, "temperature": dec.temperature,
                        "top_p": dec.top_p, "k": bench_k, "max_response_length": max_response,
                        "seed": int(conf.eval.seed), "template": conf.data.template,
                        "instruction": conf.data.instruction, "context": context}
            path = out_dir / f"{bench}.{dec.name}.k{bench_k}.{settings_key(settings)}.jsonl"
            store = SampleStore(path, bench_k)
            done = store.done_ids()
            todo = [p for p in problems if p.id not in done]
            jobs.append(dict(bench=bench, decoding=dec, k=bench_k, problems=problems, todo=todo, store=store,
                             reused=len(problems) - len(todo), generated=0, max_model_len=max_model_len))
    return jobs
