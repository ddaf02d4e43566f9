"""The training loop: its steps (rollouts launched ahead in async mode), validation when due,
the metrics logged, checkpoints when due or when a signal asks the run to stop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from stapoctl.trainer.run_record import ReplayCheck, set_tags
from stapoctl.trainer.step_runner import PendingRollout, StepRunner


@dataclass(frozen=True)
class Cadence:
    """The run's last step and how often it validates, checkpoints and draws token diagnostics
    (every N steps; 0: never)."""

    total: int
    val_every: int
    save_freq: int
    diag_every: int


class PlainSteps:
    """Each step trains on the next data.train_batch_size prompts; async: their rollouts are sent
    `ahead` steps early, so they generate while the learner updates."""

    def __init__(self, runner: "StepRunner", sampler, ahead: int, total: int):
        self.runner, self.sampler, self.ahead, self.total = runner, sampler, int(ahead), int(total)
        self.launched: dict[int, PendingRollout] = {}
        self.next_launch = 0
        self.status = ("rollout → reward → update → sync" if not ahead else
                       f"update ‖ rollouts of the next {ahead} step(s) → sync")

    def step(self, step: int) -> tuple[Any, dict, dict]:
        """(batch, metrics, sampler state right after this step's batch: what a checkpoint records)."""
        self.next_launch = max(self.next_launch, step)
        while self.next_launch <= min(step + self.ahead, self.total):
            indices = self.sampler.next_batch()
            self.launched[self.next_launch] = self.runner.launch_rollout(indices, self.next_launch,
                                                                         self.sampler.state_dict())
            self.next_launch += 1
        pending = self.launched.pop(step)
        batch, metrics = self.runner.finish(pending, wait_sync=not self.ahead)
        return batch, metrics, pending.sampler_state

    def close(self, stopping: bool = False) -> None:
        pass


@dataclass
class Loop:
    conf: DictConfig
    runner: "StepRunner"
    sampler: Any
    run_id: str
    run_dir: Path
    base_model: str
    tokenizer_dir: str  # the run's own copy (`run_files.tokenizer_dir`): no rotation deletes it
    stop: Any = None  # GracefulStop: a signal ends the loop after the step in progress
    resumed_from: Optional[Path] = None  # this process's resume point: retention keeps it (`checkpoint.prune`)
    step: int = 0  # the step in progress, for a failure's one line
    protocol: str = ""  # sha256 of the validations' protocol, once recorded by this process
    watch: Any = None  # HealthWatch: the run-health alarms (trainer.alarms)
    alarmed: list = field(default_factory=list)  # the alarms that stop the run (trainer.alarm_action=stop)
    inert: Any = None  # InertWatch: configured terms that never changed an update (trainer/inert.py)
    canary: Any = None  # SyncCanary: vLLM's log-probs against the learner's after each push (trainer/sync_canary.py)

    def run(self, start_step: int, console: Console) -> dict:
        """Steps start_step+1 … total: step, validate when due, log, checkpoint when due."""
        from stapoctl.trainer.live_view import LiveView

        conf, runner = self.conf, self.runner
        total = int(conf.trainer.total_steps)
        due = Cadence(total, int(conf.eval.every_n_steps or 0), int(conf.trainer.save_freq or 0),
                      int(conf.trainer.get("diagnostics_every") or 0))
        first_val: dict = {}
        replay = ReplayCheck()
        if conf.trainer.get("alarms", True):  # .get: a checkpoint saved before alarms existed resumes
            from stapoctl.trainer.alarms import HealthWatch, limits_from

            self.watch = HealthWatch(limits_from(conf.trainer.get("alarm_limits")))
            self.canary = _sync_canary(conf, runner.engines, self.watch.limits)
        self.inert = _inert_watch(conf, start_step, getattr(runner, "loss_config", None))
        with LiveView(console, total, start_step, title=f"{conf.experiment} · {conf.loss.name}") as view:
            if runner.data.val_sets and start_step == 0 and conf.trainer.val_before_train:
                first_val = self._validate_start(view)
            ahead = int(conf.trainer.max_staleness) if conf.trainer.mode == "async" else 0
            try:
                last, saved = self._steps(view, start_step, ahead, due, replay)
                runner.engines.wait_weights()
            finally:  # the figures still being drawn go into the run before its record ends
                runner.drain_diagnostics(lambda msg: console.print(msg, style="yellow", markup=False, highlight=False))
        replay.report(console)
        self._name_inert(console)
        out: dict[str, Any] = {"steps": total, "final": dict(last), "replayed": replay.summary()}
        if first_val:
            out["first_val"] = first_val
        self._end_if_stopped(total, saved)
        self._end_if_alarmed(saved)
        return out

    def _validate_start(self, view) -> dict:
        """Step 0's validation, of the starting policy (trainer.val_before_train)."""
        from stapoctl.tracking import mlflow_run

        view.status("validating the starting policy")
        first_val = self.validate(0)
        mlflow_run.log_metrics(first_val, step=0)
        view.step(0, first_val)
        return first_val

    def _steps(self, view, start_step: int, ahead: int, due: Cadence, replay: ReplayCheck) -> tuple[dict, int]:
        """The steps after start_step, up to the total or a stop; returns the last step's metrics
        and the last step checkpointed (start_step if none)."""
        runner, total = self.runner, due.total
        last: dict = {}
        source = self._step_source(ahead, total, view)
        t_prev = time.perf_counter()
        if self.stop is not None:
            self.stop.in_loop, self.stop.step = True, start_step
        saved, stopping = start_step, False
        for step in range(start_step + 1, total + 1):
            self.step = step
            view.status(source.status)
            batch, metrics, sampler_state = source.step(step)
            if ahead:  # a step's wall time includes the overlapped generation
                metrics["timing_s/step"] = time.perf_counter() - t_prev
            t_prev = time.perf_counter()
            logged = self._log_step(view, step, due, batch, metrics, replay)
            alarm_save = self._alarms(view, step, metrics)
            if logged is False and (self.alarmed or alarm_save or (self.stop is not None and self.stop.requested is not None)):
                from stapoctl.tracking import mlflow_run  # off trainer.log_every's cadence: the evidence stays

                mlflow_run.log_metrics(metrics, step=step)
            last = metrics
            if self.stop is not None:
                self.stop.step_done(step, metrics.get("timing_s/step", 0.0))
            stopping = self.stop is not None and self.stop.requested is not None
            if ((due.save_freq > 0 and (step % due.save_freq == 0 or step == total)) or (stopping and step < total)
                    or alarm_save):
                view.status("checkpoint")
                runner.engines.wait_weights()
                self.save(step, sampler_state)
                saved = step
            if (stopping or self.alarmed) and step < total:
                break
        source.close(stopping or bool(self.alarmed))
        return last, saved

    def _step_source(self, ahead: int, total: int, view):
        """Where each step's batch comes from: the next train_batch_size prompts, or dynamic
        sampling's rounds (`trainer.dynamic_sampling`)."""
        if self.conf.trainer.get("dynamic_sampling", False):
            from stapoctl.trainer.dynamic_sampling import DynamicSampling

            return DynamicSampling(self.conf, self.runner, self.sampler, ahead=ahead, total=total,
                                   say=lambda msg: view.console.print(msg, style="yellow", markup=False,
                                                                      highlight=False, soft_wrap=True))
        return PlainSteps(self.runner, self.sampler, ahead, total)

    def _log_step(self, view, step: int, due: Cadence, batch, metrics: dict, replay: ReplayCheck) -> bool:
        """Validation when due, then the step's metrics, tags, token diagnostics and view line; whether
        the step's metrics went to MLflow (`trainer.log_every`)."""
        from stapoctl.tracking import mlflow_run

        conf, runner = self.conf, self.runner
        if runner.data.val_sets and (step % due.val_every == 0 or step == due.total):
            view.status("validating")
            metrics.update(self.validate(step))
            if batch is not None:  # dynamic sampling: a step may make no update
                _log_samples(conf, batch, step)
        metrics["fault/rollout_restarts"] = float(runner.engines.rollout_restarts)
        replay.check(step, metrics)
        every = int(conf.trainer.get("log_every") or 1)  # trainer.log_every: every N steps and the last;
        logged = step % every == 0 or step == due.total  # a validation between them logs its own val/ metrics
        if logged:
            mlflow_run.log_metrics(metrics, step=step)
        elif any(k.startswith("val/") for k in metrics):
            mlflow_run.log_metrics({k: v for k, v in metrics.items() if k.startswith(("val/", "timing_s/val"))},
                                   step=step)
        set_tags({"stapoctl.step": str(step)})
        if due.diag_every > 0 and step % due.diag_every == 0 and batch is not None:
            runner.log_diagnostics(batch, step, self.run_dir)
        view.step(step, metrics)
        return logged

    def _alarms(self, view, step: int, metrics: dict) -> bool:
        """The run-health alarms this step's metrics raise: one line each and the MLflow tag
        stapoctl.alarm.<name>=<step>; True when trainer.alarm_action asks for a checkpoint now."""
        from stapoctl.tracking import keys

        fired = self.watch.feed(step, metrics) if self.watch is not None else []
        if self.inert is not None:
            fired += self.inert.feed(step, metrics, self.watch.limits.inert_action if self.watch else "warn")
        if self.canary is not None:
            fired += self.canary.feed(step, metrics)
        if not fired:
            return False
        default = str(self.conf.trainer.get("alarm_action") or "warn")
        then = {"warn": "the run goes on (trainer.alarm_action=warn)",
                "checkpoint": "checkpoint now, the run goes on (trainer.alarm_action=checkpoint)",
                "stop": "checkpoint now, then the run stops KILLED (trainer.alarm_action=stop)"}
        actions = [a.action or default for a in fired]
        for alarm, action in zip(fired, actions):
            said = then[action] if not alarm.action else then[action].replace(
                "trainer.alarm_action", alarm.setting or "trainer.alarm_limits.inert_action")
            view.console.print(f"[bold red]{escape(alarm.message)}[/]; {escape(said)}", highlight=False, soft_wrap=True)
        set_tags({keys.ALARM_PREFIX + a.name: str(step) for a in fired})
        self.alarmed.extend(a for a, action in zip(fired, actions) if action == "stop")
        return any(action != "warn" for action in actions)

    def _name_inert(self, console: Console) -> None:
        """The run's end: every configured term that never changed an update, in one line and tagged."""
        line, tags = self.inert.summary() if self.inert is not None else ("", {})
        if line:
            console.print(line, style="yellow", highlight=False, markup=False, soft_wrap=True)
            set_tags(tags)

    def _end_if_alarmed(self, saved: int) -> None:
        """An alarm with trainer.alarm_action=stop: the run ends KILLED, the alarm named, resumable."""
        if self.alarmed:
            from stapoctl.errors import AlarmStopped

            names = ", ".join(a.name for a in self.alarmed)
            key = self.alarmed[0].setting or "trainer.alarm_action"  # the canary's (and inert_knobs') own action
            raise AlarmStopped(f"alarm {names} at step {self.alarmed[0].step} ({key}=stop): stopped with "
                               f"checkpoint step_{saved:06d}; see docs/RUNS.md \"Alarms\", then resume with "
                               f"`stapoctl train resume={self.run_id}` ({key}=warn to go on past it)",
                               tuple(a.name for a in self.alarmed))

    def _end_if_stopped(self, total: int, saved: int) -> None:
        """A signal stopped the loop before its last step: the run ends as stopped, resumable."""
        if self.stop is not None and self.stop.requested is not None and self.stop.step < total:
            from stapoctl.trainer.signals import signal_name

            self.stop.cleaning_up = True
            raise self.stop.stopped(f"{signal_name(self.stop.requested)}: stopped after step {self.stop.step} "
                                    f"(checkpoint step_{saved:06d}); resume with `stapoctl train resume={self.run_id}`")

    def validate(self, step: int) -> dict:
        """Validation through the rollout actors; re-run whole if one of them died meanwhile."""
        from stapoctl.trainer.rollout_loss import is_rollout_loss

        engines = self.runner.engines
        for attempt in range(3):
            try:
                out = _validate(self.conf, engines, self.runner.scorer, self.runner.data.val_sets, step)
                self.protocol = self.protocol or _record_protocol(self.conf, self.runner.data.val_sets)
                return out
            except Exception as exc:
                if not is_rollout_loss(exc) or attempt == 2:
                    raise
                engines.recover_rollouts()
        return {}

    def save(self, step: int, sampler_state: dict) -> Path:
        """A checkpoint, then retention; a full disk (or a write the driver could not make) ends the
        run in one line here, anything the learner raised in `faults.engine_faults`."""
        from ray.exceptions import RayTaskError

        from stapoctl.errors import RunFailed
        from stapoctl.trainer.faults import save_failure

        try:
            return _save(self.runner.engines, self.run_dir, step, sampler_state, self.run_id, self.base_model,
                         self.tokenizer_dir, self.conf, self.resumed_from)
        except OSError as exc:
            if isinstance(exc, RayTaskError):  # not the disk (`checkpoint.save` says that): the learner's error
                raise
            raise RunFailed(save_failure(exc, self.run_dir, step, self.run_id, self.conf.tracking.uri)) from exc


def _sync_canary(conf, engines, limits):
    """The canary alarm of the run's transport and dtype, naming a worker by pid and node."""
    from stapoctl.trainer.sync_canary import SyncCanary

    method = str(getattr(getattr(engines, "sync", None), "method", "") or conf.rollout.weight_sync)
    name = (lambda i: engines.actor_label("rollout", i)) if hasattr(engines, "actor_label") else (
        lambda i: f"rollout worker {i}")
    return SyncCanary(limits, str(conf.model.dtype), method, name)


def _inert_watch(conf, start_step: int, loss_config=None):
    """The run's InertWatch (trainer/inert.py) on the run's one typed loss config (the step runner's);
    a resumed run's logged steps are evidence too."""
    from stapoctl.trainer.alarms import limits_from
    from stapoctl.trainer.inert import InertWatch, knobs
    from stapoctl.tracking.metric_buffer import active

    after = limits_from(conf.trainer.get("alarm_limits")).inert_steps if conf.trainer.get("alarms", True) else 0
    watch = InertWatch(knobs(conf, loss_config), after)
    if start_step:
        watch.seed(active(), start_step)
    return watch


def _validate(conf, engines, scorer, val_sets, step: int) -> dict:
    """Held-out problems through the rollout actors (the weights just synced), eval's metrics."""
    from stapoctl.data.benches import select_decodings
    from stapoctl.eval.runner import validation_metrics

    t0 = time.perf_counter()
    out: dict[str, float] = {}
    for bench, (problems, k) in val_sets.items():
        out.update(validation_metrics(
            engines.workers, scorer, problems, bench=bench, decodings=select_decodings(conf.eval.decoding),
            k=k, max_tokens=int(conf.eval.max_response_length),
            seed=int(conf.trainer.seed) * 100_000 + 50_000 + step,
        ))
    out["timing_s/val"] = time.perf_counter() - t0
    return out


def _record_protocol(conf, val_sets) -> str:
    """The validations' protocol (`eval/protocol.py`) as the run's artifact and tag, so `compare`
    can tell its val/… accuracies from ones measured another way. A resumed run records it again:
    the tag is the protocol of the run's last validation, the one compare reads."""
    from stapoctl.data.benches import select_decodings
    from stapoctl.eval import protocol
    from stapoctl.tracking.metric_buffer import active

    buffer = active()
    if buffer is not None:
        log_text = buffer.log_text
    else:
        import mlflow

        log_text = mlflow.log_text
    return protocol.record(protocol.build(conf, val_sets, select_decodings(conf.eval.decoding)), log_text, set_tags)


def _log_samples(conf, batch, step: int) -> None:
    from stapoctl.tracking.metric_buffer import active

    n = int(conf.trainer.log_samples or 0)
    if n <= 0 or not conf.tracking.get("log_artifacts", True):  # tracking.log_artifacts=false: no artifact
        return
    lines = []
    for k in range(min(n, len(batch))):
        lines.append(f"### reward {float(batch.rewards[k]):+.0f}\n{batch.texts[k]}\n")
    buffer = active()
    if buffer is not None:
        buffer.log_text("\n".join(lines), f"samples/step_{step:06d}.md")
    else:
        import mlflow

        mlflow.log_text("\n".join(lines), f"samples/step_{step:06d}.md")


def _save(engines, run_dir: Path, step: int, sampler_state: dict, run_id: str, base_model: str, tokenizer_dir: str,
          conf: DictConfig, resumed_from: Optional[Path] = None) -> Path:
    from stapoctl import checkpoint

    def payload(tmp: Path) -> None:
        engines.learners.save(str(tmp), tokenizer_dir)

    state = {
        "step": step,
        "rollout_restarts": int(engines.rollout_restarts),
        "sampler": sampler_state,  # as of this step's batch (async runs have sampled further ahead)
        "rng": checkpoint.rng_state(),
        "mlflow_run_id": run_id,
        "run_dir": str(run_dir),
        "base_model": base_model,
        "saved_at": time.time(),
        "config": OmegaConf.to_container(conf, resolve=True),
    }
    saved = checkpoint.save(run_dir, step, payload, state)
    checkpoint.prune(run_dir, int(conf.trainer.get("keep_checkpoints") or 0), saved,
                     protect=[resumed_from] if resumed_from else [])
    return saved
