"""Stopping a run on a signal without losing it: SIGTERM (kill, scancel, a container stop),
SIGINT (Ctrl-C) and SIGUSR1 (SLURM's warning before the time limit, `--signal=USR1@300`).

The first signal asks the loop to stop at the end of the step in progress. A step cannot be
checkpointed halfway (the learner may be inside its update), so the wait is bounded by the rest
of one step plus one checkpoint write; the console says how long the last step took. Then the
checkpoint is written, the MLflow run ends KILLED (tag `stapoctl.stop_reason`), the engines
shut down (vLLM before Ray, so no /dev/shm segment outlives them) and the process exits with
128 + the signal number (143, 130, 138). A second signal aborts at once: no new checkpoint
(a resume continues from the previous one), but the clean-up still runs, so the run is not
left RUNNING. Before the first step (engines starting) there is nothing to finish: the first
signal aborts.

The same signal again within `SAME_STOP_S` of the first is that stop, not a second one: when a
sweep that started this trainer dies, the kernel sends the parent-death signal (`sweep/orphans.py`)
once per thread of the dying sweep the trainer is reparented through — up to 8 SIGTERMs within a
few ms here (tests/test_sweep_orphans.py). A person's second Ctrl-C comes later than that; the
console says so when a repeat is absorbed.

Ray's `ray.init` installs its own SIGTERM handler (it exits the process); `install()` is
called again once the engines are up so ours stays in charge.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Optional

from stapoctl.errors import RunStopped

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
SAME_STOP_S = 1.0  # a repeat of the first signal sooner than this is the same stop (module docstring)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class GracefulStop:
    """Signal handlers for one run (main thread only; elsewhere it is inert)."""

    def __init__(self, console: Any = None):
        self.console = console
        self.requested: Optional[int] = None  # the first signal received
        self.aborted = False
        self.in_loop = False  # steps are running: the first signal waits for the step's end
        self.cleaning_up = False
        self.step = 0
        self.last_step_s = 0.0
        self.received_at: Optional[float] = None
        self._absorbed = False  # a repeat within SAME_STOP_S was said once
        self._previous: dict[int, Any] = {}

    # -- installation -----------------------------------------------------------------------
    def __enter__(self) -> "GracefulStop":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            current = signal.getsignal(sig)
            if current is not self._handle:
                self._previous.setdefault(sig, current)
                signal.signal(sig, self._handle)

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous.items():
            try:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            except (TypeError, ValueError):
                pass
        self._previous.clear()

    # -- what the loop asks ---------------------------------------------------------------------
    def step_done(self, step: int, seconds: float) -> None:
        self.step, self.last_step_s = step, seconds

    def stopped(self, message: str) -> RunStopped:
        return RunStopped(message, self.requested or signal.SIGTERM)

    # -- the handler ----------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.console is not None:
            try:
                self.console.print(text, style="yellow", markup=False, highlight=False)
            except Exception:
                pass

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal_name(signum)
        if self.cleaning_up:
            self._say(f"{name}: already stopping; cleaning up the engines (bounded by their shutdown timeouts)")
            return
        if self.requested is None and self.in_loop:
            self.requested, self.received_at = signum, time.monotonic()
            self._say(f"{name}: stopping after step {self.step + 1} (the last step took {self.last_step_s:.1f} s), "
                      f"then a checkpoint and exit; {name} again (a second or more later) aborts at once without it")
            return
        if (signum == self.requested and self.received_at is not None and not self.aborted
                and time.monotonic() - self.received_at < SAME_STOP_S):
            if not self._absorbed:
                self._absorbed = True
                self._say(f"{name} again within {SAME_STOP_S:.0f} s: the same stop (send it again later to abort)")
            return
        self.requested = self.requested or signum
        self.aborted = True
        self.cleaning_up = True
        where = f"during step {self.step + 1}" if self.in_loop else "before the first step"
        raise RunStopped(f"{name}: aborted {where}", self.requested)
