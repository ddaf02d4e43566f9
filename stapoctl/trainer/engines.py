"""The engines of a run, started once and reused every step: N vLLM rollout actors, the
DeepSpeed learner rank(s) and the weight sync between them. vLLM's start-up and DeepSpeed's
overlap (they are separate actors), which hides most of the ~1 min fixed cost on CPU.

Faults: a rollout actor whose process dies is restarted by Ray (`rollout.max_restarts`); every
call to the rollout actors goes through `send_rollouts` + `gather_rollouts` / `push_weights`, which wait for the
restart, give the new process the learner's current weights (a restarted vLLM holds the model
it was built from) and re-send what was lost. Rollouts are pure functions of (weights, prompts,
per-prompt seeds), so a re-sent rollout returns what the lost one would have. A learner rank
holds optimizer state that only a checkpoint can restore: its death ends the run
(`launch.actor_errors.describe_actor_death` names it for the one-line error).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig

from stapoctl.errors import EngineFault, UserError
from stapoctl.launch.actor_errors import describe_actor_death, user_error_in
from stapoctl.launch.engine_log import record_start
from stapoctl.launch.ray_runtime import startup_phases
from stapoctl.learner.group import LearnerGroup
from stapoctl.trainer.engine_settings import learner_args, stall_timeout_s, thread_counts
from stapoctl.trainer.rollout_loss import is_rollout_loss, lost_for_good, rollout_max_restarts
from stapoctl.trainer.stall import StallWatch


@dataclass
class Engines:
    workers: list
    learners: LearnerGroup  # every call to the learner ranks goes through it (a plain list of handles is wrapped)
    sync: Any
    placement: Any
    info: dict = field(default_factory=dict)
    weight_version: int = 0  # pushes so far; every live rollout actor holds this version
    rollout_restarts: int = 0  # rollout actor processes Ray brought back during this run
    worker_pids: list = field(default_factory=list)
    restart_timeout_s: float = 600.0  # a restarted vLLM re-initialises (minutes for a big model)
    max_restarts: int = 0
    say: Optional[Callable[[str], None]] = None
    stall: Any = None  # StallWatch (trainer/stall.py): rollout.stall_timeout_s on every wait for the workers

    def __post_init__(self) -> None:
        if not isinstance(self.learners, LearnerGroup):
            self.learners = LearnerGroup(self.learners)

    # -- rollout actors that die ----------------------------------------------------------------
    def send_rollouts(self, submit: Callable[[Any, Any], Any], jobs: Sequence[tuple[int, Any]]) -> list:
        """`submit(worker, payload)` for each (worker index, payload) job; their refs, in order."""
        return [submit(self.workers[w], payload) for w, payload in jobs]

    def gather_rollouts(self, refs: list, submit: Callable[[Any, Any], Any], jobs: Sequence[tuple[int, Any]],
                        doing: str = "generating rollouts") -> list:
        """The results of `send_rollouts`, in order; a worker that stops making progress meanwhile ends
        the run (`rollout.stall_timeout_s`, trainer/stall.py), naming it and `doing`.

        A job whose actor died, or came back without the current weights, is re-sent after
        `recover_rollouts`; a call that is a pure function of its inputs is safe to repeat. With a
        transport that cannot re-link a new vLLM, a dead actor ends the run at once, named.
        """
        import ray

        pending = dict(enumerate(refs))
        results: dict[int, Any] = {}
        for attempt in range(_MAX_RESENDS + 1):
            if self.stall is not None:
                self.stall.wait({ref: jobs[j][0] for j, ref in pending.items()}, doing)
            failed = []
            for j, ref in pending.items():
                try:
                    results[j] = ray.get(ref)
                except Exception as exc:
                    if not is_rollout_loss(exc):
                        raise
                    lost_for_good(self.sync, self.actor_label('rollout', jobs[j][0]), exc)
                    failed.append(j)
            if not failed:
                return [results[j] for j in range(len(jobs))]
            self.recover_rollouts()
            pending = {j: submit(self.workers[jobs[j][0]], jobs[j][1]) for j in failed}
        raise RuntimeError(f"rollout calls kept failing after {_MAX_RESENDS} recoveries")

    def push_weights(self) -> dict:
        """The learner's weights to every rollout actor, then a check (one `info` round trip,
        ~ms) that each live actor holds them: one that died meanwhile, or between two steps,
        is waited for, counted and given them now instead of sampling with its base model."""
        self.weight_version += 1
        out: dict = {}
        try:
            out = self.sync.push()
        except Exception as exc:
            if not is_rollout_loss(exc):
                raise
        self.recover_rollouts()
        return out

    def push_weights_async(self) -> None:
        """Start a push and return (asynchronous training; see `WeightSync.push_async`). No
        liveness check here: an `info` call would queue behind the rollouts already sent; a lost
        actor surfaces when its rollout is gathered, or in `wait_weights`."""
        self.wait_weights()
        self.weight_version += 1
        self.sync.push_async()

    def wait_weights(self) -> None:
        """Collect an asynchronous push; an actor lost meanwhile is recovered (given the weights)."""
        try:
            self.sync.wait()
        except Exception as exc:
            if not is_rollout_loss(exc):
                raise
            self.recover_rollouts()

    def recover_rollouts(self) -> int:
        """Wait until every rollout actor answers; give restarted ones the current weights.

        Returns how many actor processes were replaced (counted by pid, so a restart between
        two calls is counted too); a permanently dead actor (restarts used up) fails the run.
        """
        import ray

        deadline = time.monotonic() + self.restart_timeout_s
        infos = []
        for i, w in enumerate(self.workers):
            while True:
                try:
                    infos.append(ray.get(w.info.remote(), timeout=max(1.0, deadline - time.monotonic())))
                    break
                except ray.exceptions.ActorDiedError as exc:  # for good: no restart left (or none allowed)
                    raise EngineFault(f"{self.actor_label('rollout', i)} died and Ray did not restart it "
                                      f"({self._why_no_restart()}): {describe_actor_death(exc)}") from exc
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                    if time.monotonic() > deadline:
                        raise EngineFault(f"{self.actor_label('rollout', i)} did not come back within "
                                          f"{self.restart_timeout_s:.0f} s after dying: {describe_actor_death(exc)}") from exc
                time.sleep(0.5)
        replaced = [i for i, info in enumerate(infos)
                    if i < len(self.worker_pids) and info["pid"] != self.worker_pids[i]]
        self.worker_pids = [info["pid"] for info in infos]
        stale = [i for i, info in enumerate(infos) if info["needs_weights"] or info["weight_version"] != self.weight_version]
        if stale:
            self._push_to([self.workers[i] for i in stale])
        self.rollout_restarts += len(replaced)
        if replaced and self.say:
            self.say(f"rollout actor(s) {', '.join(map(str, replaced))} restarted by Ray (pid now "
                     f"{', '.join(str(self.worker_pids[i]) for i in replaced)}); the learner's weights "
                     f"(version {self.weight_version}) were pushed to them and the lost calls re-sent")
        return len(replaced)

    def _push_to(self, workers: list) -> None:
        """Current weights to some actors only, and their version set to the driver's count."""
        import ray

        from stapoctl.sync.transports import transport

        if not transport(self.sync.method).relinks:
            raise EngineFault(f"a rollout actor restarted and weight_sync={self.sync.method} cannot re-link a new "
                              "vLLM process")
        self.sync.push_to(workers)
        ray.get([w.update_weight_version.remote(str(self.weight_version)) for w in workers])

    def _why_no_restart(self) -> str:
        from stapoctl.sync.transports import transport

        method = getattr(self.sync, "method", "")
        if method and not transport(method).relinks:
            return f"weight_sync={method} cannot re-link a new vLLM process, so none is started"
        return f"rollout.max_restarts={self.max_restarts}"

    def actor_label(self, role: str, i: int) -> str:
        """'rollout worker 1 (pid 4242, node 10.0.0.5)': what a failure line names."""
        from stapoctl.launch.ray_runtime import node_address

        pids = self.worker_pids if role == "rollout" else self.info.get("learner_pids", [])
        nodes = self.info.get("nodes", {}).get(role, [])
        where = [f"pid {pids[i]}" if 0 <= i < len(pids) else "",
                 f"node {node_address(nodes[i])}" if 0 <= i < len(nodes) and nodes[i] else ""]
        name = f"{'rollout worker' if role == 'rollout' else 'learner rank'} {i}"
        return f"{name} ({', '.join(w for w in where if w)})" if any(where) else name

    def learner_rank_of(self, exc: BaseException) -> Optional[int]:
        """Which learner rank an actor error is about (None: not a learner)."""
        return self.learners.rank_of(getattr(exc, "actor_id", None))

    def shutdown(self, grace_s: Optional[float] = None) -> None:
        """Stop vLLM inside its actors first (shared memory), then the actors themselves.

        `grace_s` bounds the wait for each actor's own clean-up (default 60 s for vLLM, 30 s for a
        learner); an actor still inside its constructor cannot answer before it finishes, and
        is killed when the grace runs out."""
        import ray

        if (abandon := getattr(self.sync, "abandon", None)) is not None:
            abandon()
        if getattr(self.sync, "broken", False) or getattr(self.stall, "stalled", None) is not None:
            grace_s = min(grace_s or 2.0, 2.0)  # a failed push or a stalled worker: it may never answer
        # every actor's own clean-up at once (each is a separate process), each bounded
        calls = []
        for w in self.workers:
            try:
                calls.append((w.shutdown.remote(), time.monotonic() + (grace_s or 60.0)))
            except Exception:
                pass
        calls += [(ref, time.monotonic() + (grace_s or 30.0)) for ref in self.learners.shutdown_async()]
        for ref, deadline in calls:
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
        for actor in [*self.workers, *self.learners, *([self.stall.board] if self.stall is not None else [])]:
            try:
                ray.kill(actor)
            except Exception:
                pass
        if self.placement is not None:
            self.placement.remove()


_MAX_RESENDS = 5


def start_engines(conf: DictConfig, policy_path: str, console=None, reference_path: Optional[str] = None) -> "Engines":
    """Ray, then the run's placement, then the vLLM actors and the learner ranks in parallel,
    then the weight-sync link."""
    return launch_engines(conf, policy_path, console, reference_path).ready()


@dataclass
class EngineLaunch:
    """Engines whose actors are still starting (importing vLLM, DeepSpeed, loading weights).

    `launch_engines` returns once Ray is up and the actors are created, so the driver can do its
    own set-up (tokenizer, data, MLflow run) on the cores the actors leave idle; `ready()` waits.
    """

    conf: DictConfig
    console: Any
    t0: float
    t_ray: float
    started_ray: bool
    method: str
    placement: Any
    workers: list
    learners: LearnerGroup
    setup_refs: list
    marks: dict = field(default_factory=dict)  # the driver's start-up marks, epoch seconds (`startup_phases`)
    reason: str = ""  # why these engines start (EngineSession: "first start", the settings that changed)
    stall: Any = None  # StallWatch on the workers' progress board

    def ready(self) -> Engines:
        import ray

        from stapoctl.sync.transfer import WeightSync

        conf, r = self.conf, self.conf.rollout
        try:
            info_refs = [w.info.remote() for w in self.workers]
            # start-up bounded by progress: each vLLM actor's phases, the learner ranks' set-up as a deadline
            if self.stall is not None:
                self.stall.wait({**{ref: i for i, ref in enumerate(info_refs)},
                                 **{ref: None for ref in self.setup_refs}},
                                "starting", deadline_label="the learner ranks' set-up")
            worker_info = ray.get(info_refs)
            learner_info = ray.get(self.setup_refs)
            self.marks["actors_up"] = time.time()
            sync = WeightSync(self.learners, self.workers, self.method, tp_size=int(r.tensor_parallel_size),
                              timeout_s=float(r.get("weight_sync_timeout_s") or 1800.0))
            self.marks["sync_linked"] = time.time()
        except BaseException as exc:
            self.abort()
            cause = getattr(exc, "cause", None) or user_error_in(exc)
            if isinstance(cause, UserError):
                raise cause from None
            raise
        info = {
            "ray_s": self.t_ray,
            "engines_s": time.perf_counter() - self.t0,
            "vllm_init_s": max(w["init_s"] for w in worker_info),
            "learner_setup_s": max(x["setup_s"] for x in learner_info),
            "sync_method": self.method,
            "pad_token_id": worker_info[0]["pad_token_id"],
            "eos_token_id": worker_info[0]["eos_token_id"],
            "params": learner_info[0].get("params", -1),
            "threads": dict(zip(("rollout", "learner"), thread_counts(conf))),
            "mkl": learner_info[0].get("mkl", {}),
            "started_ray": self.started_ray,
            "nodes": {"rollout": [w.get("node_id", "") for w in worker_info],
                      "learner": [x.get("node_id", "") for x in learner_info]},
            "learner_pids": [x.get("pid", 0) for x in learner_info],
            "startup": startup_phases(self.marks, worker_info, learner_info),
            "reason": self.reason,
        }
        say = ((lambda msg: self.console.print(msg, style="yellow", markup=False, highlight=False))
               if self.console is not None else None)
        engines = Engines(workers=self.workers, learners=self.learners, sync=sync, placement=self.placement, info=info,
                          worker_pids=[w["pid"] for w in worker_info], max_restarts=rollout_max_restarts(r, self.method),
                          say=say, stall=self.stall)
        sync.name_actor = engines.actor_label
        if self.stall is not None:
            self.stall.label = lambda i: engines.actor_label("rollout", i)
            sync.progress_check = lambda waiting, start: self.stall.check(
                waiting, start, f"the weight push over {self.method} waited for it")
            sync.receiving = self.stall.receiving  # an async push's sends wait for every worker's receive
        record_start(info)  # tests only (STAPOCTL_TEST_ENGINE_LOG; launch/engine_log.py)
        return engines

    def abort(self) -> None:
        """Stop the half-started actors (a failed start, or the driver's set-up failed meanwhile).

        A short grace: an actor still importing vLLM would only answer once its constructor is
        done (~10 s here), which would hold back the refusal the user is waiting for."""
        Engines(workers=self.workers, learners=self.learners, sync=None, placement=self.placement,
                stall=self.stall).shutdown(grace_s=3.0)


def launch_engines(conf: DictConfig, policy_path: str, console=None,
                   reference_path: Optional[str] = None) -> EngineLaunch:
    """Ray, the run's placement, then the vLLM actors and the learner ranks, created and left
    starting in parallel (see `EngineLaunch.ready`)."""
    import ray

    from stapoctl.launch.placement import make_placement
    from stapoctl.launch.ray_runtime import ensure_ray
    from stapoctl.rollout.progress import make_board
    from stapoctl.rollout.vllm_worker import make_rollout_worker
    from stapoctl.sync.transports import choose_method
    from stapoctl.trainer.engine_settings import engine_spec

    t0, marks = time.perf_counter(), {"launch": time.time()}
    started_ray = ensure_ray(conf.cluster)
    t_ray = time.perf_counter() - t0
    marks["ray_up"] = time.time()
    r, lrn = conf.rollout, conf.learner
    on_gpu = float(r.gpus_per_worker or 0) > 0 or float(lrn.gpus_per_rank or 0) > 0
    if on_gpu and not ray.cluster_resources().get("GPU"):
        raise UserError(
            "rollout.gpus_per_worker / learner.gpus_per_rank ask for GPUs and the Ray cluster has none: "
            "set both to 0 on a CPU machine (the embedded default does)"
        )
    method = choose_method(r.weight_sync, on_gpu=on_gpu, placement=lrn.placement)
    say = (lambda msg: console.print(msg, style="yellow", markup=False, highlight=False)) if console is not None else None
    placement = make_placement(r, lrn, timeout_s=float(conf.cluster.placement_timeout_s), on_wait=say)
    spec = engine_spec(conf, policy_path, method, on_gpu)
    marks["placement_ready"] = time.time()
    workers: list = []
    board, board_name = make_board()  # the workers' progress (rollout/progress.py), for rollout.stall_timeout_s
    try:
        for i in range(int(r.num_workers)):  # every resource an actor asks is the placement's (actor_asks)
            opts = placement.rollout_options(i)
            workers.append(make_rollout_worker(spec, num_cpus=opts["num_cpus"], num_gpus=opts["num_gpus"],
                                               options=opts, synced=True, on_gpu=on_gpu,
                                               max_restarts=rollout_max_restarts(r, method),
                                               env_extra=placement.rollout_env(i), progress=(board_name, i)))
        marks["rollout_created"] = time.time()
        if spec.colocated:  # vLLM sizes its memory before the learner allocates beside it
            ray.get([w.info.remote() for w in workers])
        learners, setup_refs = LearnerGroup.start(policy_path, **learner_args(conf, reference_path),
                                                  placement=placement, wait=False,
                                                  start_timeout_s=float(conf.cluster.placement_timeout_s) + 300.0)
        marks["learner_setup_sent"] = time.time()  # after rank 0's rendezvous: its process is up
    except BaseException:
        Engines(workers=workers, learners=[], sync=None, placement=placement, stall=StallWatch(board, 0)).shutdown()
        raise
    stall = StallWatch(board, stall_timeout_s(conf))
    return EngineLaunch(conf=conf, console=console, t0=t0, t_ray=t_ray, started_ray=started_ray, method=method,
                        placement=placement, workers=workers, learners=learners, setup_refs=setup_refs, marks=marks,
                        stall=stall)
