"""`stapoctl submit cluster=slurm`: the run as a SLURM job through submitit, sweeps as job arrays,
and the `jobs` verbs for SLURM job ids.

The job body is `TrainJob`, a submitit Checkpointable that calls the trainer like `stapoctl train`
does. Each job trains into its own run dir, `<folder>/runs/<SLURM job id>`; when the job starts
again after a requeue (preemption, time limit, `scontrol requeue`) that dir already holds
checkpoints, so the job passes `resume=<run dir>` and the trainer continues the same MLflow run
from the newest checkpoint. On the time-limit/preemption signal (USR2, `signal_delay_s` before
the end) submitit calls `TrainJob.checkpoint` and requeues the job itself; what the requeued job
resumes from is the trainer's newest periodic checkpoint (`trainer.save_freq`).

This module sits above the trainer: it imports the driver only inside the job body, and the
trainer never learns that SLURM started it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import submitit
from rich.console import Console
from rich.markup import escape

from stapoctl import paths
from stapoctl.config import overrides as ov
from stapoctl.errors import UserError
from stapoctl.jobs import presets, records, sbatch
from stapoctl.launch.ray_runtime import interface_env
from stapoctl.launch import engine_log

# scontrol's job states after which nothing more happens (REQUEUED/COMPLETING/PENDING go on)
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}


# -- the job body ------------------------------------------------------------------------------
class TrainJob(submitit.helpers.Checkpointable):
    """`train` with the submitted overrides, resuming its own run dir when it runs again."""

    def __init__(self, overrides: Sequence[str], folder: str):
        self.overrides = list(overrides)
        self.folder = str(folder)

    def __call__(self, extra: Sequence[str] = ()) -> dict:
        from stapoctl.config.compose import compose_config
        from stapoctl import checkpoint
        from stapoctl.trainer.driver import train

        env = submitit.JobEnvironment()
        # a requeued attempt: the killed one may have left its error as the job's result
        env.paths.result_pickle.unlink(missing_ok=True)
        run_dir = Path(self.folder) / "runs" / env.job_id
        overrides = [*self.overrides, *extra, f"trainer.output_dir={run_dir}"]
        resume = checkpoint.latest_step_dir(run_dir)
        if resume is not None:
            overrides.append(f"resume={run_dir}")
        if os.environ.get(sbatch.RAY_ADDRESS_ENV):  # multi-node: Ray is already up across the nodes
            overrides.append(f"cluster.address={os.environ[sbatch.RAY_ADDRESS_ENV]}")
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        console = Console()
        console.print(f"[bold]SLURM job {env.job_id}[/] on {env.hostname} (restart {restarts})" + escape(
                      (f", resuming {resume}" if resume else "") + f": stapoctl train {shlex.join(overrides)}"))
        conf = presets.apply(compose_config(overrides), overrides)
        summary = train(conf, console=console)
        _tag_run(summary, {"stapoctl.launcher": "slurm", "stapoctl.slurm.job_id": env.job_id,
                           "stapoctl.slurm.restarts": str(restarts)})
        return {k: summary.get(k) for k in ("run_id", "run_dir", "tracking_uri", "steps", "final")}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Submitit's preemption/time-limit hook: requeue this same job body. The model state is
        the trainer's newest checkpoint in the run dir, which the requeued job resumes from."""
        return super().checkpoint(*args, **kwargs)


def _tag_run(summary: dict, tags: dict[str, str]) -> None:
    import mlflow

    if summary.get("run_id"):
        client = mlflow.MlflowClient(summary.get("tracking_uri"))
        for key, value in tags.items():
            client.set_tag(summary["run_id"], key, value)


# -- checks against the live cluster -----------------------------------------------------------
def require_client() -> None:
    if not (shutil.which("sbatch") and shutil.which("sinfo")):
        raise UserError(
            "cluster=slurm: no SLURM client here (sbatch/sinfo not on PATH): submit from a login node, "
            "or start a local one with cluster/local-slurm/start.sh"
        )


def partitions() -> list[str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"cluster=slurm: sinfo did not answer ({exc}); is slurmctld up?") from exc
    if out.returncode != 0:
        first = (out.stderr.strip().splitlines() or ["no output"])[0]
        raise UserError(f"cluster=slurm: sinfo failed ({first}); is slurmctld up?")
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


def check_partition(cluster) -> None:
    if not cluster.partition:
        return
    have = partitions()
    if cluster.partition not in have:
        where = f" (from cluster.preset={cluster.preset})" if cluster.get("preset") else ""
        raise UserError(
            f"cluster.partition='{cluster.partition}'{where}: no such SLURM partition (sinfo lists: "
            f"{', '.join(have) or 'none'}); set cluster.partition to one of them"
        )


