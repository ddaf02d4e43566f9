"""What a sweep's trials came to, however they ran (one after another on warm engines, K at once
as processes here, as Ray jobs or a SLURM array): where an unfinished trial continues from, the
run an attempt wrote to, a failure's record, and the parent's final status with the closing table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stapoctl.sweep import store
from stapoctl.sweep.definition import SweepDefinition
from stapoctl.sweep.plan import Trial


@dataclass
class Outcome:
    """One trial as this invocation saw it (for the closing table)."""

    trial: Trial
    status: str
    run_id: str = ""
    val: Optional[float] = None
    wall_s: Optional[float] = None
    overhead_s: Optional[float] = None
    engines: str = ""  # started | reused | own (a parallel trial's) | (earlier invocation)

    def row(self) -> list[str]:
        def num(x: Optional[float]) -> str:
            return f"{x:.1f}" if x is not None else "-"

        return [str(self.trial.index + 1), self.trial.run_name, self.status, pct(self.val), num(self.wall_s),
                num(self.overhead_s), self.run_id, self.engines]


ALARM_STATUS = "KILLED (alarm)"  # stopped by a run-health alarm: done, its last validation its result


def alarm_outcome(trial: Trial, run, wall: Optional[float], engines: str = "") -> Outcome:
    """A trial a run-health alarm stopped (trainer.alarm_action=stop): a result, not a failure."""
    return Outcome(trial, ALARM_STATUS, run.info.run_id, final_val({"final": run.data.metrics}), wall,
                   engines=engines)


def alarm_line(head: str, out: Outcome, names: list[str]) -> str:
    return (f"[bold yellow]■[/] {escape(head)} stopped by the alarm {escape(', '.join(names))}: last val "
            f"{pct(out.val)}, counted as its result · run {out.run_id}")  # run names: text, never markup


def resume_point(record: store.TrialRecord) -> Optional[str]:
    """The checkpoint an unfinished trial continues from (None: it starts a new child run)."""
    from stapoctl.checkpoint import latest_step_dir, read_trainer_state

    run = record.run
    if run is None or record.finished or not run.data.tags.get("stapoctl.run_dir"):
        return None
    step_dir = latest_step_dir(Path(run.data.tags["stapoctl.run_dir"]))
    if step_dir is None:
        return None
    total = int(run.data.params.get("trainer.total_steps", "0"))
    return str(step_dir) if read_trainer_state(step_dir).get("step", 0) < total else None


def attempt_run(sweep_id: str, trial: Trial, records: dict, resume: Optional[str], uri: Optional[str],
                since: float) -> Optional[str]:
    """The run this attempt wrote to: the continued child when it resumed from a checkpoint,
    else the child it created (None when it failed before creating one)."""
    if resume:
        return records[trial.index].run.info.run_id
    child = store.newest_child(sweep_id, trial.index, uri, since)
    return child.info.run_id if child is not None else None


def record_failure(sweep_id: str, trial: Trial, records: dict, resume: Optional[str], uri: Optional[str],
                   since: float, experiment: str, error: str) -> str:
    """The failed attempt's run ends FAILED; one is made for it when it failed before creating one."""
    child_id = attempt_run(sweep_id, trial, records, resume, uri, since)
    if child_id is not None:
        store.end_child(child_id, uri, "FAILED", error)
    else:
        child_id = store.record_failed_trial(sweep_id, trial, experiment, uri, error)
    return child_id


def finish(definition: SweepDefinition, sweep_id: str, trials: list[Trial], outcomes: dict[int, Outcome],
           uri: Optional[str], console: Console) -> int:
    """The parent's final status and counts, and the closing table; the exit code."""
    from mlflow.entities import Metric

    records = store.trial_records(sweep_id, len(trials), uri)
    finished = sum(r.finished for r in records.values())
    failed = len(trials) - finished
    alarmed = sum(1 for r in records.values() if r.run is not None and store.alarm_stopped(r.run))
    now = int(time.time() * 1000)
    metrics = [Metric("sweep/trials_finished", finished, now, 0), Metric("sweep/trials_failed", failed, now, 0),
               Metric("sweep/trials_alarm_stopped", alarmed, now, 0)]
    reused = [o.overhead_s for o in outcomes.values() if o.engines == "reused" and o.overhead_s is not None]
    if reused:
        metrics.append(Metric("sweep/mean_trial_overhead_s", sum(reused) / len(reused), now, 0))
    store.client(uri).log_batch(sweep_id, metrics=metrics)
    store.end_parent(sweep_id, uri, "FINISHED" if failed == 0 else "FAILED",
                     None if failed == 0 else f"{failed} of {len(trials)} trials failed")
    table = Table(title=escape(f"sweep {definition.name} ({sweep_id})"))
    for col in ("trial", "run name", "status", "final val", "wall s", "overhead s", "run id", "engines"):
        table.add_column(col, justify="right" if col in ("trial", "final val", "wall s", "overhead s") else "left",
                         overflow="fold", min_width=8 if col == "run name" else None)
    for trial in trials:
        rec = records[trial.index]
        earlier = ALARM_STATUS if rec.run is not None and store.alarm_stopped(rec.run) else "FINISHED"
        out = outcomes.get(trial.index) or Outcome(
            trial, earlier if rec.finished else (rec.run.info.status if rec.run else "-"),
            rec.run.info.run_id if rec.run else "", engines="earlier run")
        table.add_row(*(escape(cell) for cell in out.row()))
    console.print(table)
    if reused:
        console.print(f"per-trial overhead with reused engines: mean {sum(reused) / len(reused):.1f} s "
                      "(trial wall time minus its steps and validations)")
    if failed:
        console.print(f"[bold red]{failed} of {len(trials)} trials did not finish[/]; rerun them with "
                      f"`stapoctl sweep {escape(definition.name)} resume={sweep_id[:8]}`")
        return 1
    if alarmed:
        console.print(f"[yellow]{alarmed} of {len(trials)} trials were stopped by a run-health alarm[/]: each counts "
                      "at its last validation (`stapoctl compare` marks them)")
    console.print(f"[bold green]sweep {escape(definition.name)} finished[/]: {len(trials)} trials under MLflow run "
                  f"{sweep_id}")
    return 0


def final_val(summary: dict) -> Optional[float]:
    final = summary.get("final", {})
    return next((v for k, v in sorted(final.items()) if k.startswith("val/") and "/avg_at_" in k), None)


def pct(value: Optional[float]) -> str:
    return f"{value:.1%}" if value is not None else "-"
