"""`max_parallel=K`: up to K trials at once, tracked by the sweep's parent run.

`run_parallel` keeps up to K trials running through a launcher (`launchers.LocalTrials`:
`stapoctl train` processes here; `launchers.RayJobTrials`: one Ray job per trial on a job
server), starts the next trial as soon as one ends, and settles each ended trial from what its
child run says: FINISHED (at its last step, with that step's validation) or FAILED with the
reason (the run's own error, else the process's last line or the job's message). A failed trial
does not stop the others.

Ctrl-C or SIGTERM stops all of them: each running trial gets one graceful stop (the trainer
ends its step, writes a checkpoint and ends its run KILLED); a second signal, or the launcher's
time limit, stops them at once. Then every child still RUNNING and the parent end KILLED, so no
run is left RUNNING, and `resume=` later runs only the unfinished trials (a trial with a
checkpoint continues from it, as in the sequential runner).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from rich.console import Console
from rich.markup import escape

from stapoctl.errors import UserError
from stapoctl.sweep import layout, store
from stapoctl.sweep.definition import SweepDefinition
from stapoctl.sweep.outcome import (ALARM_STATUS, Outcome, alarm_line, alarm_outcome, attempt_run, final_val, finish,
                                    pct, resume_point)
from stapoctl.sweep.plan import Trial
from stapoctl.sweep.signals import signals_as_interrupt, signals_deferred


@dataclass
class End:
    """How a trial's process or job ended."""

    ok: bool
    state: str  # "exit 1", "FAILED", … as shown to the user
    error: str = ""  # its last words: a process's last log line, a job's message


class Launcher(Protocol):
    what: str  # "process" | "Ray job"
    poll_s: float  # how often the running trials are looked at
    stop_wait_s: float  # how long a graceful stop may take before the trials are stopped at once

    def start(self, trial: Trial, resume: Optional[str]) -> Any: ...

    def state(self, handle: Any) -> Optional[End]: ...  # None while it runs

    def stop(self, handle: Any, signum: int, hard: bool) -> None: ...

    def where(self, handle: Any) -> str: ...  # its log, or its job id


@dataclass
class Sweep:
    """The sweep the trials belong to."""

    definition: SweepDefinition
    sweep_id: str
    trials: list[Trial]
    records: dict  # trial index → store.TrialRecord, as the sweep started
    uri: Optional[str]
    experiment: str
    console: Console


@dataclass
class Running:
    trial: Trial
    handle: Any
    resume: Optional[str]
    since: float  # epoch seconds at its start (its child run is found by it)
    t0: float  # perf_counter at its start


