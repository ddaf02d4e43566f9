"""A local parallel trial never outlives its sweep: `python -m stapoctl.sweep.orphans PPID CMD…`
runs CMD (the trial's `stapoctl train`) so that it gets SIGTERM the moment the sweep process
PPID dies, even by SIGKILL. The trainer treats that SIGTERM as any stop: it ends its step, writes
a checkpoint, ends its run KILLED and shuts its own Ray down, so no child run stays RUNNING and
no process is left behind; `stapoctl sweep NAME resume=ID` then continues the trial from it.

Why the kernel's parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`), set here and kept
across the `exec` of CMD (same pid: the sweep still watches and signals the trial itself), rather
than the trainer polling `os.getppid()`: it needs no code in the trainer (the same for every
command a launcher starts, test stand-ins included), no thread that a busy step could starve,
and it fires at once. Where there is no prctl, this process stays as CMD's parent and polls.

The kernel sends that signal each time it reparents CMD — once per thread of the dying sweep it
passes through — so one death is a burst of SIGTERMs within milliseconds; the trainer takes a
repeat that close as the same stop (`trainer/signals.py`), not as a person's second one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def _set_pdeathsig(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def command(parent_pid: int, cmd: list[str]) -> list[str]:
    """CMD wrapped so that it is stopped when `parent_pid` dies."""
    return [sys.executable, "-m", "stapoctl.sweep.orphans", str(parent_pid), *cmd]


def main(argv: list[str]) -> int:
    parent, cmd = int(argv[0]), argv[1:]
    if _set_pdeathsig(signal.SIGTERM):
        if os.getppid() != parent:  # the sweep died before the signal was armed
            return 128 + signal.SIGTERM
        os.execvp(cmd[0], cmd)  # never returns: CMD has this pid, and the armed signal
    proc = subprocess.Popen(cmd)  # no prctl: watch the parent from here
    for s in (signal.SIGINT, signal.SIGTERM):  # the sweep's stop goes on to CMD
        signal.signal(s, lambda signum, frame: proc.send_signal(signum))
    while proc.poll() is None:
        if os.getppid() != parent:
            proc.send_signal(signal.SIGTERM)
            return proc.wait()
        time.sleep(0.5)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
