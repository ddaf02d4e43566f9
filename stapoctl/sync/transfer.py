"""Learner → every rollout actor, after each step, by the transport `sync.transports` registers
under the run's `rollout.weight_sync` (auto: picked from the hardware).

The driver's strategies (`PUSHES`), named by each transport:
- "object_store" (CPU): the learner's rank 0 puts its named tensors into Ray's object store once;
  every rollout actor reads them (zero-copy on the same node) and loads them in place through the
  vLLM worker extension. Nothing is written to disk.
- "engine" (gloo, NCCL): vLLM's weight-transfer engines, linked once (`init_weight_transfer` on
  every learner rank). Each push queues one `receive_weights` call on every rollout actor — from
  the driver, so it runs after the rollouts the driver sent before (Ray orders calls per caller)
  and before any sent after — then every learner rank's `send_weights`. An asynchronous push
  holds the sends back until every worker is inside its receive (`DeferredSends`).
- "engine_learner_driven" (CUDA IPC): the learner makes the actors' update call itself (its IPC
  handles exist only once it shares its tensors), so a push is always waited for.

Every wait on a push is bounded by `rollout.weight_sync_timeout_s` (`collect`), counted from when
the learner ranks' sends begin: it bounds the transfer, not the rollouts queued before it on an
actor (an asynchronous push waits behind whole rollout steps at `trainer.max_staleness` >= 2;
those are the stall bound's, `rollout.stall_timeout_s`). Neither PyNccl's broadcast nor vLLM's
NCCL worker engine has a timeout of its own, so the driver's is the bound. A transport that cannot
re-link a new vLLM process (`relinks=False`) turns an actor that died or stopped answering mid-push
into one `EngineFault` line naming it, its node and the transport; the object store leaves a
death to the driver's restart-and-re-push (`trainer.engines`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from stapoctl.errors import EngineFault
from stapoctl.sync.transports import choose_method, transport

__all__ = ["WeightSync", "choose_method", "PUSHES"]

# The one place the learner ranks' handles are called directly rather than through the driver's
# `learner.group.LearnerGroup`: sync/ lies below learner/ and cannot import it, and a push pairs each
# of its refs with the actor that made it (`roles`: who a stalled or failed send is named as).


class ObjectStorePush:
    synchronous = False

    def __init__(self, learners: Sequence[Any], workers: Sequence[Any], method: str, link: dict):
        self.learners = list(learners)

    def start(self, workers: Sequence[Any]) -> list:
        """The loads, queued on each actor behind its earlier calls; rank > 0's `weights` call joins
        ZeRO-3's gather and returns nothing."""
        refs = [lrn.weights.remote() for lrn in self.learners]
        return [w.update_weights.remote(refs[0]) for w in workers] + refs[1:]

    def roles(self, workers: Sequence[Any]) -> list[tuple[str, Any]]:
        """(role, actor) of each ref `start` returns, in order."""
        return [("rollout", w) for w in workers] + [("learner", lrn) for lrn in self.learners[1:]]


class EnginePush:
    synchronous = False
    defers = True  # an asynchronous push may hold its sends back (`DeferredSends`)

    def __init__(self, learners: Sequence[Any], workers: Sequence[Any], method: str, link: dict):
        import ray

        self.learners, self.workers = list(learners), list(workers)
        # the rendezvous is bounded by the link's own timeout (rank 0's wait on both ends); the driver's a little later
        try:
            ray.get([lrn.init_weight_transfer.remote(method, self.workers, **link) for lrn in self.learners],
                    timeout=float(link["timeout_s"]) + 60.0)
        except ray.exceptions.GetTimeoutError:
            raise EngineFault(f"the weight link over {method} did not come up within rollout.weight_sync_timeout_s="
                              f"{float(link['timeout_s']):g} (+60 s): a learner rank or vLLM worker is stuck in its "
                              "rendezvous (check the nodes' network: cluster.socket_ifname)") from None
        self.update_info = self.fixed_update_info()

    def fixed_update_info(self):
        """What every actor's queued call receives: names, dtypes, shapes (fixed for the link's life)."""
        import ray

        return ray.get(self.learners[0].transfer_update_info.remote())

    def start(self, workers: Sequence[Any]) -> list:
        return self.receive() + self.send()

    def receive(self) -> list:
        """Each actor's whole update, queued behind the calls the driver sent it before."""
        return [w.receive_weights.remote(self.update_info) for w in self.workers]

    def send(self) -> list:
        return [lrn.send_weights.remote() for lrn in self.learners]

    def roles(self, workers: Sequence[Any]) -> list[tuple[str, Any]]:
        return [("rollout", w) for w in self.workers] + [("learner", lrn) for lrn in self.learners]


class DeferredSends:
    """An asynchronous push's sends, issued once every rollout worker is inside its receive (the
    progress board says "receiving weights"), from a thread that reads the board every `POLL_S` (~1 ms a read).

    At `trainer.max_staleness` >= 2 a worker's receive is queued behind a whole rollout step; sent
    at once, the learner ranks would wait in the collective for it (gloo's group timeout, ZeRO-3's
    gathers) and the push's bound would measure the queue. A worker that starts receiving before
    the others waits inside its receive for the sends, as it always waited for the slowest worker
    to join: NCCL has no timeout there, and gloo's (`timeout_s`, from its own start) fails only if
    one step's rollouts end more than `timeout_s` apart on two workers — then its receive fails and
    `collect` names it. A receive that ends before the sends has failed (a broadcast needs every
    worker): nothing is sent to a group missing a member, and `collect` names it."""

    POLL_S = 0.05  # the sends wait for it: at max_staleness 1 on CPU a step is ~0.25 s

    def __init__(self, push: EnginePush, received: list, receiving: Callable[[], Optional[set]]):
        self.push, self.received, self.receiving = push, received, receiving
        self.refs: list = []
        self.sent_at: Optional[float] = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()  # sent, or given up
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="stapoctl-push-sends", daemon=True).start()

    def _run(self) -> None:
        try:
            while not self.done.wait(self.POLL_S):  # first read after a poll: the last push's "idle" is in
                self.poll()
        except BaseException as exc:  # Ray gone or a learner handle unusable: collect raises it
            self.error = exc
            self.cancel()

    def poll(self) -> None:
        import ray

        if ray.wait(self.received, num_returns=1, timeout=0)[0]:
            self.cancel()
            return
        inside = self.receiving()
        if inside is None or not set(range(len(self.received))) <= inside:
            return
        with self._lock:
            if not self.done.is_set():
                self.refs, self.sent_at = self.push.send(), time.monotonic()
                self.done.set()

    def cancel(self) -> None:
        """No send after this returns (a failed push is abandoned, its actors shut down)."""
        with self._lock:
            self.done.set()


class LearnerDrivenPush(EnginePush):
    synchronous = True
    defers = False

    def fixed_update_info(self):
        return None  # the learner builds each update (CUDA IPC handles) and sends it itself

    def start(self, workers: Sequence[Any]) -> list:
        return [lrn.send_weights.remote() for lrn in self.learners]

    def roles(self, workers: Sequence[Any]) -> list[tuple[str, Any]]:
        return [("learner", lrn) for lrn in self.learners]


PUSHES = {"object_store": ObjectStorePush, "engine": EnginePush, "engine_learner_driven": LearnerDrivenPush}


