"""`stapoctl doctor cluster=ray|slurm`: the checks run where a run would, as a short job sent
through the submit machinery (`jobs/ray_jobs.py`, `jobs/slurm.py`), and the table printed here
once the job has sent its rows back (`--no-wait`: the job id only). Ray: the job's entrypoint is
`python -m stapoctl.doctor.job`, its rows read from its log. SLURM: the body is `DoctorJob`, its
rows the job's result pickle."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from stapoctl.config import overrides as ov
from stapoctl.doctor.rows import Row, exit_code, find_json, from_error, from_json
from stapoctl.errors import labelled

JOB_NAME = "stapoctl-doctor"
SLURM_TIMEOUT_MIN = 30  # a short job: the checks take minutes
SLURM_FIX = ("run where a SLURM client answers (a login node), check cluster.partition / cluster.preset, "
             "or start a local SLURM with cluster/local-slurm/start.sh")
RAY_FIX = "start the Ray cluster's head (`ray start --head`) or fix cluster.address=http://HOST:8265"

Printer = Callable[[list[Row], str, float], None]


def _given(overrides: Sequence[str]) -> set[str]:
    return ov.keys(overrides)


def _hints(job_id: str, console: Console) -> None:
    console.print(f"  logs: stapoctl jobs logs {job_id} [--follow] · status: stapoctl jobs status {job_id} "
                  f"· stop: stapoctl jobs stop {job_id}", highlight=False)


def _job_failed(console: Console, what: str, log_tail: str) -> int:
    console.print(labelled("the doctor's job ended without its table:", what), highlight=False, soft_wrap=True)
    if log_tail.strip():
        console.print("[dim]last lines of its log:[/]")
        console.out("\n".join(log_tail.strip().splitlines()[-20:]), highlight=False)
    return 1


# -- Ray ------------------------------------------------------------------------------------------
def on_ray(conf: DictConfig, overrides: Sequence[str], console: Console, show: Printer, *,
           wait: bool = True, poll_s: float = 2.0) -> int:
    from stapoctl.jobs import ray_jobs, records
    from stapoctl.tracking.mlflow_run import tracking_uri

    uri = tracking_uri(conf.tracking.uri)
    try:
        spec = ray_jobs.job_spec(conf, list(overrides), JOB_NAME, uri, command=("-m", "stapoctl.doctor.job"))
        job_id = ray_jobs.submit(spec)
    except Exception as exc:
        rows = [from_error("Ray job", exc, RAY_FIX)]
        show(rows, "here (the job was not submitted)", 0.0)
        return 1
    records.JobRecord("ray", job_id, JOB_NAME, records.new_local_id("ray"), kind="doctor", address=spec.address,
                      overrides=list(overrides), tracking_uri=uri).save()
    console.print(f"submitted Ray job [bold]{job_id}[/] to {escape(spec.address)}: stapoctl doctor", highlight=False)
    if not wait:
        _hints(job_id, console)
        return 0
    state = ""
    with console.status(f"waiting for Ray job {job_id}…") as status:
        while not state or not ray_jobs.is_terminal(state):
            time.sleep(poll_s)
            state = ray_jobs.status(spec.address, job_id)["state"]
            status.update(f"waiting for Ray job {job_id} ({state})…")
    log = ray_jobs.logs(spec.address, job_id)
    text = find_json(log)
    if text is None:
        return _job_failed(console, f"Ray job {job_id} {state}", log)
    rows, extra = from_json(text)
    show(rows, f"{extra.get('host', '?')} (Ray job {job_id})", float(extra.get("elapsed_s", 0)))
    return exit_code(rows)


# -- SLURM ----------------------------------------------------------------------------------------
def _slurm_conf(conf: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """The preset applied; the job short (SLURM_TIMEOUT_MIN) unless cluster.timeout_min is given."""
    from stapoctl.jobs import presets

    conf = presets.apply(conf, overrides)
    if "cluster.timeout_min" not in _given(overrides):
        conf = OmegaConf.merge(conf, {"cluster": {"timeout_min": min(int(conf.cluster.timeout_min), SLURM_TIMEOUT_MIN)}})
    return conf


def on_slurm(conf: DictConfig, overrides: Sequence[str], console: Console, show: Printer, *,
             wait: bool = True, poll_s: float = 2.0) -> int:
    from stapoctl.doctor.job import DoctorJob
    from stapoctl.jobs import records, slurm
    from stapoctl.tracking.mlflow_run import tracking_uri

    uri = tracking_uri(conf.tracking.uri)
    local_id = records.new_local_id("slurm")
    try:
        conf = _slurm_conf(conf, overrides)
        slurm.require_client()
        slurm.check_partition(conf.cluster)
        folder = slurm.folder_for(conf, local_id)
        plan = slurm.plan(conf, slurm.job_overrides(conf, overrides, None, uri), folder, uri, JOB_NAME)
        job_id = slurm.submit_body(conf, plan, DoctorJob(plan.job_overrides))
    except Exception as exc:
        show([from_error("SLURM", exc, SLURM_FIX)], "here (the job was not submitted)", 0.0)
        return 1
    rec = records.JobRecord("slurm", job_id, JOB_NAME, local_id, kind="doctor", folder=str(folder),
                            overrides=list(overrides), tracking_uri=uri)
    rec.save()
    console.print(f"submitted SLURM job [bold]{job_id}[/]: stapoctl doctor · partition "
                  + escape(f"{conf.cluster.partition or '(default)'} · log {slurm.log_path(rec, job_id)}"),
                  highlight=False)
    if not wait:
        _hints(job_id, console)
        return 0
    with console.status(f"waiting for SLURM job {job_id} (queued or running)…"):
        final = slurm.follow(rec, Console(quiet=True), poll_s=poll_s)
    done = slurm.result(rec, job_id)
    if done is None or done[0] != "success":
        log = slurm.log_path(rec, job_id)
        tail = log.read_text(errors="replace") if log.is_file() else ""
        return _job_failed(console, f"SLURM job {job_id} {final.get(job_id, '?')} (log {log})", tail)
    result = done[1]
    rows = [Row(**r) for r in result["rows"]]
    show(rows, f"{result.get('host', '?')} (SLURM job {job_id})", float(result.get("elapsed_s", 0)))
    return exit_code(rows)


def dispatch(conf: DictConfig, overrides: Sequence[str], console: Console, show: Printer, *,
             wait: bool) -> Optional[int]:
    """The exit code of the doctor sent to the cluster `cluster=` names; None: run it here."""
    if conf.cluster.name == "slurm":
        return on_slurm(conf, overrides, console, show, wait=wait)
    if conf.cluster.name == "ray":
        return on_ray(conf, overrides, console, show, wait=wait)
    return None