@dataclass
class Pool:
    sweep: Sweep
    launcher: Launcher
    running: dict[int, Running] = field(default_factory=dict)
    outcomes: dict[int, Outcome] = field(default_factory=dict)

    # -- starting and watching ------------------------------------------------------------------
    def start(self, trial: Trial) -> None:
        s = self.sweep
        resume = resume_point(s.records[trial.index])
        since, t0 = time.time(), time.perf_counter()
        try:
            with signals_deferred(replay=True):  # a trial started is a trial the pool knows
                self.running[trial.index] = Running(trial, self.launcher.start(trial, resume), resume, since, t0)
        except (UserError, OSError) as exc:  # this trial could not start: it failed, the others go on
            error = store.one_line(exc)
            run_id = store.record_failed_trial(s.sweep_id, trial, s.experiment, s.uri, error)
            self._done(Outcome(trial, "FAILED", run_id), error)
            return
        handle = self.running[trial.index].handle
        s.console.print(f"▶ trial {trial.index + 1}/{len(s.trials)} {trial.run_name} started"
                        + (f" from its checkpoint {resume}" if resume else "")
                        + f" · {self.launcher.where(handle)}", highlight=False, markup=False)

    def poll(self, stopping: Optional[str] = None) -> None:
        for index, r in list(self.running.items()):
            end = self.launcher.state(r.handle)
            if end is None:
                continue
            del self.running[index]
            out = self.settle(r, end, stopping)
            self._done(out, None if out.status == "FINISHED" else self._error(out, end))

    def settle(self, r: Running, end: End, stopping: Optional[str]) -> Outcome:
        """The ended trial's child run decides; one still RUNNING lost its process (SIGKILL, OOM,
        a crash) and is ended here: KILLED while the sweep stops, else FAILED."""
        s, trial = self.sweep, r.trial
        wall = time.perf_counter() - r.t0
        child_id = attempt_run(s.sweep_id, trial, s.records, r.resume, s.uri, r.since)
        if child_id is None:  # it ended before its run existed
            if stopping:
                return Outcome(trial, "KILLED", wall_s=wall)
            error = end.error or f"its {self.launcher.what} ended ({end.state}) before the trial's run existed"
            return Outcome(trial, "FAILED", store.record_failed_trial(s.sweep_id, trial, s.experiment, s.uri, error),
                           wall_s=wall)
        run = store.client(s.uri).get_run(child_id)
        status = run.info.status
        if status == "RUNNING":
            status = "KILLED" if stopping else "FAILED"
            store.end_child(child_id, s.uri, status, stopping or end.error
                            or f"its {self.launcher.what} ended ({end.state}) without ending the run")
        elif status == "FINISHED" and not store.trial_finished(run, s.uri):
            status = "FAILED"
            store.end_child(child_id, s.uri, status, "ended without validation metrics at its last step")
        if status == "KILLED" and store.alarm_stopped(run):
            return alarm_outcome(trial, run, wall, "own")
        if status != "FINISHED":
            return Outcome(trial, status, child_id, wall_s=wall)
        timing = store.log_trial_timing(s.sweep_id, child_id, trial.index, s.uri, r.since, wall)
        return Outcome(trial, "FINISHED", child_id, final_val({"final": run.data.metrics}), wall,
                       timing[layout.M_OVERHEAD], "own")

    def _error(self, out: Outcome, end: End) -> str:
        tags = store.client(self.sweep.uri).get_run(out.run_id).data.tags if out.run_id else {}
        return tags.get(layout.ERROR) or tags.get("stapoctl.stop_reason") or end.error or end.state

    def _done(self, out: Outcome, error: Optional[str]) -> None:
        s, trial = self.sweep, out.trial
        self.outcomes[trial.index] = out
        head = f"trial {trial.index + 1}/{len(s.trials)} {trial.run_name}"
        if out.status == "FINISHED":
            s.console.print(f"[bold green]✓[/] {escape(head)}: final val {pct(out.val)} · {out.wall_s:.1f} s · "
                            f"run {out.run_id}",
                            highlight=False)
        elif out.status == ALARM_STATUS:
            names = store.alarm_stopped(store.client(s.uri).get_run(out.run_id))
            s.console.print(alarm_line(head, out, names), highlight=False)
        else:
            s.console.print(f"[bold red]✗ {escape(head)} {out.status}[/]: {escape(str(error))}", highlight=False)

    # -- stopping ---------------------------------------------------------------------------------
    def stop_all(self, signum: int, reason: str) -> None:
        """One graceful stop each; a further signal (or the launcher's time limit) stops them at once."""
        for r in self.running.values():
            self.launcher.stop(r.handle, signum, hard=False)
        hard_at = time.monotonic() + self.launcher.stop_wait_s
        give_up: Optional[float] = None
        while self.running and (give_up is None or time.monotonic() < give_up):
            try:
                if give_up is None and time.monotonic() > hard_at:
                    raise KeyboardInterrupt
                self.poll(stopping=reason)
                time.sleep(0.5)
            except KeyboardInterrupt:
                if give_up is not None:
                    break
                self.sweep.console.print("[yellow]stopping the trials at once[/]")
                for r in self.running.values():
                    self.launcher.stop(r.handle, signum, hard=True)
                give_up = time.monotonic() + 60.0

    def interrupted(self, received: list[str]) -> int:
        """Ctrl-C / SIGTERM: stop every running trial, then no run of the sweep stays RUNNING."""
        s = self.sweep
        name = received[0] if received else "SIGINT"
        during = sorted(i + 1 for i in self.running)
        reason = f"interrupted ({name})" + (f" during trial{'s' if len(during) > 1 else ''} "
                                            f"{', '.join(map(str, during))}" if during else "")
        if self.running:
            s.console.print(f"[yellow]{name}: stopping {len(self.running)} running trial(s): each ends its step, "
                            f"writes a checkpoint and ends KILLED; {name} again stops them at once[/]")
        self.stop_all(getattr(signal, name, signal.SIGINT), reason)
        with signals_deferred():
            for run in store.children(s.sweep_id, s.uri):
                if run.info.status == "RUNNING":
                    store.end_child(run.info.run_id, s.uri, "KILLED", reason)
            store.end_parent(s.sweep_id, s.uri, "KILLED", reason)
        s.console.print(f"[yellow]sweep {s.sweep_id} {reason}: runs ended KILLED; continue with "
                        f"`stapoctl sweep {escape(s.definition.name)} resume={s.sweep_id[:8]}`[/]")
        return 143 if received else 130


def run_parallel(sweep: Sweep, todo: list[Trial], launcher: Launcher, k: int) -> int:
    """Run `todo` up to `k` at once; the parent's status and the closing table as for local trials."""
    pool = Pool(sweep, launcher)
    pending = list(todo)
    received: list[str] = []
    seen: list[str] = []  # every stop signal, also one whose KeyboardInterrupt a library call swallowed
    sweep.console.print(f"running {len(todo)} trial(s), {k} at once, as one {launcher.what} each "
                        "(Ctrl-C stops them all)", highlight=False)
    with signals_as_interrupt(received, seen):
        try:
            while pending or pool.running:
                while pending and len(pool.running) < k and not seen:
                    pool.start(pending.pop(0))
                pool.poll()
                if seen:
                    raise KeyboardInterrupt
                if pool.running:
                    time.sleep(launcher.poll_s)
        except KeyboardInterrupt:
            return pool.interrupted(received)
        except BaseException as exc:  # a bug or a lost store: stop the trials, the parent FAILED
            pool.stop_all(signal.SIGTERM, f"the sweep failed: {store.one_line(exc)}")
            store.end_parent(sweep.sweep_id, sweep.uri, "FAILED", store.one_line(exc))
            raise
    return finish(sweep.definition, sweep.sweep_id, sweep.trials, pool.outcomes, sweep.uri, sweep.console)
