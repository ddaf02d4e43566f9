"""The run's record in MLflow and its summary: the record opened with the run's tags, params and
environment, the engines' facts as tags, the replay check of a resumed run, the end of an
already complete run's record, and the summary printed when the run is done.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig
from rich.console import Console

from stapoctl import paths
from stapoctl.errors import UserError


def open_record(conf: DictConfig, uri: str, state: dict, run_dir: Optional[Path], console: Console):
    """The run's MLflow record (`tracked_run`): a new run with its tags, or the resumed run's own."""
    from stapoctl.trainer.run_status import tracked_run

    tags = {"stapoctl.kind": "train", "stapoctl.experiment": str(conf.experiment), "stapoctl.loss": str(conf.loss.name),
            **{str(k): str(v) for k, v in (conf.tracking.get("tags") or {}).items()}}
    run_name = conf.tracking.run_name or f"{conf.experiment}-{conf.loss.name}-seed{conf.trainer.seed}"
    output_dir = conf.trainer.output_dir
    return tracked_run(uri=uri, experiment=conf.tracking.experiment, run_name=run_name, console=console,
                       run_id=state.get("mlflow_run_id"), tags=None if state else tags,
                       parent_run_id=None if state else conf.tracking.parent_run_id,
                       run_dir_for=lambda rid: run_dir or Path(output_dir or paths.home() / "runs" / rid),
                       flush_timeout_s=float(conf.tracking.get("flush_timeout_s", 120.0)))


def record_start(conf: DictConfig, record, state: dict, resume_dir: Optional[Path], base_model: str) -> dict:
    """What a run records before its engines are up: its dir, and its config, environment and
    base model's accuracy (a new run) or the checkpoint it resumed from; returns the base model's
    recorded eval (empty for a model stapoctl did not build)."""
    from stapoctl.models.tiny import base_eval
    from stapoctl.tracking import mlflow_run

    rec = record.buffer
    rec.set_tags({"stapoctl.run_dir": str(record.run_dir)})
    base = base_eval(base_model)
    if state:
        rec.set_tags({"stapoctl.resumed_from": str(resume_dir)})
    else:
        mlflow_run.log_config(conf)
        rec.set_tags({**mlflow_run.env_snapshot(), "stapoctl.base_model": base_model})
        if base:
            mlflow_run.log_metrics({"base/toy/accuracy_t1": base.get("accuracy_t1"),
                                    "base/toy/accuracy_greedy": base.get("accuracy_greedy")}, step=0)
    return base


def tag_engines(rec, conf: DictConfig, engines) -> None:
    """How the engines run (weight sync, old-log-prob source, threads, nodes, MKL, shared prefix)."""
    from stapoctl.trainer.engine_settings import learner_shared_prefix, old_logprob_source

    rec.set_tags({"stapoctl.weight_sync": engines.info["sync_method"],
                  "stapoctl.old_logprob_source": old_logprob_source(conf),
                  "stapoctl.threads": json.dumps(engines.info.get("threads", {})),
                  "stapoctl.nodes": json.dumps(engines.info.get("nodes", {})),
                  "stapoctl.learner_mkl": json.dumps(engines.info.get("mkl", {})),
                  "stapoctl.learner_shared_prefix": learner_shared_prefix(conf)})


def finish_summary(summary: dict, run_id: str, run_dir: Path, uri: str, base: dict, rec,
                   console: Console) -> dict:
    """The loop's summary completed with the run's identity, printed, and returned to the caller."""
    summary.update(run_id=run_id, run_dir=str(run_dir), tracking_uri=uri)
    if base:
        summary["base_accuracy_t1"] = base.get("accuracy_t1")
    summary["max_log_s"] = rec.max_log_s
    _print_summary(summary, console)
    return summary


@dataclass
class ReplayCheck:
    """Steps a resumed run recomputes because its checkpoint is older than its last logged step.

    Their metrics were logged before the interruption and stay as first logged (each key once
    per step: the journal drops the repeat). The recomputation must draw the same batch, which
    `batch/fingerprint` (prompts and sampled tokens) checks against the logged value.
    """

    steps: list = field(default_factory=list)
    mismatched: list = field(default_factory=list)

    def check(self, step: int, metrics: dict) -> None:
        from stapoctl.tracking.metric_buffer import active

        buffer = active()
        logged = buffer.logged_value("batch/fingerprint", step) if buffer is not None else None
        if logged is None:
            return
        self.steps.append(step)
        if float(logged) != float(metrics.get("batch/fingerprint", float("nan"))):
            self.mismatched.append(step)

    def summary(self) -> dict:
        return {"steps": list(self.steps), "mismatched": list(self.mismatched)}

    def report(self, console: Console) -> None:
        if not self.steps:
            return
        span = f"{self.steps[0]}-{self.steps[-1]}" if len(self.steps) > 1 else str(self.steps[0])
        same = ("the same batches (fingerprints match)" if not self.mismatched else
                f"[yellow]different batches at steps {self.mismatched}[/] (non-deterministic sampling)")
        console.print(f"steps {span} had been trained before the interruption and were recomputed from the "
                      f"checkpoint: {same}; their metrics stay as first logged")
        set_tags({"stapoctl.replayed_steps": span,
                   **({"stapoctl.replay_mismatch": ",".join(map(str, self.mismatched))} if self.mismatched else {})})


def set_tags(tags: dict) -> None:
    """Through the run's journal when one is active (never blocks a step), else MLflow directly."""
    from stapoctl.tracking.metric_buffer import active

    buffer = active()
    if buffer is not None:
        buffer.set_tags(tags)
    else:
        import mlflow

        mlflow.set_tags(tags)


