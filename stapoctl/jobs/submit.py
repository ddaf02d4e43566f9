"""`stapoctl submit`: send `train` to a Ray cluster (Ray Jobs API) or to SLURM (submitit) instead
of running it here, and `submit_trials`, the same for a sweep's trials (a SLURM job array, or one
Ray job per trial), for the sweep runner to call.

Submitters sit above the trainer: the job they send is the ordinary `train` with the user's
overrides (plus the store and run name written out), so a submitted run records to MLflow exactly
as one started here. Every submission leaves a local record (`jobs/records.py`) that
`stapoctl jobs` reads.
"""

from __future__ import annotations

import json
import time
from typing import Optional, Sequence

from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from stapoctl.errors import UserError, labelled
from stapoctl.jobs import presets, records

BACKENDS = ("ray", "slurm")


def default_run_name(conf: DictConfig) -> str:
    """The name `train` gives a run when tracking.run_name is unset (driver.train's default)."""
    return f"{conf.experiment}-{conf.loss.name}-seed{conf.trainer.seed}"


def _prepare(conf: DictConfig, overrides: Sequence[str]) -> DictConfig:
    name = conf.cluster.name
    if name not in BACKENDS:
        raise UserError(
            f"stapoctl submit needs cluster=ray or cluster=slurm (cluster={name}); "
            "to run here use `stapoctl train`"
        )
    conf = presets.apply(conf, overrides)
    from stapoctl.trainer.setup import check_config

    check_config(conf, here=conf.cluster.name == "local" and not conf.cluster.address)  # fail now, not after the queue
    return conf


def _tracking_uri(conf: DictConfig) -> str:
    from stapoctl.tracking.mlflow_run import tracking_uri

    return tracking_uri(conf.tracking.uri)


def submit_run(conf: DictConfig, overrides: Sequence[str], *, dry_run: bool = False, follow: bool = False,
               console: Optional[Console] = None) -> int:
    """The `stapoctl submit` command; returns the exit code (with --follow: the job's outcome)."""
    console = console or Console()
    if dry_run and follow:
        raise UserError("--follow with --dry-run: a dry run submits nothing to follow; drop one of them")
    overrides = list(overrides)
    conf = _prepare(conf, overrides)
    if dry_run:
        from stapoctl.preflight.plan_report import print_memory_plan

        print_memory_plan(conf, console, here=conf.cluster.name == "local" and not conf.cluster.address)
    run_name = conf.tracking.run_name or default_run_name(conf)
    uri = _tracking_uri(conf)
    if conf.cluster.name == "ray":
        return _submit_ray(conf, overrides, run_name, uri, dry_run, follow, console)
    return _submit_slurm(conf, overrides, run_name, uri, dry_run, follow, console)


def _submit_ray(conf, overrides, run_name, uri, dry_run, follow, console) -> int:
    from stapoctl.jobs import ray_jobs

    spec = ray_jobs.job_spec(conf, overrides, run_name, uri)
    if dry_run:
        console.rule("[bold]Ray job spec[/] (dry run: nothing submitted)")
        console.out(json.dumps(spec.as_dict(), indent=2), highlight=False)
        return 0
    job_id = ray_jobs.submit(spec)
    rec = records.JobRecord("ray", job_id, run_name, records.new_local_id("ray"), address=spec.address,
                            overrides=overrides, tracking_uri=uri)
    rec.save()
    console.print(f"submitted Ray job [bold]{job_id}[/] to {escape(spec.address)} · run '{escape(run_name)}' "
                  f"({spec.metadata['stapoctl.ship_code']} code)")
    _print_hints(job_id, console)
    if not follow:
        return 0
    state = ray_jobs.follow(spec.address, job_id, console)
    return _report({job_id: state}, {"SUCCEEDED"}, console)


def _submit_slurm(conf, overrides, run_name, uri, dry_run, follow, console) -> int:
    from stapoctl.jobs import slurm

    local_id = records.new_local_id("slurm")
    folder = slurm.folder_for(conf, local_id)
    plan = slurm.plan(conf, slurm.job_overrides(conf, overrides, run_name, uri), folder, uri, f"stapoctl-{run_name}")
    if dry_run:
        console.rule("[bold]sbatch script[/] (dry run: nothing submitted)")
        console.out(plan.script(), highlight=False)
        try:
            _check_slurm(conf, required=False)
        except UserError as exc:  # show the script anyway: it may be meant for another site
            console.print(labelled("warning:", f"submitting this would fail here: {exc}", "yellow"), highlight=False,
                          soft_wrap=True)
        return 0
    _check_slurm(conf, required=True)
    job_id = slurm.submit_train(conf, plan)
    rec = records.JobRecord("slurm", job_id, run_name, local_id, folder=str(folder), overrides=overrides,
                            tracking_uri=uri)
    rec.save()
    c = conf.cluster
    console.print(f"submitted SLURM job [bold]{job_id}[/] · run '{escape(run_name)}' · {c.nodes} node(s) × "
                  f"{c.cpus_per_task} CPUs, {c.gpus_per_node} GPUs · "
                  f"partition {escape(str(c.partition or '(default)'))}")
    console.print(f"  log file: {slurm.log_path(rec, job_id)}", markup=False)
    _print_hints(job_id, console)
    if not follow:
        return 0
    final = slurm.follow(rec, console)
    return _report(final, {"COMPLETED"}, console)


def _check_slurm(conf, required: bool) -> None:
    from stapoctl.jobs import slurm

    try:
        slurm.require_client()
    except UserError:
        if required:
            raise
        return  # a dry run on a laptop: nothing to ask
    slurm.check_partition(conf.cluster)


