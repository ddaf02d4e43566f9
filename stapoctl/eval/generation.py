"""The engines of `stapoctl eval`: Ray, the vLLM rollout actors and the verifier pool, started
for the jobs that have problems left and stopped when they are done (or fail)."""

from __future__ import annotations

import time
from typing import Any, Sequence

from stapoctl.eval.runner import judge_problems


def start_workers(conf: Any, model_path: str, max_model_len: int) -> list[Any]:
    """RolloutWorker actors serving the model (rollout.num_workers, tensor-parallel as configured)."""
    import ray

    from stapoctl.config.engines import rollout_eager, rollout_utilization
    from stapoctl.rollout.vllm_engine import EngineSpec
    from stapoctl.rollout.vllm_worker import make_rollout_worker

    r = conf.rollout
    tp = int(r.tensor_parallel_size)
    spec_args = dict(model_path=model_path, seed=int(conf.eval.seed), max_model_len=max_model_len,
                     dtype=str(conf.model.dtype), tensor_parallel_size=tp,
                     gpu_memory_utilization=rollout_utilization(r, colocated=False), kv_cache_gb=float(r.kv_cache_gb),
                     enforce_eager=rollout_eager(r, on_gpu=float(r.gpus_per_worker) > 0))
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


def generate_remaining(conf: Any, jobs: list[dict], model_path: str, max_response: int, console: Any) -> float:
    """Start Ray, the actors and the verifier pool; run every job's remaining problems."""
    import ray
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from stapoctl.launch.ray_runtime import ensure_ray, shutdown_ray
    from stapoctl.rollout.model_verifier import reward_pool
    from stapoctl.launch import engine_log

    t0 = time.perf_counter()
    started_ray = not ray.is_initialized()
    ensure_ray(conf.cluster)
    t_ray = time.perf_counter() - t0
    workers: list = []
    scorer = None
    try:
        max_model_len = max(job["max_model_len"] for job in jobs if job["todo"])
        with console.status(f"starting {int(conf.rollout.num_workers)} vLLM worker(s) for {escape(str(model_path))}"):
            workers = start_workers(conf, model_path, max_model_len)
            engine_log.record_actors("eval", t0, workers, t_ray=t_ray)  # tests only: the start-up table
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