def nothing_to_do(conf: DictConfig, state: dict, uri: str, console: Console) -> dict:
    """Resuming a run whose checkpoint is already at (or past) trainer.total_steps trains nothing:
    say so; send what its journal still holds and end an interrupted record FINISHED."""
    from stapoctl.trainer.run_status import http_fail_fast

    step, total, run_id = int(state["step"]), int(conf.trainer.total_steps), state["mlflow_run_id"]
    if step > total:
        raise UserError(f"trainer.total_steps={total} is below the checkpoint's step {step} of run {run_id}: "
                        f"set trainer.total_steps above {step} to continue it")
    with http_fail_fast():
        _finish_record(Path(state["run_dir"]), run_id, uri, console)
    console.print(f"run already complete at step {step}/{total}; nothing to do — raise trainer.total_steps "
                  "to continue")
    return {"run_id": run_id, "run_dir": state["run_dir"], "tracking_uri": uri, "steps": total, "final": {},
            "nothing_to_do": True}


def _finish_record(run_dir: Path, run_id: str, uri: str, console: Console) -> None:
    from stapoctl.tracking.metric_buffer import MetricBuffer
    from stapoctl.tracking.store_init import client

    try:
        status = client(uri).get_run(run_id).info.status
    except Exception as exc:
        console.print(f"MLflow at {uri} not reachable ({' '.join(str(exc).split())[:120]}); "
                      "the run's record is left as it is", style="yellow", markup=False, highlight=False)
        return
    from stapoctl.trainer.run_status import run_dir_lock

    with run_dir_lock(run_dir):
        buffer = MetricBuffer(run_dir, run_id, uri)
        if status == "RUNNING":  # its driver was killed after the last checkpoint
            buffer.end("FINISHED")
        buffer.close(timeout_s=60)


def _print_summary(summary: dict, console: Console) -> None:
    final = summary.get("final", {})
    val = next((v for k, v in final.items() if k.startswith("val/") and "/avg_at_" in k), None)
    first = next((v for k, v in summary.get("first_val", {}).items() if k.startswith("val/") and "/avg_at_" in k), None)
    parts = [f"run {summary.get('run_id')}", f"{summary.get('steps')} steps"]
    if summary.get("base_accuracy_t1") is not None:
        parts.append(f"base model toy acc (T=1.0) {summary['base_accuracy_t1']:.1%}")
    if first is not None:
        parts.append(f"step 0 val {first:.1%}")
    if val is not None:
        parts.append(f"final val {val:.1%}")
    console.print("[bold green]done[/] · " + " · ".join(parts))
    console.print(f"checkpoints: {summary.get('run_dir')}/checkpoints · resume with "
                  f"`stapoctl train resume={summary.get('run_id')}`", markup=False)
