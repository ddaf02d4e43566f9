"""Engines kept warm across runs: the trials of a sweep reuse one Ray runtime, one set of vLLM
actors, the learner ranks and the verifier pool instead of paying ~45 s of start-up each.

Between runs the learner ranks are `reset` (base weights reloaded, a fresh optimizer and lr
schedule, the run's seed and loss config) and the base weights are pushed to every vLLM actor,
so a trial on reused engines computes what a fresh process would (tests/test_session.py checks
the first step's batch, loss and entropy). Engines are restarted only when the next run needs
different ones: another architecture or tokenizer, dtype, actor count or resources, context length;
a run resumed from a checkpoint of the same model reuses them (its weights are pushed).
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from stapoctl.errors import UserError

# Config keys whose change needs new engines (everything else is applied by a reset).
RESTART_KEYS = (
    "model.dtype",
    "rollout.engine", "rollout.num_workers", "rollout.cpus_per_worker", "rollout.gpus_per_worker",
    "rollout.tensor_parallel_size", "rollout.gpu_memory_utilization", "rollout.kv_cache_gb",
    "rollout.enforce_eager", "rollout.weight_sync", "rollout.weight_sync_timeout_s", "rollout.resources",
    "rollout.placement_strategy",
    # Ray's restart budget is the actor's whole life: a run on reused actors would inherit the
    # restarts earlier runs used (and a change of it would not reach the running actors)
    "rollout.max_restarts",
    "learner.backend", "learner.num_ranks", "learner.gpus_per_rank", "learner.cpus", "learner.resources",
    "learner.placement_strategy", "learner.placement",
    # the weight link captures the stage when it is built (a ZeRO-3 source gathers, a ZeRO-2 one does
    # not): a trial on another stage would send 0-element shards under full-shape metadata
    "learner.zero_stage", "learner.process_group_timeout_s",
    "cluster",
)


def engine_parts(conf: DictConfig, policy_path: str, base_model: Optional[str] = None) -> dict[str, Any]:
    """What the running engines were built for, by name.

    Not the policy's path: a resumed run (or a sweep's next trial resumed from its checkpoint)
    gets the engines as they run, its weights loaded by the learner reset and pushed to vLLM. The
    model's identity is its base model's (`base_model`: the run's initial policy), whose
    checkpoints keep its architecture and tokenizer: a hub id, or a config a save writes with other
    fields (transformers 5 adds `rope_parameters`), still matches its own checkpoints."""
    from stapoctl.models.identity import model_identity
    from stapoctl.trainer.engine_settings import max_model_len, stall_timeout_s, thread_counts

    parts: dict[str, Any] = {"model": model_identity(base_model or policy_path),
                             "max_model_len": max_model_len(conf, policy_path),
                             "rollout_threads": thread_counts(conf)[0]}  # fixed when vLLM starts
    for key in RESTART_KEYS:
        node = OmegaConf.select(conf, key)
        parts[key] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    if int(conf.rollout.tensor_parallel_size) > 1:  # vLLM's step bound, fixed at its start, follows the stall bound
        parts["rollout.stall_timeout_s"] = stall_timeout_s(conf)
    return parts


def engine_key(conf: DictConfig, policy_path: str, base_model: Optional[str] = None) -> str:
    """Equal keys ⇒ the running engines fit and a reset is enough. Canonical JSON: a resumed run's
    config comes back from its checkpoint with its mappings in another order."""
    return _canonical(engine_parts(conf, policy_path, base_model))


def _canonical(parts: dict[str, Any]) -> str:
    return json.dumps(parts, sort_keys=True, default=repr)


def why_restart(before: Optional[dict], after: dict) -> str:
    """The settings that differ, as `name: old → new` (what a researcher reads when a sweep's
    trial started new engines instead of reusing them)."""
    if not before:
        return ""
    changed = [k for k in after if _canonical({"v": before.get(k)}) != _canonical({"v": after[k]})]
    return "; ".join(f"{k}: {before.get(k)!r} → {after[k]!r}" for k in changed[:4]) + \
        (f"; {len(changed) - 4} more" if len(changed) > 4 else "")


class EngineSession:
    """Owns engines + verifier pool across runs; `close()` (or the context manager) stops them."""

    def __init__(self, console: Optional[Console] = None):
        self.console = console or Console()
        self.engines = None
        self.scorer = None
        self.key: Optional[str] = None
        self.parts: Optional[dict] = None  # engine_parts of the running engines
        self.scorer_key: Optional[str] = None
        self.started_ray = False
        self.runs = 0
        self._launch: Any = None  # engines starting for `_launch_key` (see `prepare`)
        self._launch_key: Optional[str] = None
        self._launch_error: Optional[BaseException] = None
        self._stopped = ""  # what ended the last engines or start (a discard, a failure), for the next start's reason

    def __enter__(self) -> "EngineSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prepare(self, conf: DictConfig, policy_path: str, reference_path: Optional[str] = None) -> None:
        """Start what `acquire` will need and return without waiting: Ray and the engine actors
        (when the running ones do not fit `conf`) and the verifier pool. The driver prepares
        its data and MLflow run meanwhile, on the cores the actors' start-up leaves idle.

        A failure to start is kept and raised by `acquire`, inside the run's MLflow record.
        """
        import ray

        from stapoctl.trainer.engines import launch_engines

        self._ensure_scorer(conf)
        parts = engine_parts(conf, policy_path, reference_path)
        key = _canonical(parts)
        if (self.engines is not None and key == self.key) or (self._launch is not None and key == self._launch_key):
            return
        reason = self._reason(parts)
        if self.engines is not None:
            self.console.print(f"starting new engines: {reason}", markup=False, highlight=False)
        self._cancel_launch()
        self._stop_engines()
        self.parts, self._stopped = parts, ""
        try:
            was_up = ray.is_initialized()
            with self.console.status("starting Ray and the engine actors…"):
                self._launch, self._launch_key = launch_engines(conf, policy_path, self.console, reference_path), key
            self._launch.reason = reason
            self.started_ray = self.started_ray or not was_up
        except Exception as exc:
            self.started_ray = self.started_ray or ray.is_initialized()
            self._launch_error, self._launch_key, self._stopped = exc, key, "previous start failed"

    def _reason(self, parts: dict) -> str:
        """Why engines for `parts` start now (`engines.info["reason"]`: the suite's start table
        prints it): the settings that differ from the last engines', or what ended those."""
        if self.engines is None and self._stopped:
            return self._stopped
        if self.parts is None:
            return "first start"
        return why_restart(self.parts, parts) or "new engines for the same settings"

    def acquire(self, conf: DictConfig, policy_path: str, reference_path: Optional[str] = None) -> tuple[Any, Any]:
        """Engines ready for a new run of `conf` starting from `policy_path`'s weights (its KL
        reference from `reference_path`, when that is another model: a resumed run's base)."""
        from stapoctl.trainer.engine_settings import learner_args, stall_timeout_s, thread_counts

        self._ensure_scorer(conf)
        key = engine_key(conf, policy_path, reference_path)
        if self._launch_key is not None and self._launch_key != key:
            self._cancel_launch()  # prepared for another config
            self._stopped = "a start prepared for other settings was cancelled"
        if self._launch_error is not None:
            exc, self._launch_error, self._launch_key = self._launch_error, None, None
            raise exc
        if self.engines is not None and key == self.key:
            t0 = time.perf_counter()
            args = learner_args(conf, reference_path)
            try:
                self.engines.learners.reset(policy_path, **args)
            except Exception as exc:  # a rank's UserError (e.g. loss.modules' import): its one line, not Ray's stack
                if isinstance(getattr(exc, "cause", None), UserError):
                    raise exc.cause from None
                raise
            if self.engines.stall is not None:  # the driver's bound, not the engines': this run's value
                self.engines.stall.timeout_s = stall_timeout_s(conf)
            # the reset set this run's learner threads (the rollout's are the engines', part of the key)
            self.engines.info["threads"] = dict(zip(("rollout", "learner"), thread_counts(conf)))
            self.engines.push_weights()  # every vLLM actor back to the base weights
            self.engines.info["reset_s"] = time.perf_counter() - t0
            self.engines.info["reused"] = True
            self.runs += 1
            return self.engines, self.scorer
        if self._launch is None:
            self.prepare(conf, policy_path, reference_path)
            if self._launch_error is not None:
                return self.acquire(conf, policy_path, reference_path)
        launch, self._launch, self._launch_key = self._launch, None, None
        with self.console.status(f"starting {conf.rollout.num_workers} vLLM rollout actor(s) and "
                                 f"{conf.learner.num_ranks} DeepSpeed learner rank(s) (ZeRO-{conf.learner.zero_stage})…"):
            try:
                self.engines = launch.ready()
            except BaseException:
                self._stopped = "previous start failed"
                raise
        self.engines.info["reused"] = False
        self.key, self._stopped = key, ""
        self.runs += 1
        return self.engines, self.scorer

    def _ensure_scorer(self, conf: DictConfig) -> None:
        from stapoctl.rollout.model_verifier import reward_pool

        reward_key = repr(OmegaConf.to_container(conf.reward, resolve=True))
        if self.scorer is not None and reward_key != self.scorer_key:
            self.scorer.close()
            self.scorer = None
        if self.scorer is None:
            self.scorer, self.scorer_key = reward_pool(conf.reward), reward_key

    def _cancel_launch(self) -> None:
        launch, self._launch, self._launch_key, self._launch_error = self._launch, None, None, None
        if launch is not None:
            launch.abort()

    def discard(self) -> None:
        """Forget the engines after a failed run: they may hold a half-finished step."""
        if self.engines is not None:
            self._stopped = "previous engines discarded"
        self._stop_engines()

    def _stop_engines(self) -> None:
        if self.engines is not None:
            try:
                self.engines.shutdown()
            finally:
                self.engines, self.key = None, None

    def close(self) -> None:
        """vLLM first (shared memory), then the actors, the verifier pool and the Ray we started."""
        try:
            self._cancel_launch()
            self._stop_engines()
        finally:
            self.parts, self._stopped = None, ""
            if self.scorer is not None:
                self.scorer.close()
                self.scorer = None
            if self.started_ray:
                from stapoctl.launch.ray_runtime import shutdown_ray

                shutdown_ray()
                self.started_ray = False
