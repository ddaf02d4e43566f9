"""Where `max_parallel=K` trials run: `stapoctl train` processes here, or Ray jobs on a job server.

**Here (`cluster=local`)**, each of the K trials is its own `stapoctl train` process with its
own local Ray, sized to its share of the machine (`cluster.num_cpus` = ⌊CPUs / K⌋, and a
disjoint `CUDA_VISIBLE_DEVICES` slice when the trials ask for GPUs). Chosen over K drivers
joining one Ray the sweep would start because:
- each trial is then exactly the `stapoctl train` a user runs here: the same local Ray start,
  actor environment (STAPOCTL_HOME, PYTHONPATH, the MKL shim) and thread counts — the trainer
  sizes its threads from `cluster.num_cpus`, so two trials on 2 cores use one thread per role
  each instead of both taking every core. Joining a shared Ray by its address goes through the
  remote-cluster path instead (the package uploaded per driver, the environment not forwarded,
  the MKL shim off, threads from the CPU shares);
- the fit is decided before anything starts, from the trials' placement (K × their bundles
  against the machine, and K × their host memory), with one line naming the fix; with a shared
  Ray a trial that does not fit would wait `cluster.placement_timeout_s` and then fail;
- a trial whose engines crash, hang or are SIGKILLed takes only its own Ray with it.
The price, measured here: a local Ray of 1 CPU is 7 processes and ~0.3 GiB of their own memory
(0.55 GiB RSS), a small part of a trial's 3–5 GB, and 5–17 s to start (idle / loaded machine),
paid by the K trials side by side. Each trial's output goes to
`$STAPOCTL_HOME/sweeps/<sweep id>/trial-<i>.log`.
With `cluster.address=HOST:6379` (joining a Ray cluster) the K processes join that cluster and
Ray places them (no share is computed; a trial waits up to `cluster.placement_timeout_s`).

**A Ray job server (`cluster=ray cluster.address=http://HOST:8265`)**: one Ray job per trial,
at most K at once (`jobs.submit.ray_trial_job`); a stop gives the job's driver
`STOP_WAIT_S` to end its step and checkpoint before Ray kills it (Ray's default is 3 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import DictConfig

from stapoctl import paths
from stapoctl.errors import UserError
from stapoctl.sweep import orphans
from stapoctl.sweep.parallel import End
from stapoctl.sweep.plan import Trial

# the trial's command here; tests point it at a stand-in trainer
TRAIN = (sys.executable, "-m", "stapoctl.cli", "train")
FIX = "use fractional CPUs (e.g. rollout.cpus_per_worker=0.5 learner.cpus=0.5), a lower max_parallel, or set cluster.num_cpus"


# -- room for K trials here ------------------------------------------------------------------------
def _need(conf: DictConfig) -> tuple[dict[str, float], str]:
    """(resources one trial reserves, how they add up) from its placement."""
    from stapoctl.launch.placement import role_plans, total_need

    plans = role_plans(conf.rollout, conf.learner)
    need = total_need(plans)
    names = {"rollout": "rollout worker", "learner": "learner rank", "colocated": "colocated bundle"}
    parts = [f"{p.count} {names[p.role]}{'s' if p.count > 1 else ''} × {p.bundle.get('CPU', 0):g}" for p in plans]
    if conf.reward.model_verifier:
        need["CPU"] = need.get("CPU", 0.0) + float(conf.reward.model_verifier_cpus)
        parts.append(f"the verifier model {float(conf.reward.model_verifier_cpus):g}")
    return need, " + ".join(parts)


def _visible_gpus(conf: DictConfig) -> list[str]:
    from stapoctl.preflight.machine import local_gpus

    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [g for g in given.split(",") if g.strip()] if given else [str(i) for i in range(local_gpus())]
    return ids[: int(conf.cluster.num_gpus)] if conf.cluster.num_gpus is not None else ids


def room_here(confs: Iterable[DictConfig], k: int) -> list[tuple[list[str], dict[str, str]]]:
    """K slots of this machine, each (the overrides, the environment) of the trial in it; a
    `UserError` in one line when K trials' placement or memory cannot fit."""
    confs = list(confs)
    c = confs[0].cluster
    cpus = float(c.num_cpus or len(os.sched_getaffinity(0)) or 1)
    each = int(cpus // k)
    needs = [_need(conf) for conf in confs]
    cpu, how = max(((n.get("CPU", 0.0), how) for n, how in needs), key=lambda x: x[0])
    if each < 1 or cpu > each + 1e-9:
        raise UserError(f"max_parallel={k}: {k} trials at once need {k} × {cpu:g} CPU ({how}) and this machine has "
                        f"{cpus:g} ({each} for each trial's own Ray): {FIX}")
    gpu = max(n.get("GPU", 0.0) for n, _ in needs)
    gpu_ids = _visible_gpus(confs[0]) if gpu > 0 else []
    per = len(gpu_ids) // k
    if gpu > per + 1e-9:
        raise UserError(f"max_parallel={k}: {k} trials at once need {k} × {gpu:g} GPU and this machine has "
                        f"{len(gpu_ids)}: a lower max_parallel, or fewer GPUs per trial (rollout.num_workers, "
                        "rollout.gpus_per_worker, learner.num_ranks)")
    _check_memory(confs, k)
    slots = []
    for j in range(k):
        overrides, env = [f"cluster.num_cpus={each}"], {}
        if gpu > 0:
            overrides.append(f"cluster.num_gpus={per}")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids[j * per:(j + 1) * per])
        slots.append((overrides, env))
    return slots