def _print_hints(job_id: str, console: Console) -> None:
    console.print(f"  logs: stapoctl jobs logs {job_id} [--follow] · status: stapoctl jobs status {job_id} "
                  f"· stop: stapoctl jobs stop {job_id}", highlight=False)


def _report(final: dict[str, str], good: set[str], console: Console) -> int:
    bad = {t: s for t, s in final.items() if s not in good}
    for task, state in final.items():
        colour = "green" if state in good else "red"
        console.print(f"job {escape(task)}: [{colour}]{escape(state)}[/]")
    if bad:
        console.print(f"see the logs: stapoctl jobs logs {next(iter(bad))}")
    return 0 if not bad else 1


# -- sweeps ----------------------------------------------------------------------------------------
def submit_trials(base_overrides: Sequence[str], trials: Sequence[Sequence[str]], parent_run_id: str, *,
                  name: Optional[str] = None, console: Optional[Console] = None) -> records.JobRecord:
    """Submit a sweep's trials to the cluster the base overrides name (cluster=slurm|ray).

    Each trial is `train` with `base_overrides + trial + tracking.parent_run_id=<parent_run_id>`,
    so its MLflow run nests under the sweep's parent run. SLURM: one job array through
    submitit's `map_array`, `cluster.array_parallelism` trials at once, each task resuming its
    own run dir after a requeue. Ray: one Ray job per trial. Returns the local record; its
    `tasks` are the trials' job ids in trial order (`wait(record)` follows them to the end).
    """
    from stapoctl.config.compose import compose_config

    console = console or Console()
    base = list(base_overrides)
    if not trials:
        raise UserError("a sweep with no trials: nothing to submit")
    conf = _prepare(compose_config(base), base)
    uri = _tracking_uri(conf)
    name = name or f"sweep-{conf.experiment}-{conf.loss.name}"
    per_trial = [[*t, f"tracking.parent_run_id={parent_run_id}"] for t in trials]
    if conf.cluster.name == "slurm":
        from stapoctl.jobs import slurm

        _check_slurm(conf, required=True)
        local_id = records.new_local_id("slurm")
        folder = slurm.folder_for(conf, local_id)
        plan = slurm.plan(conf, slurm.job_overrides(conf, base, None, uri), folder, uri, f"stapoctl-{name}",
                          array_size=len(per_trial))
        tasks = slurm.submit_trials(conf, plan, per_trial)
        rec = records.JobRecord("slurm", tasks[0].split("_")[0], name, local_id, kind="array",
                                folder=str(folder), tasks=tasks, trials=per_trial, overrides=base,
                                parent_run_id=parent_run_id, tracking_uri=uri)
        rec.save()
        console.print(f"submitted SLURM job array [bold]{rec.job_id}[/] · {len(tasks)} trials of '{escape(name)}' "
                      f"({conf.cluster.array_parallelism} at once) · parent run {parent_run_id}")
        _print_hints(rec.job_id, console)
        return rec
    from stapoctl.jobs import ray_jobs

    local_id = records.new_local_id("ray")
    tasks, address = [], None
    for i, trial in enumerate(per_trial):
        trial_conf = compose_config([*base, *trial])
        run_name = trial_conf.tracking.run_name or f"{name}-{i}"
        spec = ray_jobs.job_spec(trial_conf, [*base, *trial], run_name, uri)
        tasks.append(ray_jobs.submit(spec))
        address = spec.address
    rec = records.JobRecord("ray", local_id, name, local_id, kind="array", address=address, tasks=tasks,
                            trials=per_trial, overrides=base, parent_run_id=parent_run_id, tracking_uri=uri)
    rec.save()
    console.print(f"submitted {len(tasks)} Ray jobs for '{name}' to {address} · parent run {parent_run_id}",
                  markup=False)
    _print_hints(local_id, console)
    return rec


def ray_trial_job(overrides: Sequence[str], *, stop_wait_s: Optional[int] = None):
    """One trial of a sweep as a Ray job (`stapoctl sweep … max_parallel=K` submits them K at a
    time): `train` with the trial's overrides, which name cluster=ray and the job server.
    `stop_wait_s`: how long the job's driver may take after a stop (SIGTERM) to end its step,
    write a checkpoint and end its run KILLED before Ray kills it (Ray's default: 3 s)."""
    from stapoctl.config.compose import compose_config
    from stapoctl.jobs import ray_jobs

    overrides = list(overrides)
    conf = _prepare(compose_config(overrides), overrides)
    spec = ray_jobs.job_spec(conf, overrides, conf.tracking.run_name or default_run_name(conf), _tracking_uri(conf))
    if stop_wait_s:
        spec.runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] = str(int(stop_wait_s))
    return spec


def wait(rec: records.JobRecord, console: Optional[Console] = None, poll_s: float = 5.0,
         stream_logs: bool = True) -> dict[str, str]:
    """Block until every job of the record has ended; job id → final state."""
    console = console or Console()
    if rec.backend == "slurm":
        from stapoctl.jobs import slurm

        return slurm.follow(rec, console if stream_logs else Console(quiet=True), poll_s=poll_s)
    from stapoctl.jobs import ray_jobs

    tasks = list(rec.tasks) or [rec.job_id]
    if len(tasks) == 1 and stream_logs:
        return {tasks[0]: ray_jobs.follow(rec.address, tasks[0], console)}
    while True:
        final = {t: ray_jobs.status(rec.address, t)["state"] for t in tasks}
        if all(ray_jobs.is_terminal(s) for s in final.values()):
            return final
        time.sleep(poll_s)