# -- the sbatch script ---------------------------------------------------------------------------
@dataclass
class Plan:
    """Everything a submission needs, computed without touching SLURM (so --dry-run shows it)."""

    folder: Path
    python: Optional[str]  # None: submitit's default, this interpreter
    parameters: dict[str, Any]  # submitit's SlurmExecutor parameters
    job_overrides: list[str]
    array_size: Optional[int] = None

    def script(self) -> str:
        """The sbatch script submitit writes for this plan (submitit's own renderer, so the dry
        run and the real submission agree)."""
        from submitit.slurm.slurm import _make_sbatch_string

        python = self.python or shlex.quote(sys.executable)
        command = " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(self.folder))])
        return _make_sbatch_string(command=command, folder=self.folder, map_count=self.array_size,
                                   **self.parameters)


def job_environment(tracking_uri: str) -> dict[str, str]:
    """The variables a job needs, written out rather than inherited from the submitting shell."""
    return {
        "STAPOCTL_HOME": str(paths.home()),
        "MLFLOW_TRACKING_URI": tracking_uri,
        # Ray's token authentication stays on and, set explicitly, stops announcing itself
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
        "PYTHONUNBUFFERED": "1",
        **engine_log.forwarded(),  # tests only: the job's engine start is counted (launch/engine_log.py)
    }


def plan(conf, job_overrides: list[str], folder: Path, tracking_uri: str, job_name: str,
         array_size: Optional[int] = None) -> Plan:
    c = conf.cluster
    if c.nodes < 1:
        raise UserError(f"cluster.nodes={c.nodes}: must be >= 1")
    if c.cpus_per_task < 1:
        raise UserError(f"cluster.cpus_per_task={c.cpus_per_task}: must be >= 1")
    python = c.python or None
    setup = [f"# job: stapoctl train {shlex.join(job_overrides)}"]
    setup += [str(line) for line in c.setup]
    setup += sbatch.env_lines({**job_environment(tracking_uri), **interface_env(c)}, str(paths.project_root()))
    params: dict[str, Any] = {
        "job_name": job_name[:64],
        "time": int(c.timeout_min),
        "ntasks_per_node": 1,
        "cpus_per_task": int(c.cpus_per_task),
        "stderr_to_stdout": True,
        "signal_delay_s": 120,
        "setup": setup,
    }
    for key in ("partition", "account", "qos", "constraint"):
        if c.get(key):
            params[key] = str(c[key])
    if c.gpus_per_node:
        params["gpus_per_node"] = int(c.gpus_per_node)
    if c.mem_gb:
        mem = float(c.mem_gb)
        params["mem"] = f"{int(mem)}GB" if mem == int(mem) else f"{int(round(mem * 1024))}MB"
    if c.nodes > 1:
        # submitit runs one task (the driver, one srun step); the other nodes run Ray workers
        params["additional_parameters"] = {"nodes": int(c.nodes)}
        params["srun_args"] = ["--nodes=1", "--ntasks=1", "--overlap"]
        setup += sbatch.ray_bootstrap_lines(python or shlex.quote(sys.executable), int(c.nodes),
                                            int(c.gpus_per_node or 0), int(c.ray_port), c.get("socket_ifname"))
    if array_size:
        params["array_parallelism"] = int(c.array_parallelism)
    return Plan(folder, python, params, list(job_overrides), array_size)


def job_overrides(conf, overrides: Sequence[str], run_name: Optional[str], tracking_uri: str) -> list[str]:
    """The user's overrides plus what the job must not guess: the store, the run's name, and Ray
    sized to the allocation (unless given)."""
    given = ov.keys(overrides)
    out = ov.drop(overrides, ("tracking.uri", "tracking.run_name"))
    out.append(f"tracking.uri={tracking_uri}")
    if run_name:
        out.append(f"tracking.run_name={run_name}")
    if conf.cluster.nodes == 1:
        if "cluster.num_cpus" not in given:
            out.append(f"cluster.num_cpus={int(conf.cluster.cpus_per_task)}")
        if "cluster.num_gpus" not in given:
            out.append(f"cluster.num_gpus={int(conf.cluster.gpus_per_node or 0)}")
    return out


def folder_for(conf, local_id: str) -> Path:
    base = Path(conf.cluster.log_dir).expanduser().resolve() if conf.cluster.get("log_dir") else records.jobs_root()
    return base / local_id


def _executor(conf, p: Plan) -> submitit.SlurmExecutor:
    ex = submitit.SlurmExecutor(folder=p.folder, python=p.python, max_num_timeout=int(conf.cluster.max_requeues))
    ex.update_parameters(**p.parameters)
    return ex


def submit_train(conf, p: Plan) -> str:
    """Submit one training job; returns its SLURM job id."""
    return submit_body(conf, p, TrainJob(p.job_overrides, str(p.folder)))


def submit_body(conf, p: Plan, body: Any) -> str:
    """Submit one job whose body is `body` (a picklable callable: `TrainJob`, `stapoctl doctor`'s
    `DoctorJob`); returns its SLURM job id. Its return value is the job's result pickle."""
    ex = _executor(conf, p)
    try:
        job = ex.submit(body)
    except (subprocess.CalledProcessError, submitit.core.utils.FailedJobError) as exc:
        raise UserError(f"sbatch refused the job: {_first_line(exc)}") from exc
    return str(job.job_id)


