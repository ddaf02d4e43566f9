"""The driver's bounds on a weight push and on a lost rollout actor, with stand-in actors (`ray.wait` and
`ray.get` replaced; no Ray, no engine) — issue #49:

- R1: an asynchronous push queued behind a rollout step longer than `rollout.weight_sync_timeout_s`
  is not declared stalled: the learners' sends wait until the progress board shows every worker
  inside its receive, and the bound counts from them; a worker still inside its receive after the
  bound is named; one that stalls while generating is the stall bound's, and nothing is sent.
- R8: a CUDA IPC push (the learner ranks make the workers' calls) that times out names the worker
  that does not answer, not every learner rank.
- BUG-1 (T1): in async mode with a linked transport, a rollout actor that died while generating is
  named at once by the call it lost, without asking the live ones (which may sit in a queued push).

Real-engine chains: tests/test_weight_sync_faults.py."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest
import ray

from stapoctl.errors import EngineFault
from stapoctl.rollout.progress import RECEIVING
from stapoctl.sync.transfer import DeferredSends, WeightSync
from stapoctl.trainer.stall import StallWatch


class Ref:
    """A stand-in object ref: `state()` is None while pending, else ("ok", value) or ("err", exc)."""

    def __init__(self, state: Callable[[], Optional[tuple]]):
        self.state = state


def done(value: Any = None) -> Ref:
    return Ref(lambda: ("ok", value))


def never() -> Ref:
    return Ref(lambda: None)


def fake_wait(refs, num_returns=1, timeout=None):
    end = time.monotonic() + (3600.0 if timeout is None else timeout)
    while True:
        ready = [r for r in refs if r.state() is not None][:num_returns]
        if len(ready) >= num_returns or time.monotonic() >= end:
            return ready, [r for r in refs if not any(r is x for x in ready)]
        time.sleep(0.005)


def fake_get(ref, timeout=None):
    if isinstance(ref, list):
        return [fake_get(r, timeout) for r in ref]
    got = fake_wait([ref], timeout=timeout)[0]
    if not got:
        raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")
    kind, value = ref.state()
    if kind == "err":
        raise value
    return value


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch):
    monkeypatch.setattr(ray, "wait", fake_wait)
    monkeypatch.setattr(ray, "get", fake_get)


class Call:
    def __init__(self, fn):
        self.remote = fn


class Sim:
    """Two rollout workers of an "engine" push: worker i generates until `enter[i]` seconds, then
    sits in its receive, which ends `transfer_s` after the learner's send (never for a `stuck` one;
    with an error for one that `dies` at that time). `stall_from[i]`: its engine steps stop then."""

    def __init__(self, enter: dict, stuck=(), dies: Optional[dict] = None, stall_from: Optional[dict] = None,
                 transfer_s: float = 0.05):
        self.enter, self.stuck, self.dies, self.stall_from = enter, set(stuck), dies or {}, stall_from or {}
        self.transfer_s, self.t0 = transfer_s, time.monotonic()
        self.sent_at: Optional[float] = None
        self.board_at_send: Optional[dict] = None
        self.workers = [SimpleNamespace(receive_weights=Call(lambda info, i=i: Ref(lambda: self._received(i))))
                        for i in sorted(enter)]
        self.learners = [SimpleNamespace(init_weight_transfer=Call(lambda *a, **k: done()),
                                         transfer_update_info=Call(lambda: done({"names": []})),
                                         send_weights=Call(self._send))]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def board(self) -> dict:
        out = {}
        for i, at in self.enter.items():
            if self.now() >= at and i not in self.dies:
                out[i] = {"count": 40, "phase": RECEIVING, "pid": 100 + i, "still_s": self.now() - at}
            else:
                still = max(0.0, self.now() - self.stall_from.get(i, float("inf")))
                out[i] = {"count": 40, "phase": "generating", "pid": 100 + i, "still_s": still}
        return out

    def _received(self, i: int) -> Optional[tuple]:
        if i in self.dies and self.now() >= self.dies[i]:
            return "err", ray.exceptions.ActorDiedError()
        if i in self.stuck or self.sent_at is None or self.now() < max(self.sent_at, self.enter[i]) + self.transfer_s:
            return None
        return "ok", {"sync_load_s": self.transfer_s}

    def _send(self) -> Ref:
        self.sent_at, self.board_at_send = self.now(), self.board()
        return Ref(lambda: ("ok", 0.0) if all(self._received(i) for i in self.enter) else None)


class Watch(StallWatch):
    """The driver's stall bound, reading the simulated board."""

    def __init__(self, sim: Sim, timeout_s: float):
        super().__init__(board=None, timeout_s=timeout_s)
        self.sim, self.reads = sim, 0

    def read(self):
        self.reads += 1
        return self.sim.board()


