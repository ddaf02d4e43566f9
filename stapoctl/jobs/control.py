"""`stapoctl jobs list|status|logs|stop`: the jobs `stapoctl submit` sent, on either backend.

Ids are looked up in the local records first (any of: the SLURM job id, an array task id
`12_1`, the Ray submission id, the record's local id). A Ray job submitted from elsewhere works
with `--address http://HOST:8265`; a SLURM job id this machine's SLURM knows works directly.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stapoctl.errors import UserError
from stapoctl.jobs import records

_SLURM_ID = re.compile(r"^\d+(_\d+)?$")


def resolve(job_id: str, address: Optional[str] = None) -> tuple[records.JobRecord, Optional[str]]:
    """(record, task) for an id; task is set when the id names one job of an array/trials record."""
    rec = records.find(job_id)
    if rec is not None:
        return rec, (job_id if job_id in rec.tasks else None)
    if address or (os.environ.get("RAY_API_SERVER_ADDRESS") and not _SLURM_ID.match(job_id)):
        from stapoctl.jobs import ray_jobs

        addr = ray_jobs.normalize_address(address)
        return records.JobRecord("ray", job_id, "?", "(not submitted from here)", address=addr), None
    if _SLURM_ID.match(job_id):
        from stapoctl.jobs import slurm

        slurm.require_client()
        live = slurm.states(job_id)
        if live:
            info = next(iter(live.values()))
            folder = str(Path(info.get("StdOut", "")).parent) if info.get("StdOut") else None
            return records.JobRecord("slurm", job_id.split("_")[0], info.get("JobName", "?"),
                                     "(not submitted from here)", folder=folder), None
    return records.require(job_id), None  # raises the one-line "not found"


def _tasks(rec: records.JobRecord, task: Optional[str]) -> list[str]:
    return [task] if task else (list(rec.tasks) or [rec.job_id])


def task_states(rec: records.JobRecord, task: Optional[str] = None) -> dict[str, str]:
    if rec.backend == "slurm":
        from stapoctl.jobs import slurm

        live = slurm.states(rec.job_id)
        return {t: slurm.task_state(rec, t, live) for t in _tasks(rec, task)}
    from stapoctl.jobs import ray_jobs

    return {t: ray_jobs.status(rec.address, t)["state"] for t in _tasks(rec, task)}


def list_jobs(console: Console, limit: int = 20) -> None:
    recs = records.load_all()[:limit]
    if not recs:
        console.print(f"no jobs submitted from here yet ({records.jobs_root()})", markup=False)
        return
    table = Table(title=escape(f"jobs submitted from here ({records.jobs_root()})"))  # cells: text, never markup
    for col in ("job id", "backend", "submitted", "run name", "state", "logs"):
        table.add_column(col, overflow="fold")
    for rec in recs:
        try:
            states = task_states(rec)
            state = ", ".join(sorted({s for s in states.values()})) if len(states) > 1 else next(iter(states.values()))
            if len(states) > 1:
                state = f"{len(states)} jobs: {state}"
        except UserError:
            state = "unreachable"
        when = dt.datetime.fromtimestamp(rec.submitted_at).strftime("%Y-%m-%d %H:%M")
        table.add_row(escape(rec.job_id), rec.backend + (" array" if rec.kind == "array" else ""), when,
                      escape(rec.name), escape(state), escape(_logs_hint(rec)))
    console.print(table)


def _logs_hint(rec: records.JobRecord) -> str:
    if rec.backend == "slurm":
        from stapoctl.jobs import slurm

        return str(slurm.log_path(rec, _tasks(rec, None)[0]))
    return f"stapoctl jobs logs {rec.job_id}"


def show_status(job_id: str, console: Console, address: Optional[str] = None) -> None:
    rec, task = resolve(job_id, address)
    table = Table(title=escape(f"{rec.backend} job {job_id} · {rec.name}"), show_header=True)
    for col in ("job", "state", "details"):
        table.add_column(col, overflow="fold")
    if rec.backend == "slurm":
        from stapoctl.jobs import slurm

        live = slurm.states(rec.job_id)
        for t in _tasks(rec, task):
            info = live.get(t, {})
            details = [f"{k}={info[k]}" for k in ("Reason", "Restarts", "RunTime", "NodeList", "ExitCode") if k in info]
            done = slurm.result(rec, t)
            if done and done[0] == "success" and isinstance(done[1], dict):
                details.append(f"MLflow run {done[1].get('run_id')}")
            run_id = _run_id_from_log(slurm.log_path(rec, t))
            if run_id and not any(run_id in d for d in details):
                details.append(f"MLflow run {run_id}")
            details.append(f"log {slurm.log_path(rec, t)}")
            table.add_row(escape(t), escape(slurm.task_state(rec, t, live)), escape(" · ".join(details)))
    else:
        from stapoctl.jobs import ray_jobs

        for t in _tasks(rec, task):
            st = ray_jobs.status(rec.address, t)
            details = [st["message"]] if st["message"] else []
            details.append(f"run {st['metadata'].get('stapoctl.run_name', '?')} on {rec.address}")
            table.add_row(escape(t), escape(st["state"]), escape(" · ".join(details)))  # Ray's message: text
    console.print(table)


_RUN_LINE = re.compile(r"MLflow run ([0-9a-f]{32})")


def _run_id_from_log(path: Path) -> Optional[str]:
    """The trainer prints `MLflow run <id>` when it starts; the last one names the current run."""
    if not path.is_file():
        return None
    found = _RUN_LINE.findall(path.read_text(errors="replace"))
    return found[-1] if found else None


def show_logs(job_id: str, console: Console, follow: bool = False, address: Optional[str] = None) -> int:
    rec, task = resolve(job_id, address)
    if rec.backend == "slurm":
        from stapoctl.jobs import slurm

        if task:
            rec = records.JobRecord(**{**rec.__dict__, "tasks": [task]})
        if follow:
            final = slurm.follow(rec, console)
            return 0 if all(s == "COMPLETED" for s in final.values()) else 1
        for t in _tasks(rec, None):
            path = slurm.log_path(rec, t)
            if len(_tasks(rec, None)) > 1:
                console.rule(escape(t))
            if path.is_file():
                console.out(path.read_text(errors="replace"), highlight=False, end="")
            else:
                console.print(f"no log yet at {path} (state {task_states(rec, t)[t]})", style="dim", markup=False)
        return 0
    from stapoctl.jobs import ray_jobs

    for t in _tasks(rec, task):
        if follow:
            state = ray_jobs.follow(rec.address, t, console)
            if state != "SUCCEEDED":
                return 1
        else:
            console.out(ray_jobs.logs(rec.address, t), highlight=False, end="")
    return 0


def stop_job(job_id: str, console: Console, address: Optional[str] = None) -> None:
    rec, task = resolve(job_id, address)
    if rec.backend == "slurm":
        from stapoctl.jobs import slurm

        slurm.cancel(rec, task)
        console.print(f"cancelled SLURM job {task or rec.job_id}")
        return
    from stapoctl.jobs import ray_jobs

    for t in _tasks(rec, task):
        stopped = ray_jobs.stop(rec.address, t)
        console.print(f"Ray job {t}: {'stop requested' if stopped else 'already ended'}")