def submit_trials(conf, p: Plan, trials: Sequence[Sequence[str]]) -> list[str]:
    """Submit trials as one job array (`map_array`, `array_parallelism` at once); task ids."""
    ex = _executor(conf, p)
    try:
        jobs = ex.map_array(TrainJob(p.job_overrides, str(p.folder)), [list(t) for t in trials])
    except (subprocess.CalledProcessError, submitit.core.utils.FailedJobError) as exc:
        raise UserError(f"sbatch refused the job array: {_first_line(exc)}") from exc
    return [str(j.job_id) for j in jobs]


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "stderr", None) or getattr(exc, "output", None) or exc)
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text.strip().splitlines() or [type(exc).__name__])[-1]


# -- state, logs, stop -------------------------------------------------------------------------
_FIELD = re.compile(r"(\w+)=(\S*)")


def _expand(task_spec: str) -> list[str]:
    """scontrol's ArrayTaskId of pending tasks: `0-3%2`, `1,3`, `2`."""
    spec = task_spec.split("%")[0]
    out: list[str] = []
    for part in spec.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out += [str(i) for i in range(int(lo), int(hi) + 1)]
        elif part:
            out.append(part)
    return out


def states(job_id: str) -> dict[str, dict[str, str]]:
    """id (array tasks as `<array>_<i>`) → scontrol's fields, while SLURM still knows the job."""
    base = job_id.split("_")[0]
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", base], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[str, dict[str, str]] = {}
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        info = dict(_FIELD.findall(line))
        if not info.get("JobId"):
            continue
        if info.get("ArrayJobId") and info.get("ArrayTaskId"):
            for task in _expand(info["ArrayTaskId"]):
                found[f"{info['ArrayJobId']}_{task}"] = info
        else:
            found[info["JobId"]] = info
    return found


def job_paths(rec: records.JobRecord, task: str) -> submitit.core.utils.JobPaths:
    """Where submitit writes a task's log and result (its naming, not ours; the driver is task 0)."""
    return submitit.core.utils.JobPaths(Path(rec.folder or rec.directory), job_id=task, task_id=0)


def log_path(rec: records.JobRecord, task: str) -> Path:
    return job_paths(rec, task).stdout


def result(rec: records.JobRecord, task: str) -> Optional[tuple[str, Any]]:
    """submitit's (outcome, value) of a finished task, None while there is none."""
    path = job_paths(rec, task).result_pickle
    if not path.is_file():
        return None
    try:
        return submitit.core.utils.pickle_load(path)
    except Exception:
        return None


def task_state(rec: records.JobRecord, task: str, live: dict[str, dict[str, str]]) -> str:
    info = live.get(task)
    if info:
        state = info.get("JobState", "UNKNOWN")
        if state == "PREEMPTED" and info.get("Requeue") == "1":
            return "PREEMPTED (requeued)"  # it will run again: not an end
        return state
    done = result(rec, task)  # SLURM forgot it (MinJobAge): submitit's result still tells
    if done is None:
        return "UNKNOWN"
    return "COMPLETED" if done[0] == "success" else "FAILED"


def tasks_of(rec: records.JobRecord) -> list[str]:
    return list(rec.tasks) or [rec.job_id]


def follow(rec: records.JobRecord, console: Console, poll_s: float = 2.0,
           timeout_s: Optional[float] = None) -> dict[str, str]:
    """Print the tasks' logs as they grow until every task ends; task → final state."""
    tasks = tasks_of(rec)
    offsets = {t: 0 for t in tasks}
    t0 = time.monotonic()
    try:
        while True:
            live = states(rec.job_id)
            final = {t: task_state(rec, t, live) for t in tasks}
            for t in tasks:
                offsets[t] = _print_new(log_path(rec, t), offsets[t], console, f"[{t}] " if len(tasks) > 1 else "")
            if all(s in TERMINAL for s in final.values()):
                return final
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                return final
            time.sleep(poll_s)
    except KeyboardInterrupt:
        console.print(f"\n[yellow]stopped following; SLURM job {rec.job_id} keeps running[/] "
                      f"(stapoctl jobs logs {rec.job_id} --follow · stapoctl jobs stop {rec.job_id})")
        raise


def _print_new(path: Path, offset: int, console: Console, prefix: str) -> int:
    if not path.is_file():
        return offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    if not chunk:
        return offset
    text = chunk.decode(errors="replace")
    complete, _, partial = text.rpartition("\n")
    if not complete and partial:
        return offset  # wait for the end of the line
    for line in complete.split("\n"):
        console.out(prefix + line, highlight=False)
    return offset + len(complete.encode()) + 1


def cancel(rec: records.JobRecord, task: Optional[str] = None) -> None:
    target = task or rec.job_id
    out = subprocess.run(["scancel", target], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise UserError(f"scancel {target} failed: {(out.stderr.strip().splitlines() or ['?'])[0]}")
