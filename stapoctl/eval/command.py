"""`stapoctl eval`: resolve the model, plan what the stores do not hold yet, generate it, report.

Every (benchmark, decoding) resumes from the JSONL already written; the report is a console
table, `<output_dir>/summary.json` and an MLflow run (kind=eval).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

from stapoctl.data.benches import expand_benches, select_decodings
from stapoctl.eval.generation import generate_remaining
from stapoctl.eval.mlflow_log import eval_protocol, eval_run, log_mlflow
from stapoctl.eval.plan import plan_jobs
from stapoctl.eval.store import model_slug
from stapoctl.eval.summary import summarize_jobs


def run_eval(conf: Any, benches: Sequence[str], model: str | None = None, k: int | None = None,
             decoding: str = "both", limit: int | None = None, console: Any = None) -> dict[str, Any]:
    """`stapoctl eval`: every (benchmark, decoding) → JSONL of verdicts, table, summary.json, MLflow.

    Returns the summary (also written to `<output_dir>/summary.json`).
    """
    from rich.console import Console

    from stapoctl.models.resolve import resolve_model

    console = console or Console()
    bench_names = expand_benches(benches or list(conf.eval.benches))
    decodings = select_decodings(decoding or conf.eval.decoding)
    k = k if k is not None else conf.eval.k
    max_response = _check_limits(conf, limit)
    model_spec = model if model is not None else str(conf.model.path or "")
    from stapoctl.preflight.commands import validate_eval

    validate_eval(conf, model_spec, bench_names, k=k)  # before the output dir, the tiny model build or Ray
    t_start = time.perf_counter()
    model_path = resolve_model(model_spec, conf)
    out_dir = _output_dir(conf, model_path)
    jobs = plan_jobs(conf, bench_names, decodings, k, limit, model_path, out_dir, max_response, console)

    # the MLflow run is open while the engines work, so its duration is the evaluation's
    with eval_run(conf, model_spec, model_path) as run:
        engine_s = 0.0
        if any(job["todo"] for job in jobs):
            engine_s = generate_remaining(conf, jobs, model_path, max_response, console)
        summary = summarize_jobs(jobs, conf, model_spec, model_path, out_dir, limit,
                                 time.perf_counter() - t_start, engine_s)
        from stapoctl.eval.report import print_report

        print_report(summary, console)
        log_mlflow(conf, summary, jobs, eval_protocol(conf, jobs, decodings))
        summary["mlflow_run_id"] = run.info.run_id
    console.print(f"MLflow run {summary['mlflow_run_id']} (experiment '{conf.tracking.experiment}'); "
                  f"generations in {out_dir}", highlight=False)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _check_limits(conf: Any, limit: int | None) -> int:
    """--limit and eval.max_response_length as one-line errors before anything starts; the latter."""
    from stapoctl.errors import UserError

    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: give a positive number of problems (or leave it out)")
    max_response = int(conf.eval.max_response_length)
    if max_response < 1:
        raise UserError(f"eval.max_response_length={max_response}: must be >= 1 (e.g. eval.max_response_length=20480)")
    return max_response


def _output_dir(conf: Any, model_path: str) -> Path:
    """eval.output_dir, else one directory per model under the stapoctl home (created)."""
    from stapoctl import paths

    out_dir = Path(conf.eval.output_dir).expanduser() if conf.eval.output_dir else paths.home() / "eval" / model_slug(model_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir
