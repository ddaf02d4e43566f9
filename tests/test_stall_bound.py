"""The stall bound's parts without engines (issue #49): the workers' progress board, the heartbeat a
rollout actor sends from vLLM's engine loop, and the driver's rule — a worker it waits on whose
progress stood still for `rollout.stall_timeout_s` ends the run in one line naming it; one inside a
weight push is the push's bound's; slow but moving never trips it. The chains with real engines
(a worker SIGSTOPped or SIGKILLed while generating, sync and async) are in
tests/test_weight_sync_faults.py."""

from __future__ import annotations

import time

import pytest

from stapoctl.errors import EngineFault
from stapoctl.rollout.progress import RECEIVING, Heartbeat, ProgressBoard
from stapoctl.trainer.stall import StallWatch


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Board:
    """A ProgressBoard called in-process (`.beat.remote(...)` as the heartbeat calls it)."""

    def __init__(self):
        self.real, self.calls = ProgressBoard(), 0

        def beat(*args):
            self.calls += 1
            self.real.beat(*args)

        self.beat = _Remote(beat)


def test_the_board_ages_only_what_stands_still(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    board = ProgressBoard()
    board.beat(0, 5, "generating", 11)
    board.beat(1, 0, "idle", 12)
    now[0] = 130.0
    board.beat(0, 9, "generating", 11)  # moved
    board.beat(1, 0, "idle", 12)  # the same report again: still
    seen = board.read()
    assert seen[0] == {"count": 9, "phase": "generating", "pid": 11, "still_s": 0.0}
    assert seen[1]["still_s"] == 30.0
    now[0] = 131.0
    board.beat(1, 0, RECEIVING, 12)  # a phase change is progress
    assert board.read()[1]["still_s"] == 0.0
    board.beat(1, 0, RECEIVING, 99)  # a restarted process (another pid) is too
    assert board.read()[1] == {"count": 0, "phase": RECEIVING, "pid": 99, "still_s": 0.0}


def test_the_heartbeat_counts_engine_steps_and_sends_at_most_every_interval(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    board = _Board()
    hb = Heartbeat(board, 3, every_s=0.5)

    class Engine:
        def step(self):
            return ["out"]

    class LLM:
        llm_engine = Engine()

    llm = LLM()
    hb.watch(llm)
    hb.watch(llm)  # wrapped once
    hb.phase("generating")
    assert board.calls == 1
    for _ in range(10):  # ten steps within 0.1 s: the count moves, one report at most
        now[0] += 0.01
        assert llm.llm_engine.step() == ["out"]
    assert hb.count == 10 and board.calls == 1
    now[0] += 0.5
    llm.llm_engine.step()
    assert board.calls == 2 and board.real.read()[3]["count"] == 11
    hb.phase("idle")  # at once, whatever the interval
    assert board.calls == 3 and board.real.read()[3]["phase"] == "idle"


def test_a_heartbeat_never_fails_its_worker():
    class Broken:
        class beat:  # noqa: N801
            @staticmethod
            def remote(*_):
                raise RuntimeError("board gone")

    hb = Heartbeat(Broken(), 0)
    hb.phase("generating")
    hb.tick()


class _Watch(StallWatch):
    def __init__(self, seen, timeout_s=20.0):
        super().__init__(board=None, timeout_s=timeout_s, label=lambda i: f"rollout worker {i} (pid {100 + i})")
        self.seen = seen

    def read(self):
        return self.seen


def test_a_worker_still_longer_than_the_bound_is_named_with_what_it_did():
    watch = _Watch({0: {"count": 50, "phase": "generating", "pid": 100, "still_s": 3.0},
                    1: {"count": 39, "phase": "generating", "pid": 101, "still_s": 25.0}})
    start = time.monotonic() - 30.0
    with pytest.raises(EngineFault) as err:
        watch.check({0, 1}, start, "generating the step-10 rollouts")
    line = str(err.value)
    assert line == ("rollout worker 1 (pid 101) made no progress for 25 s while generating the step-10 rollouts "
                    "(rollout.stall_timeout_s=20; its last report: generating, 39 engine steps)")
    assert watch.stalled == 1


def test_slow_but_moving_or_a_short_wait_never_trips_it():
    moving = _Watch({0: {"count": 7, "phase": "generating", "pid": 100, "still_s": 1.0}})
    moving.check({0}, time.monotonic() - 3600.0, "generating")  # an hour of waiting, but it moved a second ago
    long_idle = _Watch({0: {"count": 7, "phase": "idle", "pid": 100, "still_s": 500.0}})
    long_idle.check({0}, time.monotonic() - 5.0, "generating")  # idle long before the call: only 5 s waited
    assert moving.stalled is None and long_idle.stalled is None


def test_inside_a_push_the_push_bound_applies_and_a_silent_board_counts_as_still():
    receiving = _Watch({0: {"count": 7, "phase": RECEIVING, "pid": 100, "still_s": 500.0}})
    receiving.check({0}, time.monotonic() - 500.0, "the weight push over gloo waited for it")
    never = _Watch({})
    with pytest.raises(EngineFault, match=r"rollout worker 0 \(pid 100\) made no progress for 3\d s while "
                                          r"starting .*it never reported"):
        never.check({0}, time.monotonic() - 31.0, "starting")


def test_another_actor_is_bounded_as_a_deadline():
    watch = _Watch({})
    watch.check({None}, time.monotonic() - 5.0, "starting")
    with pytest.raises(EngineFault, match=r"the learner ranks' set-up did not finish starting within "
                                          r"rollout.stall_timeout_s=20"):
        watch.check({None}, time.monotonic() - 21.0, "starting", "the learner ranks' set-up")


def test_the_knob_is_declared_positive():
    from stapoctl.config.compose import compose_config
    from stapoctl.errors import UserError

    assert compose_config([]).rollout.stall_timeout_s == 600.0
    with pytest.raises(UserError, match=r"rollout.stall_timeout_s=0.0 must lie in \(0, inf\)"):
        compose_config(["rollout.stall_timeout_s=0"])


def test_a_board_that_does_not_answer_is_no_evidence_until_it_stays_silent_for_the_bound(monkeypatch):
    """A failed read never ends a healthy run on its own (review finding): only a board silent for
    the whole bound does, and the line says that, not that a worker stalled."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    watch = _Watch(None)
    watch.check({0}, 900.0, "generating")  # waited 100 s > 20, but nothing read: no verdict
    now[0] += 15.0
    watch.check({0}, 900.0, "generating")
    now[0] += 6.0
    with pytest.raises(EngineFault, match=r"progress board did not answer for 20 s while generating"):
        watch.check({0}, 900.0, "generating")
    assert watch.stalled is None
