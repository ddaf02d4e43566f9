"""Evaluation: sample k responses per problem with vLLM rollout actors, verify, aggregate.

Two layers, so training can validate with the actors it already has:
- `judge_problems` / `validation_metrics`: given running `RolloutWorker` handles and a
  `RewardPool`, generate and verify a list of problems and return per-sample records / metrics.
- `run_eval` (what `stapoctl eval` calls): resolve the model, start Ray and the actors, resume
  from the JSONL already written, report (console table, summary.json, MLflow run).

Prompts longer than the model's context cannot be answered: they are not sent to the engine,
are written as `skipped` records (k incorrect samples, length 0) and counted in `skipped`,
so every benchmark keeps its full problem count in the denominator (the conservative reading).
Responses that hit the token budget or the context end are `truncated`.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from stapoctl.data.benches import PAPER_BENCHES, Decoding, expand_benches, samples_per_problem, select_decodings
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


def prepare_problems(rows: Sequence[dict], tokenizer: Any, max_model_len: int) -> list[Problem]:
    """Tokenize the templated prompts (the template already holds any special tokens)."""
    out = []
    for row in rows:
        ids = list(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
        out.append(Problem(str(row["id"]), ids, str(row["answer"]), str(row.get("problem", row["prompt"])),
                           too_long=len(ids) >= max_model_len))
    return out


def _skipped_records(p: Problem, k: int, bench: str, decoding: str) -> list[dict]:
    return [
        {"bench": bench, "decoding": decoding, "id": p.id, "sample_index": j, "response": "",
         "extracted": None, "reference": p.answer, "correct": False, "length": 0,
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
                            [p.question for p, _, _ in flat])
    return [
        {"bench": bench, "decoding": decoding, "id": p.id, "sample_index": j, "response": s.text,
         "extracted": v.extracted, "reference": p.answer, "correct": bool(v.correct),
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


# ---------------------------------------------------------------------------------------------
# the CLI path


def _model_context(model_path: str) -> int | None:
    """max_position_embeddings of the model (None if the config does not say)."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_path)
    except Exception:
        return None
    cfg = getattr(cfg, "text_config", cfg)
    value = getattr(cfg, "max_position_embeddings", None)
    return int(value) if value else None


def _train_run_id(model_spec: str, conf: Any) -> str | None:
    """The full id of the training run --model names (full or short id), else None."""
    from stapoctl.tracking.run_ids import looks_like_run_id, resolve_run_id

    if not looks_like_run_id(model_spec) or Path(model_spec).expanduser().exists():
        return None
    return resolve_run_id(model_spec, conf.tracking.uri, what="model")


def start_workers(conf: Any, model_path: str, max_model_len: int) -> list[Any]:
    """RolloutWorker actors serving the model (rollout.num_workers, tensor-parallel as configured)."""
    import ray

    from stapoctl.rollout.vllm_engine import EngineSpec
    from stapoctl.rollout.vllm_worker import make_rollout_worker

    r = conf.rollout
    tp = int(r.tensor_parallel_size)
    spec_args = dict(model_path=model_path, seed=int(conf.eval.seed), max_model_len=max_model_len,
                     dtype=str(conf.model.dtype), tensor_parallel_size=tp,
                     gpu_memory_utilization=float(r.gpu_memory_utilization), kv_cache_gb=float(r.kv_cache_gb),
                     enforce_eager=bool(r.enforce_eager))
    gpus = float(r.gpus_per_worker) if float(r.gpus_per_worker) > 0 else 0.0
    workers = [make_rollout_worker(EngineSpec(**spec_args), num_cpus=float(r.cpus_per_worker),
                                   num_gpus=max(gpus, float(tp)) if gpus else 0.0)
               for _ in range(int(r.num_workers))]
    try:
        ray.get([w.info.remote() for w in workers])  # fail here, not mid-eval, if the engine cannot load
    except Exception as exc:
        from stapoctl.launch.actor_errors import user_error_in

        stop_workers(workers)
        found = user_error_in(exc)  # e.g. rollout.kv_cache_gb too small: one line, not Ray's traceback
        if found is not None:
            raise found from None
        raise
    return workers


