"""Parallel, deadline-bounded answer checking, and `is_equivalent` on top of it.

A persistent set of verifier subprocesses (`verify_server`) checks answers in parallel. Each
check has a hard wall-clock limit enforced by the parent, which kills a stuck child and starts
a replacement: this works from any thread and inside Ray actors, unlike math-verify's
SIGALRM timeout (main thread only; elsewhere it silently never fires). A check that crashes its
child (segfault, out of memory, any exit) or raises inside it is a verify error: that answer
scores incorrect, is counted (`reward/verify_errors`), the child is replaced and the batch goes on.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from stapoctl.reward.equivalence import DEFAULT_TIMEOUT_S, equivalent_unbounded, quick_verdict
from stapoctl.reward.lists import check_kind

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
_READY_TIMEOUT_S = 180.0  # importing sympy on a busy 2-core machine can take a while


class _Child:
    """One verifier subprocess and its line-buffered reply stream."""

    def __init__(self, max_memory_gb: float):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["STAPOCTL_VERIFY_MAX_GB"] = str(max_memory_gb)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "stapoctl.reward.verify_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.buffer = b""
        self.ready = False
        self.started = time.monotonic()
        self.task: int | None = None  # index of the check in flight
        self.deadline = 0.0

    def send(self, index: int, pred: str, ref: str, kind: str | None, timeout_s: float) -> bool:
        """Hand one check to the child; False when it has died meanwhile (the pipe is closed)."""
        self.task = index
        self.deadline = time.monotonic() + timeout_s
        request = {"id": index, "pred": pred, "ref": ref, "kind": kind}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # BrokenPipeError: the crash shows up here before the read sees EOF
            return False
        return True

    def read_lines(self) -> list[dict]:
        chunk = os.read(self.fd, 65536)
        if not chunk:
            raise RuntimeError(f"verifier subprocess exited (code {self.proc.poll()})")
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class EquivalenceChecker:
    """N verifier subprocesses with a per-check deadline; thread-safe; started lazily."""

    def __init__(self, num_workers: int = 2, max_memory_gb: float = 4.0):
        self.num_workers = max(1, int(num_workers))
        self.max_memory_gb = max_memory_gb
        self.timeouts = 0  # totals over the checker's life
        self.errors = 0
        self.restarts = 0
        self._early_deaths = 0  # children that died before saying ready, in a row
        self._children: list[_Child] = []
        self._lock = threading.Lock()

    def _ensure_children(self) -> None:
        self._children = [c for c in self._children if c.proc.poll() is None]
        while len(self._children) < self.num_workers:
            self._children.append(_Child(self.max_memory_gb))

    def check(self, predicted: str, reference: str, timeout_s: float = DEFAULT_TIMEOUT_S,
              kind: str | None = None) -> tuple[bool, bool]:
        """(equivalent, timed_out) for one pair."""
        return self.check_many([(predicted, reference)], timeout_s, [kind])[0]

    def check_many(
        self, pairs: Sequence[tuple[str, str]], timeout_s: float = DEFAULT_TIMEOUT_S,
        kinds: Sequence[str | None] | None = None,
    ) -> list[tuple[bool, bool]]:
        """(equivalent, timed_out) per pair; a check past `timeout_s` counts as not equivalent."""
        return [(ok, timed_out) for ok, timed_out, _ in self.check_detailed(pairs, timeout_s, kinds)]

    def check_detailed(
        self, pairs: Sequence[tuple[str, str]], timeout_s: float = DEFAULT_TIMEOUT_S,
        kinds: Sequence[str | None] | None = None,
    ) -> list[tuple[bool, bool, bool]]:
        """(equivalent, timed_out, error) per pair; a timed-out or crashed check is not equivalent.

        `kinds`: each gold's answer kind (`reward.lists`: how a bare list gold compares; None
        or left out: the gold's form decides)."""
        kinds = list(kinds) if kinds is not None else [None] * len(pairs)
        if len(kinds) != len(pairs):
            raise ValueError(f"{len(kinds)} answer kinds for {len(pairs)} pairs")
        results: list[tuple[bool, bool, bool] | None] = [None] * len(pairs)
        pending = []
        for i, ((pred, ref), kind) in enumerate(zip(pairs, kinds)):
            quick = quick_verdict(pred, ref, check_kind(kind))
            if quick is None:
                pending.append(i)
            else:
                results[i] = (quick, False, False)
        if pending:
            with self._lock:
                self._run(pairs, kinds, pending, results, timeout_s)
        return results  # type: ignore[return-value]

    def _run(self, pairs, kinds: list, pending: list[int], results: list, timeout_s: float) -> None:
        self._ensure_children()
        queue = list(reversed(pending))
        while queue or any(c.task is not None for c in self._children):
            for child in list(self._children):
                if child.ready and child.task is None and queue:
                    i = queue.pop()
                    if not child.send(i, pairs[i][0], pairs[i][1], kinds[i], timeout_s):
                        self.errors += 1
                        self._replace(child, results, error=True)
            now = time.monotonic()
            waits = [c.deadline - now for c in self._children if c.task is not None]
            waits += [c.started + _READY_TIMEOUT_S - now for c in self._children if not c.ready]
            readable, _, _ = select.select([c.fd for c in self._children], [], [], max(0.0, min(waits)))
            for child in list(self._children):
                if child.fd in readable:
                    try:
                        messages = child.read_lines()
                    except RuntimeError:
                        messages = None
                    if messages is None:  # died (segfault, out of memory, exit): the check in flight fails
                        if not child.ready:
                            self._died_starting(child)
                        elif child.task is not None:
                            self.errors += 1
                        self._replace(child, results, error=True)
                        continue
                    for msg in messages:
                        if msg.get("ready"):
                            child.ready = True
                            self._early_deaths = 0
                        elif msg.get("id") == child.task:
                            error = bool(msg.get("error"))
                            self.errors += error
                            results[child.task] = (bool(msg["ok"]) and not error, False, error)
                            child.task = None
            now = time.monotonic()
            for child in list(self._children):
                if child.task is not None and now > child.deadline:
                    self.timeouts += 1
                    self._replace(child, results, timed_out=True)
                elif not child.ready and now > child.started + _READY_TIMEOUT_S:
                    child.kill()
                    raise RuntimeError(
                        f"verifier subprocess did not start within {_READY_TIMEOUT_S:.0f}s "
                        f"({sys.executable} -m stapoctl.reward.verify_server)"
                    )

    def _died_starting(self, child: _Child) -> None:
        """A child that dies before it is ready is a broken setup, not a bad answer: say so."""
        self._early_deaths += 1
        if self._early_deaths >= 3:
            child.kill()
            self._children.remove(child)
            raise RuntimeError(
                f"verifier subprocess exited during start-up {self._early_deaths} times in a row (code "
                f"{child.proc.returncode}): run `{sys.executable} -m stapoctl.reward.verify_server` to see why"
            )

    def _replace(self, child: _Child, results: list, timed_out: bool = False, error: bool = False) -> None:
        if child.task is not None:
            results[child.task] = (False, timed_out, error)
        child.kill()
        self._children.remove(child)
        self._children.append(_Child(self.max_memory_gb))
        self.restarts += 1

    def close(self) -> None:
        """Stop every subprocess (also done at interpreter exit)."""
        for child in self._children:
            child.kill()
        self._children = []

    def __getstate__(self):  # ship the settings, not the processes, into Ray actors
        return {"num_workers": self.num_workers, "max_memory_gb": self.max_memory_gb}

    def __setstate__(self, state):
        self.__init__(**state)


_shared: EquivalenceChecker | None = None
_shared_lock = threading.Lock()


def shared_checker() -> EquivalenceChecker:
    """The process-wide single-worker checker behind `is_equivalent` (started on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = EquivalenceChecker(num_workers=1)
            atexit.register(_shared.close)
        return _shared


def is_equivalent(predicted: str | None, reference: str, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                  kind: str | None = None) -> bool:
    """Whether a predicted final answer matches the reference (False on timeout).

    String-decidable cases return at once; the rest go to a shared verifier subprocess with a
    hard `timeout_s` deadline (timeout_s=None: in-process, no limit). `kind`: the reference's
    answer kind (scalar / multiset / tuple; None: the reference's form decides).
    """
    quick = quick_verdict(predicted, reference, check_kind(kind))
    if quick is not None:
        return quick
    if timeout_s is None:
        return equivalent_unbounded(predicted, reference, kind)
    verdict, _timed_out = shared_checker().check(predicted or "", reference, timeout_s, kind)
    return verdict
