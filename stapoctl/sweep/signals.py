"""Signals in a sweep's trial loop: SIGTERM unwinds like Ctrl-C, and both wait while the
runs' statuses are written, so no run is left RUNNING."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


@contextlib.contextmanager
def signals_as_interrupt(received: list[str]):
    """SIGTERM (a scheduler's stop) unwinds like Ctrl-C, so the same code ends the runs KILLED;
    `received` gets the signal's name."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        received.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)


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
