"""Signals in a sweep's trial loop: SIGTERM unwinds like Ctrl-C, and both wait while the
runs' statuses are written, so no run is left RUNNING."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


@contextlib.contextmanager
def signals_as_interrupt(received: list[str], seen: list[str] | None = None):
    """SIGTERM (a scheduler's stop) unwinds like Ctrl-C, so the same code ends the runs KILLED;
    `received` gets the signal's name. `seen` (optional) gets every SIGINT and SIGTERM, for a loop
    to check: a KeyboardInterrupt raised inside a library call that swallows it would otherwise
    lose the stop (a parallel sweep under load once ran its trials to the end after a Ctrl-C)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        received.append(signal.Signals(signum).name)
        if seen is not None:
            seen.append(received[-1])
        raise KeyboardInterrupt

    def on_int(signum, frame):
        seen.append("SIGINT")
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.signal(signal.SIGINT, on_int) if seen is not None else None
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)


@contextlib.contextmanager
def signals_deferred(replay: bool = False):
    """Hold SIGINT/SIGTERM for the few ms it takes to write the runs' statuses. `replay`: a
    signal that came meanwhile is delivered again once the block is done (a trial being started
    is then known, and stopped with the others, instead of left running unseen)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if replay and pending:
            os.kill(os.getpid(), pending[0])