def engine_sync(sim: Sim, timeout_s: float, stall_s: float = 30.0, board: bool = True) -> WeightSync:
    sync = WeightSync(sim.learners, sim.workers, "gloo", timeout_s=timeout_s)
    if board:
        watch = Watch(sim, stall_s)
        sync.progress_check = lambda waiting, start: watch.check(waiting, start, "the weight push over gloo waited for it")
        sync.receiving = watch.receiving
        sync.watch = watch
    return sync


def test_a_push_queued_behind_a_rollout_longer_than_its_bound_is_not_stalled():
    sim = Sim(enter={0: 0.2, 1: 2.5})  # worker 1's rollout: 2.5 s; the push's bound: 1 s; the transfer: 0.05 s
    sync = engine_sync(sim, timeout_s=1.0)
    sync.push_async()
    assert sim.sent_at is None  # nothing sent while the workers generate
    sync.wait()
    assert sim.now() > 2.5 > sync.timeout_s  # it waited behind the rollout, longer than the bound
    assert all(seen["phase"] == RECEIVING for seen in sim.board_at_send.values())  # sent once both received
    assert not sync.broken


def test_without_a_board_the_bound_still_counts_from_the_push():
    """Today's behaviour where nothing can see the workers' progress: the same push is declared stalled."""
    sim = Sim(enter={0: 0.2, 1: 2.5})
    sync = engine_sync(sim, timeout_s=1.0, board=False)
    sync.push_async()
    assert sim.sent_at is not None  # sent at once
    with pytest.raises(EngineFault, match=r"within rollout.weight_sync_timeout_s=1: rollout worker 1 stopped "
                                          r"answering mid-push \(waiting on it: learner rank 0\)"):
        sync.wait()


def test_a_worker_still_receiving_after_the_bound_is_named():
    sim = Sim(enter={0: 0.1, 1: 0.2}, stuck={1})
    sync = engine_sync(sim, timeout_s=0.5)
    sync.push_async()
    with pytest.raises(EngineFault) as err:
        sync.wait()
    assert str(err.value) == ("the weight sync over gloo did not finish within rollout.weight_sync_timeout_s=0.5: "
                              "rollout worker 1 stopped answering mid-push (waiting on it: learner rank 0)")
    assert sim.sent_at is not None and sync.broken


def test_a_worker_stalled_before_its_receive_is_the_stall_bounds_and_nothing_is_sent():
    sim = Sim(enter={0: 0.1, 1: 3600.0}, stall_from={1: 0.0})  # worker 1's engine steps never move
    sync = engine_sync(sim, timeout_s=60.0, stall_s=0.5)
    sync.push_async()
    with pytest.raises(EngineFault, match=r"rollout worker 1 made no progress for \d+ s while the weight push over "
                                          r"gloo waited for it \(rollout.stall_timeout_s=0.5; its last report: "
                                          r"generating, 40 engine steps\)"):
        sync.wait()
    assert sync.broken
    sim.enter[1] = 0.0  # it shows up inside its receive after all: the abandoned push stays unsent
    time.sleep(3 * DeferredSends.POLL_S)
    assert sim.sent_at is None


def test_a_worker_that_dies_before_the_sends_is_named_and_nothing_is_sent():
    sim = Sim(enter={0: 0.1, 1: 3600.0}, dies={1: 0.3})
    sync = engine_sync(sim, timeout_s=60.0)
    sync.push_async()
    with pytest.raises(EngineFault, match=r"^rollout worker 1 died during the weight sync over gloo .*"
                                          r"weight_sync=gloo cannot re-link a new vLLM process$"):
        sync.wait()
    assert sim.sent_at is None and sync.broken


def test_a_push_abandoned_by_the_shutdown_of_a_run_ending_elsewhere_sends_nothing():
    """A stall in the rollouts, a scorer error or Ctrl-C ends the run while a push is held back:
    `Engines.shutdown` abandons it, so no send reaches learners that are being shut down."""
    sim = Sim(enter={0: 0.1, 1: 0.6})
    sync = engine_sync(sim, timeout_s=60.0)
    sync.push_async()
    sync.abandon()
    time.sleep(0.6 + 3 * DeferredSends.POLL_S)  # both workers inside their receive by now
    assert sim.sent_at is None