def stop_workers(workers: Sequence[Any]) -> None:
    import ray

    for w in workers:
        try:
            ray.get(w.shutdown.remote(), timeout=120)
        except Exception:
            pass
        ray.kill(w)


def run_eval(conf: Any, benches: Sequence[str], model: str | None = None, k: int | None = None,
             decoding: str = "both", limit: int | None = None, console: Any = None) -> dict[str, Any]:
    """`stapoctl eval`: every (benchmark, decoding) → JSONL of verdicts, table, summary.json, MLflow.

    Returns the summary (also written to `<output_dir>/summary.json`).
    """
    from rich.console import Console

    from stapoctl import paths
    from stapoctl.data.registry import load_rows
    from stapoctl.data.templates import load_tokenizer
    from stapoctl.errors import UserError
    from stapoctl.eval.store import SampleStore, model_slug, settings_key
    from stapoctl.models.resolve import resolve_model

    console = console or Console()
    bench_names = expand_benches(benches or list(conf.eval.benches))
    decodings = select_decodings(decoding or conf.eval.decoding)
    k = k if k is not None else conf.eval.k
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: give a positive number of problems (or leave it out)")
    max_response = int(conf.eval.max_response_length)
    if max_response < 1:
        raise UserError(f"eval.max_response_length={max_response}: must be >= 1 (e.g. eval.max_response_length=20480)")
    model_spec = model if model is not None else str(conf.model.path or "")
    from stapoctl.preflight.commands import validate_eval

    validate_eval(conf, model_spec, bench_names, k=k)  # before the output dir, the tiny model build or Ray
    t_start = time.perf_counter()
    model_path = resolve_model(model_spec, conf)
    out_dir = Path(conf.eval.output_dir).expanduser() if conf.eval.output_dir else paths.home() / "eval" / model_slug(model_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(model_path)
    context = _model_context(model_path)

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

    # the MLflow run is open while the engines work, so its duration is the evaluation's
    with _eval_run(conf, model_spec, model_path) as run:
        engine_s = 0.0
        if any(job["todo"] for job in jobs):
            engine_s = _generate(conf, jobs, model_path, max_response, console)
        summary = _summarize(jobs, conf, model_spec, model_path, out_dir, limit, time.perf_counter() - t_start,
                             engine_s)
        from stapoctl.eval.report import print_report

        print_report(summary, console)
        _log_mlflow(conf, summary, jobs)
        summary["mlflow_run_id"] = run.info.run_id
    console.print(f"MLflow run {summary['mlflow_run_id']} (experiment '{conf.tracking.experiment}'); "
                  f"generations in {out_dir}", highlight=False)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _generate(conf: Any, jobs: list[dict], model_path: str, max_response: int, console: Any) -> float:
    """Start Ray, the actors and the verifier pool; run every job's remaining problems."""
    import ray
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from stapoctl.launch.ray_runtime import ensure_ray, shutdown_ray
    from stapoctl.rollout.model_verifier import reward_pool

    t0 = time.perf_counter()
    started_ray = not ray.is_initialized()
    ensure_ray(conf.cluster)
    workers: list = []
    scorer = None
    try:
        max_model_len = max(job["max_model_len"] for job in jobs if job["todo"])
        with console.status(f"starting {int(conf.rollout.num_workers)} vLLM worker(s) for {model_path}"):
            workers = start_workers(conf, model_path, max_model_len)
            scorer = reward_pool(conf.reward)
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
        with progress:
            tasks = {id(job): progress.add_task(f"{job['bench']}/{job['decoding'].name} (k={job['k']})",
                                                total=len(job["problems"]), completed=job["reused"], info="")
                     for job in jobs}
            for job in jobs:
                if not job["todo"]:
                    continue
                task = tasks[id(job)]

                def on_chunk(records: list[dict], n: int, job=job, task=task) -> None:
                    job["store"].append(records)
                    job["generated"] += n
                    acc = sum(r["correct"] for r in records) / max(len(records), 1)
                    progress.update(task, advance=n, info=f"chunk acc {acc:.1%}")

                judge_problems(workers, scorer, job["todo"], bench=job["bench"], decoding=job["decoding"],
                               k=job["k"], max_tokens=max_response, seed=int(conf.eval.seed), on_chunk=on_chunk)
    finally:
        if scorer is not None:
            scorer.close()
        stop_workers(workers)
        if started_ray:
            shutdown_ray()
    return time.perf_counter() - t0


def _summarize(jobs, conf, model_spec, model_path, out_dir, limit, wall_s, engine_s) -> dict[str, Any]:
    results = []
    for job in jobs:
        ids = [p.id for p in job["problems"]]
        stats = summarize(job["store"].for_ids(ids), job["k"])
        results.append({"bench": job["bench"], "decoding": job["decoding"].name, "k": job["k"],
                        "temperature": job["decoding"].temperature, "top_p": job["decoding"].top_p,
                        "generated_problems": job["generated"], "reused_problems": job["reused"],
                        "jsonl": str(job["store"].path), **stats})
    averages = {}
    for dec in dict.fromkeys(r["decoding"] for r in results):
        paper = [r for r in results if r["decoding"] == dec and r["bench"] in PAPER_BENCHES]
        if paper:
            averages[dec] = {"benches": len(paper),
                             "avg": sum(r[f"avg@{r['k']}"] for r in paper) / len(paper)}
    return {"model": model_spec or "(embedded tiny)", "model_name": _display_name(model_spec, model_path),
            "model_path": model_path, "output_dir": str(out_dir),
            "limit": limit, "max_response_length": int(conf.eval.max_response_length),
            "wall_s": round(wall_s, 1), "engine_s": round(engine_s, 1), "results": results, "averages": averages}


def _display_name(model_spec: str, model_path: str) -> str:
    """Short row label: tiny-<hash>, run <id>/step_N, or the hub id."""
    path = Path(model_path)
    if path.name == "model" and path.parent.name.startswith("step_"):
        return f"{path.parent.parent.parent.name[:8]}/{path.parent.name}"
    return path.name if path.exists() else model_path


@contextlib.contextmanager
def _eval_run(conf, model_spec: str, model_path: str):
    """A new run (kind=eval), nested under the training run when --model was its run id."""
    from stapoctl.tracking import mlflow_run

    train_run = _train_run_id(model_spec, conf)
    tags = {"stapoctl.kind": "eval", "stapoctl.model": model_spec or "(embedded tiny)",
            "stapoctl.model_path": model_path}
    if train_run:
        tags["stapoctl.train_run_id"] = train_run
    with mlflow_run.start_run(uri=conf.tracking.uri, experiment=conf.tracking.experiment,
                              run_name=f"eval-{Path(model_path).name}", parent_run_id=train_run, tags=tags) as run:
        yield run


def _log_mlflow(conf, summary: dict, jobs: list[dict]) -> None:
    """Params, metrics and artifacts of the finished evaluation into the open eval run."""
    import mlflow

    from stapoctl.tracking import mlflow_run

    benches = sorted({r["bench"] for r in summary["results"]})
    mlflow.log_params({"benches": ",".join(benches), "limit": str(summary["limit"]),
                       "max_response_length": summary["max_response_length"],
                       "model_path": summary["model_path"], "seed": int(conf.eval.seed)})
    metrics: dict[str, float] = {}
    for r in summary["results"]:
        base = f"eval/{r['bench']}/{r['decoding']}"
        for key in (f"avg@{r['k']}", f"avg@{r['k']}_ci95", f"pass@{r['k']}", "pass@1", f"maj@{r['k']}",
                    "response_length", "truncation_rate", "no_answer_rate", "skipped", "problems",
                    "verify_timeouts"):
            metrics[f"{base}/{mlflow_key(key)}"] = r[key]
    for dec, avg in summary["averages"].items():
        metrics[f"eval/avg{avg['benches']}/{dec}/acc"] = avg["avg"]
    metrics["timing_s/eval"] = summary["wall_s"]
    mlflow_run.log_metrics(metrics, step=0)
    if conf.tracking.log_artifacts:
        for job in jobs:
            if job["store"].path.exists():
                mlflow.log_artifact(str(job["store"].path), artifact_path="generations")
        mlflow.log_text(json.dumps(summary, indent=2), "summary.json")