class WeightSync:
    """`link`: what a linked transport needs besides the actors (`tp_size`, `timeout_s`). `timeout_s`
    also bounds every wait on a push. `name_actor(role, index)`: how a stalled or dead actor is named
    in the line (the driver gives pid and node)."""

    def __init__(self, learners: Sequence[Any], workers: Sequence[Any], method: str, *, tp_size: int = 1,
                 timeout_s: float = 1800.0, name_actor: Optional[Callable[[str, int], str]] = None):
        self.learners, self.workers, self.method = list(learners), list(workers), method
        self.timeout_s = float(timeout_s)
        self.name_actor = name_actor or (lambda role, i: f"{'rollout worker' if role == 'rollout' else 'learner rank'} {i}")
        self.broken = False  # a push failed: actors may sit in a collective; shut them down without waiting
        # (rollout worker indices not done, wait start) → raises for one whose progress stood still before it
        # began receiving (the driver's stall bound, trainer/stall.py); inside the receive, timeout_s applies
        self.progress_check: Optional[Callable[[set, float], None]] = None
        # () → the rollout worker indices the progress board shows inside a push (None: no reading);
        # set, an asynchronous "engine" push holds its sends back until every worker is (`DeferredSends`)
        self.receiving: Optional[Callable[[], Optional[set]]] = None
        self._inflight: list = []
        self._inflight_roles: list = []
        self._deferred: Optional[DeferredSends] = None
        link = {"tp_size": int(tp_size), "timeout_s": self.timeout_s}
        self._push = PUSHES[transport(method).push](self.learners, self.workers, method, link)

    def _start(self, workers: Sequence[Any]) -> tuple[list, list]:
        return self._push.start(workers), self._push.roles(workers)

    def push_async(self) -> None:
        """Start a push and return at once (asynchronous training): the load queues behind the
        rollouts already sent to each actor, so they finish with the weights they started with.
        `wait()` collects it (errors surface there); a new push waits for the previous one. With
        the progress board (`receiving`), an "engine" push's sends wait for every worker's receive."""
        self.wait()
        if getattr(self._push, "defers", False) and self.receiving is not None:
            received = self._push.receive()
            self._deferred = DeferredSends(self._push, received, self.receiving)
            self._inflight, self._inflight_roles = received, [("rollout", w) for w in self.workers]
            return
        self._inflight, self._inflight_roles = self._start(self.workers)
        if self._push.synchronous:
            self.wait()

    def wait(self) -> None:
        inflight, roles, deferred = self._inflight, self._inflight_roles, self._deferred
        self._inflight, self._inflight_roles, self._deferred = [], [], None
        if inflight:
            self.collect(inflight, roles, deferred)

    def abandon(self) -> None:
        """The run is ending elsewhere (a stall, a scorer error, Ctrl-C): a held-back push sends nothing
        to learners that are being shut down."""
        if self._deferred is not None:
            self._deferred.cancel()

    def push(self) -> dict[str, float]:
        """Send the learner's current weights to every rollout actor; returns timings."""
        self.wait()
        t0 = time.perf_counter()
        results = self.collect(*self._start(self.workers))
        loads = [r["sync_load_s"] for r in results if isinstance(r, dict) and "sync_load_s" in r]
        return {"timing_s/sync": time.perf_counter() - t0, "timing_s/sync_load": max(loads, default=float("nan"))}

    def push_to(self, workers: Sequence[Any]) -> None:
        """Current weights to some actors only (restarted ones), where the transport can re-link them."""
        self.collect(*self._start(list(workers)))

    def collect(self, refs: list, roles: list, deferred: Optional[DeferredSends] = None) -> list:
        """The push's results, waited for at most `timeout_s` from its sends. A relinking transport
        (the object store) raises an actor's death as Ray does, for the driver to restart it; the
        others raise one `EngineFault` line: which actor died or did not answer, where, over which
        transport. `deferred`: sends not yet issued; until they are, the stall bound applies."""
        import ray

        start = sent = time.monotonic()
        if deferred is not None:
            self._await_sends(deferred, roles, start)
            sent = deferred.sent_at or time.monotonic()
            if deferred.refs:
                refs, roles = refs + deferred.refs, roles + [("learner", lrn) for lrn in self.learners]
        deadline = sent + self.timeout_s
        index = {id(ref): k for k, ref in enumerate(refs)}
        pending, results = list(refs), [None] * len(refs)
        while pending:
            poll = min(deadline, time.monotonic() + 1.0) if self.progress_check else deadline
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, poll - time.monotonic()))
            if not ready and time.monotonic() < deadline:
                self._check_progress([roles[index[id(r)]] for r in pending], start)
                continue
            if not ready:
                self.broken = True
                raise EngineFault(self._stalled_line([roles[index[id(r)]] for r in pending]))
            k = index[id(ready[0])]
            try:
                results[k] = ray.get(ready[0])
            except Exception as exc:
                if transport(self.method).relinks:
                    raise
                self.broken = True
                raise EngineFault(self._failed_line(roles[k], exc, pending, roles, index)) from exc
        return results

    def _await_sends(self, deferred: DeferredSends, roles: list, start: float) -> None:
        """Until the sends are issued, or given up (a receive ended first: the caller names it);
        meanwhile a worker not yet receiving is the stall bound's (generating and moving is fine)."""
        try:
            while not deferred.done.wait(1.0):
                if self.progress_check is not None:
                    self._check_progress(roles, start)
        except BaseException:
            deferred.cancel()
            raise
        if deferred.error is not None:
            self.broken = True
            raise deferred.error

    def _check_progress(self, waiting: list, start: float) -> None:
        workers = {i for role, actor in waiting if role == "rollout"
                   for i, a in enumerate(self.workers) if a is actor}
        try:
            self.progress_check(workers, start)
        except EngineFault:
            self.broken = True
            raise

    def _name(self, role: str, actor: Any) -> str:
        group = self.workers if role == "rollout" else self.learners
        return self.name_actor(role, next((i for i, a in enumerate(group) if a is actor), -1))

    def _stalled_line(self, stalled: list) -> str:
        workers = [r for r in stalled if r[0] == "rollout"] or self._silent_workers() or stalled
        others = [r for r in stalled if r not in workers]
        also = f" (waiting on it: {', '.join(self._name(*r) for r in others)})" if others else ""
        return (f"the weight sync over {self.method} did not finish within rollout.weight_sync_timeout_s="
                f"{self.timeout_s:g}: {', '.join(self._name(*r) for r in workers)} stopped answering mid-push{also}")

    def _failed_line(self, role: tuple, exc: BaseException, pending: list, roles: list, index: dict) -> str:
        """A dead rollout worker is the cause even when the learner's broadcast failed first (its peer
        went away): the other refs get a few seconds to show it."""
        import ray

        from stapoctl.launch.actor_errors import describe_actor_death, remote_error

        dead = [(who, exc)] if (who := self._dead(role, exc)) else []
        if pending and (not dead or dead[0][0][0] != "rollout"):
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=min(10.0, self.timeout_s))
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as other:
                    if (who := self._dead(roles[index[id(ref)]], other)):
                        dead.append((who, other))
        dead.sort(key=lambda d: d[0][0] != "rollout")
        if dead:
            (who, why) = dead[0]
            line = f"{self._name(*who)} died during the weight sync over {self.method} ({describe_actor_death(why)})"
            return line + (f"; weight_sync={self.method} cannot re-link a new vLLM process" if who[0] == "rollout" else "")
        err = remote_error(exc)
        cause = err.cause if err is not None else (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
        silent = [roles[index[id(r)]] for r in pending
                  if roles[index[id(r)]][0] == "rollout" and not ray.wait([r], timeout=0)[0]]
        timed_out = role[0] == "learner" and "time" in cause.lower()  # its side timed out waiting on a worker
        silent = silent or (self._silent_workers() if timed_out else [])
        if timed_out and silent:
            return (f"{', '.join(self._name(*r) for r in silent)} stopped answering mid-push over {self.method} "
                    f"({self._name(*role)}'s side gave up first: {cause})")
        return f"the weight sync over {self.method} failed in {self._name(*role)}: {cause}"

    def _silent_workers(self) -> list:
        """The rollout workers that do not answer a cheap call (`info`) within a few seconds. A CUDA
        IPC push's refs are the learner ranks' (they make the workers' calls), and the progress board
        cannot tell either: those calls report no phase, so a stopped worker and the healthy ones
        waiting for the learner's next call look alike there. A healthy worker is idle meanwhile and
        answers at once; a stopped one, or one stuck inside its update call, does not."""
        import ray

        if not isinstance(self._push, LearnerDrivenPush):  # the workers' own refs said it
            return []
        try:
            asks = [w.info.remote() for w in self.workers]
            answered = {id(r) for r in ray.wait(asks, num_returns=len(asks), timeout=min(10.0, self.timeout_s))[0]}
        except Exception:  # no answer is no evidence: the learner ranks stay named
            return []
        return [("rollout", w) for w, ref in zip(self.workers, asks) if id(ref) not in answered]

    def _dead(self, role: tuple, exc: BaseException):
        """(role, actor) of the actor an error says died: the call's own actor when Ray lost it, or —
        when the call's actor raised it (the learner driving a CUDA IPC push) — the actor it names."""
        import ray

        if isinstance(exc, ray.exceptions.RayTaskError):  # the call's actor ran and raised: it is alive
            cause = getattr(exc, "cause", None)
            if not isinstance(cause, ray.exceptions.RayActorError):
                return None
            actor_id = str(getattr(cause, "actor_id", "") or "")
            for r, group in (("rollout", self.workers), ("learner", self.learners)):
                for a in group:
                    if actor_id and getattr(getattr(a, "_actor_id", None), "hex", lambda: "")() == actor_id:
                        return (r, a)
            return None
        return role if isinstance(exc, ray.exceptions.RayActorError) else None
