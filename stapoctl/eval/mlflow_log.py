"""The MLflow run of an eval (kind=eval) and what goes into it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from stapoctl.eval.metrics import mlflow_key


def _train_run_id(model_spec: str, conf: Any) -> str | None:
    """The full id of the training run --model names (full or short id), else None."""
    from stapoctl.tracking.run_ids import looks_like_run_id, resolve_run_id

    if not looks_like_run_id(model_spec) or Path(model_spec).expanduser().exists():
        return None
    return resolve_run_id(model_spec, conf.tracking.uri, what="model")


@contextlib.contextmanager
def eval_run(conf, model_spec: str, model_path: str):
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


def log_mlflow(conf, summary: dict, jobs: list[dict], protocol: dict | None = None) -> None:
    """Params, metrics and artifacts of the finished evaluation into the open eval run, and its
    protocol (`eval/protocol.py`: artifact and tag, whatever tracking.log_artifacts says: compare
    needs it)."""
    import mlflow

    from stapoctl.eval import protocol as protocols
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
    if protocol is not None:
        protocols.record(protocol, mlflow.log_text, mlflow.set_tags)
    if conf.tracking.log_artifacts:
        for job in jobs:
            if job["store"].path.exists():
                mlflow.log_artifact(str(job["store"].path), artifact_path="generations")
        mlflow.log_text(json.dumps(summary, indent=2), "summary.json")


def eval_protocol(conf, jobs: list[dict], decodings) -> dict:
    """The protocol of an eval's jobs: each benchmark's problems (after --limit) and k."""
    from stapoctl.eval import protocol

    benches = {job["bench"]: (job["problems"], job["k"]) for job in jobs}
    return protocol.build(conf, benches, decodings)