def test_a_synchronous_push_sends_at_once_and_reads_no_board():
    sim = Sim(enter={0: 0.0, 1: 0.0})
    sync = engine_sync(sim, timeout_s=5.0)
    out = sync.push()
    assert sim.sent_at is not None and sync.watch.reads == 0
    assert out["timing_s/sync_load"] == sim.transfer_s


# -- R8: CUDA IPC -------------------------------------------------------------------------------
def ipc_sync(learner_ref: Callable[[], Ref], answers: dict, timeout_s: float) -> WeightSync:
    workers = [SimpleNamespace(info=Call(lambda i=i: done({"pid": 100 + i}) if answers[i] else never()))
               for i in sorted(answers)]
    learners = [SimpleNamespace(init_weight_transfer=Call(lambda *a, **k: done()), send_weights=Call(learner_ref))
                for _ in range(2)]
    return WeightSync(learners, workers, "ipc", timeout_s=timeout_s)


def test_an_ipc_push_that_times_out_names_the_worker_that_does_not_answer():
    sync = ipc_sync(never, {0: True, 1: False, 2: True}, timeout_s=0.3)
    with pytest.raises(EngineFault) as err:
        sync.push_async()  # synchronous: waited for here
    assert str(err.value) == ("the weight sync over ipc did not finish within rollout.weight_sync_timeout_s=0.3: "
                              "rollout worker 1 stopped answering mid-push (waiting on it: learner rank 0, "
                              "learner rank 1)")


def test_an_ipc_push_whose_learner_side_times_out_first_names_the_worker():
    timed_out = Ref(lambda: ("err", ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")))
    refs = iter([timed_out, never()])
    sync = ipc_sync(lambda: next(refs), {0: False, 1: True}, timeout_s=0.3)
    with pytest.raises(EngineFault, match=r"^rollout worker 0 stopped answering mid-push over ipc \(learner rank 0's "
                                          r"side gave up first: Get timed out"):
        sync.push()


def test_an_ipc_push_whose_workers_all_answer_still_names_the_learner_ranks():
    sync = ipc_sync(never, {0: True, 1: True}, timeout_s=0.3)
    with pytest.raises(EngineFault, match=r"rollout.weight_sync_timeout_s=0.3: learner rank 0, learner rank 1 "
                                          r"stopped answering mid-push$"):
        sync.push()


# -- BUG-1 (T1): a rollout actor lost mid-generation under a linked transport ----------------------
def test_a_worker_lost_while_generating_is_named_at_once_without_asking_the_live_ones(monkeypatch):
    from stapoctl.trainer import engines as engines_mod
    from stapoctl.trainer.engines import Engines

    clock = [1000.0]

    def sleep(s):
        clock[0] += s

    monkeypatch.setattr(engines_mod, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep,
                                                             perf_counter=time.perf_counter, time=time.time))

    def get(ref, timeout=None):  # a wait on a pending ref takes its whole timeout, on the stand-in clock
        if not isinstance(ref, list) and ref.state() is None:
            sleep(timeout or 0.0)
            raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")
        return fake_get(ref, timeout)

    monkeypatch.setattr(ray, "get", get)
    asked = []

    def info(i):
        asked.append(i)
        return never()  # worker 0's `info` is queued behind a receive that waits for the dead worker

    workers = [SimpleNamespace(info=Call(lambda i=i: info(i))) for i in range(4)]
    sync = SimpleNamespace(method="nccl", broken=False)
    engines = Engines(workers=workers, learners=[], sync=sync, placement=None, worker_pids=[100, 101, 102, 103],
                      restart_timeout_s=600.0, stall=StallWatch(board=None, timeout_s=600.0))
    refs = [done("rollout 0"), done("rollout 1"), Ref(lambda: ("err", ray.exceptions.ActorDiedError())),
            done("rollout 3")]
    jobs = [(i, f"prompts {i}") for i in range(4)]
    with pytest.raises(EngineFault) as err:
        engines.gather_rollouts(refs, lambda w, payload: pytest.fail("re-sent a rollout"), jobs)
    line = str(err.value)
    assert line.startswith("rollout worker 2 (pid 102) died while generating and weight_sync=nccl cannot re-link "
                           "a new vLLM process"), line
    assert "rollout worker 0" not in line
    assert asked == [] and clock[0] == 1000.0  # no live worker asked, nothing waited for
    assert sync.broken  # the live peers may sit in the next push: shut down without the 60 s grace