def _check_memory(confs: list[DictConfig], k: int) -> None:
    """K × a trial's CPU-resident roles (`stapoctl plan`'s figures) against this machine's memory."""
    from stapoctl.preflight.memory_plan import ShapeUnknown, build_plan

    for conf in confs:
        try:
            plan = build_plan(conf)
        except ShapeUnknown:
            return  # sized where the model is known; the trial's own preflight says so
        need = sum(r.per_device_gib * r.count for r in plan.roles if r.device == "CPU" and r.role != "reference")
        if k * need > plan.host_gib:
            raise UserError(f"max_parallel={k}: {k} trials at once need {k} × {need:.1f} GiB of host memory and this "
                            f"machine has {plan.host_gib:.1f} GiB: a lower max_parallel, or smaller trials "
                            "(rollout.kv_cache_gb, rollout.num_workers, learner.num_ranks)")


# -- trials as processes here ----------------------------------------------------------------------
class LocalTrials:
    """Each trial a `stapoctl train` process in a session of its own: the sweep forwards exactly
    one signal to it (a terminal's Ctrl-C reaches the sweep alone, so no trial gets two); if the
    sweep dies, the kernel sends it the one stop itself (`orphans`)."""

    what = "process"
    poll_s = 1.0
    stop_wait_s = 600.0  # one step and a checkpoint, with room for a slow machine

    def __init__(self, slots: list[tuple[list[str], dict[str, str]]], log_dir: Path):
        self.slots, self.log_dir = slots, log_dir
        self.free = list(range(len(slots)))
        self.slot_of: dict[int, int] = {}
        self.logs: dict[int, Path] = {}

    def start(self, trial: Trial, resume: Optional[str]) -> subprocess.Popen:
        slot = self.free.pop(0)
        overrides, env = self.slots[slot]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"trial-{trial.index + 1}.log"
        args = orphans.command(os.getpid(), [*TRAIN, *trial.overrides, *([f"resume={resume}"] if resume else []),
                                             *overrides])  # stops with a checkpoint if this process dies
        try:
            with open(log, "ab") as out:
                proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160", **env},
                                        start_new_session=True)
        except OSError:
            self.free.insert(0, slot)
            raise
        self.slot_of[proc.pid], self.logs[proc.pid] = slot, log
        return proc

    def state(self, proc: subprocess.Popen) -> Optional[End]:
        code = proc.poll()
        if code is None:
            return None
        if proc.pid in self.slot_of:
            self.free.append(self.slot_of.pop(proc.pid))
        return End(code == 0, f"exit {code}", "" if code == 0 else last_line(self.logs[proc.pid]))

    def stop(self, proc: subprocess.Popen, signum: int, hard: bool) -> None:
        if proc.poll() is not None:
            return
        if not hard:
            _signal(proc.pid, signum)
            return
        import psutil

        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            family = []
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its session: the trainer and its own Ray
        except (ProcessLookupError, PermissionError):
            pass
        for p in family:  # any that left the group
            _signal(p.pid, signal.SIGKILL)

    def where(self, proc: subprocess.Popen) -> str:
        return f"log {self.logs[proc.pid]}"


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def last_line(log: Path, limit: int = 400) -> str:
    """The last non-empty line a trial printed (its one-line error, as `stapoctl train` ends)."""
    import re

    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[-1][:limit] if lines else ""


def log_dir(sweep_id: str) -> Path:
    return paths.home() / "sweeps" / sweep_id


# -- trials as Ray jobs ------------------------------------------------------------------------------
class RayJobTrials:
    """One Ray job per trial; the submissions go in the local job record `stapoctl jobs` reads."""

    what = "Ray job"
    poll_s = 3.0
    STOP_WAIT_S = 120  # the job's driver: the rest of a step and a checkpoint, then Ray kills it
    stop_wait_s = STOP_WAIT_S + 60.0
    UNREACHABLE_S = 600.0  # a job server silent this long: its trials count as failed

    def __init__(self, name: str, sweep_id: str):
        self.name, self.sweep_id = name, sweep_id
        self.record: Any = None
        self.address = ""
        self.last_seen: dict[str, float] = {}

    def start(self, trial: Trial, resume: Optional[str]) -> str:
        from stapoctl.jobs import ray_jobs
        from stapoctl.jobs.submit import ray_trial_job

        overrides = [*trial.overrides, *([f"resume={resume}"] if resume else [])]
        spec = ray_trial_job(overrides, stop_wait_s=self.STOP_WAIT_S)
        job_id = ray_jobs.submit(spec)
        self.address = spec.address
        self._remember(job_id, overrides)
        self.last_seen[job_id] = time.monotonic()
        return job_id

    def _remember(self, job_id: str, overrides: list[str]) -> None:
        from stapoctl.jobs import records

        if self.record is None:
            local_id = records.new_local_id("ray")
            self.record = records.JobRecord("ray", local_id, f"sweep-{self.name}", local_id, kind="array",
                                            address=self.address, parent_run_id=self.sweep_id)
        self.record.tasks.append(job_id)
        self.record.trials.append(overrides)
        self.record.save()

    def state(self, job_id: str) -> Optional[End]:
        from stapoctl.jobs import ray_jobs

        try:
            info = ray_jobs.status(self.address, job_id)
        except UserError as exc:  # the server is away for a moment: ask again, within reason
            if time.monotonic() - self.last_seen[job_id] < self.UNREACHABLE_S:
                return None
            return End(False, "UNREACHABLE", str(exc))
        self.last_seen[job_id] = time.monotonic()
        if not ray_jobs.is_terminal(info["state"]):
            return None
        ok = info["state"] == "SUCCEEDED"
        return End(ok, info["state"], "" if ok else (info["message"].strip().splitlines() or [""])[0][:400])

    def stop(self, job_id: str, signum: int, hard: bool) -> None:
        from stapoctl.jobs import ray_jobs

        if hard:
            return  # Ray kills the driver once STOP_WAIT_S is over; nothing quicker to ask for
        try:
            ray_jobs.stop(self.address, job_id)
        except UserError:
            pass

    def where(self, job_id: str) -> str:
        return f"Ray job {job_id} (stapoctl jobs logs {job_id})"
