"""`stapoctl train`: the synchronous on-policy loop of STAPO (000 Table 6) on real engines.

One step, data flowing one way:
    prompts → vLLM rollouts (RolloutBatch) → rewards → advantages → learner (recompute old
    log-probs, PPO mini-batch updates with the configured loss) → weight sync → metrics.
Every stage is one Ray call; the engines live for the whole run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from stapoctl import paths
from stapoctl.errors import UserError

TRAIN_DATA = {"toy": "toy-train"}  # data.name → the registry's training split


# -- set-up ---------------------------------------------------------------------------------
def check_config(conf: DictConfig) -> None:
    """Everything that would otherwise fail minutes in, inside an actor (see `config.validate`)."""
    from stapoctl.preflight.commands import validate_train

    validate_train(conf)


def resolve_policy(conf: DictConfig, console: Console) -> str:
    """The model to start from ("" builds or finds the cached warm-started tiny model)."""
    from stapoctl.models.resolve import resolve_model

    return str(resolve_model(str(conf.model.path or ""), conf, console=console))


def load_rows(name: str, conf: DictConfig, tokenizer_path: str) -> list[dict]:
    from stapoctl.data.registry import load_rows as registry_load

    return registry_load(name, conf.data, tokenizer_path=tokenizer_path)


def tokenize_prompts(rows: list[dict], tokenizer, max_len: int, what: str, console: Console) -> tuple[list, list]:
    """Token ids of every prompt, once; over-long prompts are dropped (verl does the same)."""
    ids = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    kept = [(i, r) for i, r in zip(ids, rows) if len(i) <= max_len]
    if not kept:
        raise UserError(
            f"every {what} prompt is longer than data.max_prompt_length={max_len} tokens: raise it"
        )
    if len(kept) < len(rows):
        console.print(f"[yellow]{len(rows) - len(kept)} of {len(rows)} {what} prompts exceed "
                      f"data.max_prompt_length={max_len} tokens and are skipped[/]")
    return [k[0] for k in kept], [k[1] for k in kept]


def resume_config(conf: DictConfig, state: dict) -> DictConfig:
    """The run's own saved config, with the values this command line changed on top.

    `stapoctl train resume=ID` alone must continue the run as it was configured (not switch
    to the defaults); `resume=ID trainer.total_steps=200` extends it.
    """
    from stapoctl.config.compose import compose_config, to_flat_dict

    saved = state.get("config")
    if not saved:
        return conf
    defaults = to_flat_dict(compose_config([f"experiment={conf.experiment}"]))
    current = to_flat_dict(conf)
    merged = OmegaConf.create(saved)
    OmegaConf.set_struct(merged, False)
    for key, value in current.items():
        if key != "resume" and key in defaults and defaults[key] != value:
            OmegaConf.update(merged, key, value, force_add=True)
    if current.get("loss.name") != defaults.get("loss.name") and merged.loss.name != conf.loss.name:
        merged.loss = OmegaConf.to_container(conf.loss, resolve=True)  # another loss: its fields only
    merged.resume = conf.resume
    return merged


def fingerprint(*tensors) -> float:
    """A 24-bit hash of tensors, exact as an MLflow float: equal batches ⇔ equal numbers (w.h.p.)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return float(int(h.hexdigest()[:6], 16))


# -- one step --------------------------------------------------------------------------------
@dataclass
class PendingRollout:
    """A step's rollout sent to the workers and not yet collected."""

    step: int
    indices: list
    refs: list
    version: int  # weight syncs the workers had received when it was sent: the sampling weights
    sampler_state: dict  # the prompt sampler right after this step's batch (what a checkpoint records)
    submit: Optional[Callable[[Any, Any], Any]] = None  # (worker, job) → ref: re-sends a block lost with its actor
    jobs: list = field(default_factory=list)  # (worker index, job) per block


class StepRunner:
    """The per-step stages, separated so tests and benchmarks can run (or skip) each one.

    `weight_version` counts the syncs sent to the rollout workers and `learner_version` the
    updates done, both since the engines were (re)loaded; a batch's staleness is how many
    updates its sampling weights lag behind the learner that trains on it.
    """

    def __init__(self, conf: DictConfig, engines, scorer, data: "TrainData", start_step: int = 0):
        from stapoctl.trainer.engines import old_logprob_source

        self.conf, self.engines, self.scorer, self.data = conf, engines, scorer, data
        self.prompt_ids, self.answers, self.questions = data.prompt_ids, data.answers, data.questions
        self.loss_cfg = OmegaConf.to_container(conf.loss, resolve=True)
        self.pad_id = int(engines.info.get("pad_token_id") or 0)
        self.old_source = old_logprob_source(conf)
        self.start_step = int(start_step)
        self.weight_version = self.learner_version = 0
        self._worker_rows: list[int] = []
        self._diag_pool: Any = None
        self._diag_jobs: list = []

    # -- rollout ---------------------------------------------------------------------------
    def launch_rollout(self, indices: list[int], step: int, sampler_state: Optional[dict] = None) -> PendingRollout:
        """Send the prompts to the workers (contiguous blocks; seeds per prompt, so the split
        does not change what is sampled) and return at once."""
        from stapoctl.rollout.vllm_engine import prompt_seed

        r = self.conf.rollout
        workers = self.engines.workers
        per = -(-len(indices) // len(workers))
        run_seed = int(self.conf.trainer.seed)
        blocks = [(j, indices[j * per:(j + 1) * per]) for j in range(len(workers))]

        def submit(worker, job):
            j, block = job
            return worker.rollout.remote(
                [self.prompt_ids[i] for i in block], n=int(r.n), temperature=float(r.temperature),
                top_p=float(r.top_p), max_tokens=int(r.max_response_length),
                seed=[prompt_seed(run_seed, step, i) for i in block],
                pad_id=self.pad_id, group_offset=j * per, prompt_index=block,
            )

        # a block whose actor dies is re-sent (same prompts, same seeds) once it is back: see collect
        jobs = [(j, (j, block)) for j, block in blocks if block]
        refs = self.engines.send_rollouts(submit, jobs)
        return PendingRollout(step, list(indices), refs, self.weight_version, dict(sampler_state or {}), submit, jobs)

    def collect(self, pending: PendingRollout):
        """The batch of a launched rollout; `timing_s/gen` is the workers' own generation time,
        `timing_s/gen_wait` how long the driver waited for it (≈ 0 when it overlapped an update)."""
        from stapoctl.rollout.batch import RolloutBatch

        t0 = time.perf_counter()
        parts = self.engines.gather_rollouts(pending.refs, pending.submit, pending.jobs)
        wait = time.perf_counter() - t0
        batch = RolloutBatch.concat([p[0] for p in parts], pad_id=self.pad_id)
        self._worker_rows = [len(p[0]) for p in parts]
        gen_s = max(p[1]["gen_s"] for p in parts)
        tokens = sum(p[1]["tokens"] for p in parts)
        return batch, {"timing_s/gen": gen_s, "timing_s/gen_wait": wait,
                       "perf/gen_tokens_per_s": tokens / max(gen_s, 1e-9),
                       "async/staleness": float(self.learner_version - pending.version)}

    def rollout(self, indices: list[int], step: int):
        return self.collect(self.launch_rollout(indices, step))

    # -- reward, update, sync ------------------------------------------------------------------
    def score(self, batch):
        import torch

        from stapoctl.losses import compute_advantages

        t0 = time.perf_counter()
        rows = batch.prompt_index.tolist()
        rewards, stats = self.scorer.score(batch.texts, [self.answers[i] for i in rows],
                                           [self.questions[i] for i in rows])
        rewards_t = torch.as_tensor(rewards, dtype=torch.float32)
        adv = compute_advantages(self.loss_cfg["name"], rewards_t, batch.group_ids, **self.loss_cfg)
        batch = batch.with_(rewards=rewards_t, advantages=adv)
        metrics = dict(stats)
        metrics["timing_s/reward"] = time.perf_counter() - t0
        return batch, metrics

    def measure_due(self, step: int) -> bool:
        """Whether the learner runs its no-grad pass over the whole batch this step (always when it
        recomputes old log-probs; else at the first step, every `rollout.logprob_check_every`
        steps and when token diagnostics are due)."""
        if self.old_source == "recompute" or step == self.start_step + 1:
            return True
        every = int(self.conf.rollout.logprob_check_every or 0)
        diag = int(self.conf.trainer.get("diagnostics_every") or 0)
        return bool((every and step % every == 0) or (diag and step % diag == 0))

    def update(self, batch, step: int, *, staleness: int = 0) -> dict:
        m = self.engines.call_learners("train_step", batch, step, self.old_source, measure=self.measure_due(step),
                                       behavior=staleness > 0, is_cap=float(self.conf.trainer.is_cap))
        self.learner_version += 1
        self._last_old = m.pop("_old_log_probs", None)
        self._last_entropy = m.pop("_entropy", None)
        diff_rows = m.pop("_logprob_diff_rows", None)
        rows = self._worker_rows
        if diff_rows is not None and len(rows) > 1:  # the sync canary, per rollout worker
            start = 0
            for j, count in enumerate(rows):
                m[f"rollout/logprob_diff_max/worker_{j}"] = float(diff_rows[start:start + count].max())
                start += count
        return m

    def sync(self, wait: bool = True) -> dict:
        """Learner → every rollout worker (then a check that each live one holds the weights: a
        restarted actor gets them now). wait=False (async) only sends it: each worker loads it
        after the rollouts already queued on it; a lost worker is found when its rollout is collected."""
        self.weight_version += 1
        if wait:
            return self.engines.push_weights()
        t0 = time.perf_counter()
        self.engines.push_weights_async()
        return {"timing_s/sync": time.perf_counter() - t0}

    def log_diagnostics(self, batch, step: int, run_dir: Optional[Path] = None) -> None:
        """000 §3 token diagnostics of the step's batch (π, H of the learner's measuring pass, which
        `measure_due` schedules on these steps); files kept under run_dir/diagnostics until sent.

        Drawn on a background thread while the next steps run: the figure alone took 0.2 s, the
        first one 0.6 s (matplotlib's import), time in which every engine waited on the driver.
        `drain_diagnostics` waits for them; a failure there is reported, it does not fail the run."""
        import concurrent.futures

        from stapoctl.tracking.metric_buffer import active
        from stapoctl.tracking.token_diagnostics import log_step

        if self._last_old is None or self._last_entropy is None:
            return
        mini_rows = int(self.conf.learner.ppo_mini_batch_size) * int(self.conf.rollout.n)
        keep = Path(run_dir) / "diagnostics" / f"step_{step:06d}" if run_dir is not None else None
        args = (batch, self._last_old, self._last_entropy, self.loss_cfg)
        kwargs = dict(step=step, mini_rows=mini_rows, decode=self.data.tokenizer.decode, keep_dir=keep, buffer=active())
        if self._diag_pool is None:
            self._diag_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stapoctl-diagnostics")
        self._diag_jobs.append((step, self._diag_pool.submit(log_step, *args, **kwargs)))

    def drain_diagnostics(self, warn: Optional[Callable[[str], None]] = None) -> None:
        """Wait for the diagnostics still being drawn (before the run's record is closed)."""
        jobs, self._diag_jobs = self._diag_jobs, []
        pool, self._diag_pool = self._diag_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        for step, job in jobs:
            try:
                job.result()
            except Exception as exc:  # a figure that failed loses that figure, not the run
                if warn is not None:
                    warn(f"token diagnostics of step {step} not written: {type(exc).__name__}: {exc}")

    def finish(self, pending: PendingRollout, *, wait_sync: bool = True) -> tuple[Any, dict]:
        """Collect a launched rollout, score it, update on it, sync: one training step."""
        t0 = time.perf_counter()
        batch, m_gen = self.collect(pending)
        staleness = int(m_gen["async/staleness"])
        batch, m_rew = self.score(batch)
        m_upd = self.update(batch, pending.step, staleness=staleness)
        m_sync = self.sync(wait=wait_sync)
        metrics = {**m_gen, **m_rew, **m_upd, **m_sync}
        metrics.update(batch_metrics(batch, self.conf))
        metrics["timing_s/step"] = time.perf_counter() - t0
        return batch, metrics

    def run(self, indices: list[int], step: int) -> tuple[Any, dict]:
        """One synchronous step: rollout → reward → update → sync."""
        t0 = time.perf_counter()
        batch, metrics = self.finish(self.launch_rollout(indices, step))
        metrics["timing_s/step"] = time.perf_counter() - t0
        return batch, metrics


def batch_metrics(batch, conf: DictConfig) -> dict[str, float]:
    """verl-style rollout statistics of a scored batch."""
    import torch

    rewards, adv = batch.rewards, batch.advantages
    lengths = batch.response_lengths().float()
    correct = (rewards > 0).float()
    groups = batch.group_ids
    uniq = torch.unique(groups)
    solve_all = solve_none = 0
    for g in uniq.tolist():
        c = correct[groups == g]
        solve_all += int(bool(c.all()))
        solve_none += int(not bool(c.any()))
    boxed = sum("\\boxed{" in t for t in batch.texts) / max(len(batch.texts), 1)
    return {
        "critic/score/mean": float(rewards.mean()),
        "critic/score/max": float(rewards.max()),
        "critic/score/min": float(rewards.min()),
        "critic/rewards/mean": float(rewards.mean()),
        "critic/advantages/mean": float(adv.float().mean()),
        "critic/advantages/max": float(adv.max()),
        "critic/advantages/min": float(adv.min()),
        "reward/accuracy": float(correct.mean()),
        "reward/boxed_rate": boxed,
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float(batch.truncated.float().mean()),
        "prompt_length/mean": float(batch.prompt_mask.sum(1).float().mean()),
        "batch/solve_all": solve_all / max(len(uniq), 1),
        "batch/solve_none": solve_none / max(len(uniq), 1),
        "batch/fingerprint": fingerprint(batch.prompt_index, batch.response_ids),
        "batch/prompts_fingerprint": fingerprint(batch.prompt_index),
    }


# -- the run -----------------------------------------------------------------------------------
@dataclass
class TrainData:
    """Everything the loop reads per step, tokenised once."""

    tokenizer: Any
    prompt_ids: list
    answers: list[str]
    questions: list[str]
    val_sets: dict  # bench → (eval Problems, k)


def prepare_data(conf: DictConfig, tokenizer_path: str, console: Console) -> TrainData:
    from stapoctl.data.templates import load_tokenizer
    from stapoctl.trainer.engines import max_model_len

    tokenizer = load_tokenizer(str(tokenizer_path))
    rows = load_rows(TRAIN_DATA.get(conf.data.name, conf.data.name), conf, tokenizer_path)
    ids, rows = tokenize_prompts(rows, tokenizer, int(conf.data.max_prompt_length), "training", console)
    val_sets = validation_sets(conf, tokenizer, tokenizer_path, max_model_len(conf, tokenizer_path))
    return TrainData(tokenizer, ids, [str(r["answer"]) for r in rows],
                     [str(r.get("problem", r["prompt"])) for r in rows], val_sets)


def _driver_setup(conf: DictConfig, policy_path: str, console: Console, uri: str) -> TrainData:
    """Tokenizer, prompts and validation sets, the MLflow and torch imports and the store opened
    (a new sqlite store creates its tables here): everything the driver needs before its run
    starts, loaded while Ray and the actors start (nothing before `ray.init` imports torch)."""
    from stapoctl.launch.import_gc import paused_gc

    with paused_gc("mlflow"):
        import mlflow  # noqa: F401  (the driver's heaviest import)
    with paused_gc("torch"):
        import torch  # noqa: F401  (the step loop's; else its first use pays it before step 1)
    if uri.startswith("sqlite:"):  # a server is only asked when the run opens, under its fail-fast limits
        try:
            from mlflow import MlflowClient

            MlflowClient(tracking_uri=uri).get_experiment_by_name(str(conf.tracking.experiment))
        except Exception:  # opening the run reports a store that does not answer, with its fix
            pass
    return prepare_data(conf, policy_path, console)


@contextlib.contextmanager
def running_engines(conf: DictConfig, policy_path: str, resume_dir: Optional[Path], console: Console,
                    session: Any, own: bool):
    """Engines + verifier pool for one run from `session`: kept warm across runs (a sweep's
    trials) or, when the run owns it, shut down after the run by the caller (vLLM, then Ray)."""
    try:
        engines, scorer = session.acquire(conf, policy_path)
        if resume_dir:
            engines.call_learners("load", str(resume_dir))
        info = engines.info
        if info.get("reused"):
            console.print(f"engines reused (learner reset + weight sync in {info['reset_s']:.1f} s)")
        else:
            console.print(f"engines up in {info['engines_s']:.0f} s (vLLM {info['vllm_init_s']:.0f} s, learner "
                          f"{info['learner_setup_s']:.0f} s, in parallel); weight sync: {info['sync_method']}"
                          + ("; learner MKL: AVX-512 kernels on AMD (cluster.mkl_amd_shim)"
                             if info.get("mkl", {}).get("amd_shim") else ""))
        yield engines, scorer
    except BaseException:
        if not own:
            session.discard()  # a failed run may leave its engines mid-step
        raise


def train(conf: DictConfig, console: Optional[Console] = None, session: Any = None) -> dict:
    """Run (or resume) a training run; returns a summary (run id, run dir, first/final metrics).

    `session`: an `EngineSession` whose engines this run reuses (and leaves running).
    Raises `RunStopped` after a signal (checkpoint written, MLflow run KILLED) and `RunFailed`
    when an engine dies (MLflow run FAILED with the reason); see README "Failures and resuming".
    """
    from stapoctl.trainer.signals import GracefulStop

    from stapoctl.trainer.session import EngineSession

    console = console or Console()
    check_config(conf)
    _quiet_engine_logs(conf)
    own = session is None
    with GracefulStop(console) as stop, (EngineSession(console) if own else contextlib.nullcontext(session)) as session:
        return _train(conf, console, session, stop, own)


def _train(conf: DictConfig, console: Console, session: Any, stop, own: bool) -> dict:
    from stapoctl.models.tiny import base_eval
    from stapoctl.tracking import mlflow_run
    from stapoctl import checkpoint
    from stapoctl.trainer.engines import learner_shared_prefix, old_logprob_source
    from stapoctl.preflight.run_dir import run_preflight
    from stapoctl.trainer.run_status import tracked_run
    from stapoctl.trainer.sampler import PromptSampler

    warn = lambda msg: console.print(f"[yellow]{msg}[/]")  # noqa: E731
    uri = mlflow_run.tracking_uri(conf.tracking.uri)
    console.print(f"[bold]MLflow store:[/] {uri}  (experiment '{conf.tracking.experiment}')")

    resume_dir: Optional[Path] = None
    state: dict = {}
    if conf.resume:
        resume_dir = checkpoint.resolve_resume(str(conf.resume), conf.tracking.uri, warn=warn)
        state = checkpoint.read_trainer_state(resume_dir)
        console.print(f"resuming from {resume_dir} (step {state['step']}, MLflow run {state['mlflow_run_id']})")
        conf = resume_config(conf, state)
        check_config(conf)
        if int(state["step"]) >= int(conf.trainer.total_steps):
            return _nothing_to_do(conf, state, uri, console)
    run_dir = Path(state["run_dir"]) if state else None
    run_preflight(conf, uri, run_dir)  # before any compute: output dir, disk space, the MLflow store
    if run_dir is not None:
        checkpoint.remove_partial_writes(run_dir, warn=warn)
    base_model = state["base_model"] if state else resolve_policy(conf, console)
    policy_path = str(resume_dir / "model") if resume_dir else base_model
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stapoctl-setup") as pool:
        # the driver's own set-up (2-3 s here) on a thread while this one starts Ray and the engine
        # actors, mostly waiting on Ray's processes: it overlaps Ray's start instead of competing
        # with the actors' vLLM and DeepSpeed imports for the cores (vLLM actor up in 5 s, was 6-7)
        setup = pool.submit(_driver_setup, conf, policy_path, console, uri)
        session.prepare(conf, policy_path)
        stop.install()  # ray.init replaced our SIGTERM handler
        data = setup.result()
    sampler = PromptSampler(len(data.prompt_ids), int(conf.data.train_batch_size),
                            seed=int(conf.data.seed), shuffle=bool(conf.data.shuffle))
    if state:
        sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state.get("rng", {}))

    tags = {"stapoctl.kind": "train", "stapoctl.experiment": str(conf.experiment), "stapoctl.loss": str(conf.loss.name),
            **{str(k): str(v) for k, v in (conf.tracking.get("tags") or {}).items()}}
    run_name = conf.tracking.run_name or f"{conf.experiment}-{conf.loss.name}-seed{conf.trainer.seed}"
    output_dir = conf.trainer.output_dir
    with tracked_run(uri=uri, experiment=conf.tracking.experiment, run_name=run_name, console=console,
                     run_id=state.get("mlflow_run_id"), tags=None if state else tags,
                     parent_run_id=None if state else conf.tracking.parent_run_id,
                     run_dir_for=lambda rid: run_dir or Path(output_dir or paths.home() / "runs" / rid),
                     flush_timeout_s=float(conf.tracking.get("flush_timeout_s", 120.0))) as record:
        run_id, run_dir = record.run_id, record.run_dir
        rec = record.buffer
        rec.set_tags({"stapoctl.run_dir": str(run_dir)})
        base = base_eval(base_model)
        if state:
            rec.set_tags({"stapoctl.resumed_from": str(resume_dir)})
        else:
            mlflow_run.log_config(conf)
            rec.set_tags({**mlflow_run.env_snapshot(), "stapoctl.base_model": base_model})
            if base:
                mlflow_run.log_metrics({"base/toy/accuracy_t1": base.get("accuracy_t1"),
                                        "base/toy/accuracy_greedy": base.get("accuracy_greedy")}, step=0)
        console.print(f"MLflow run {run_id} · run dir {run_dir}")
        with running_engines(conf, policy_path, resume_dir, console, session, own) as (engines, scorer):
            stop.install()  # ray.init replaced our SIGTERM handler
            engines.rollout_restarts = int(state.get("rollout_restarts", 0))
            rec.set_tags({"stapoctl.weight_sync": engines.info["sync_method"],
                          "stapoctl.old_logprob_source": old_logprob_source(conf),
                          "stapoctl.threads": json.dumps(engines.info.get("threads", {})),
                          "stapoctl.nodes": json.dumps(engines.info.get("nodes", {})),
                          "stapoctl.learner_mkl": json.dumps(engines.info.get("mkl", {})),
                          "stapoctl.learner_shared_prefix": learner_shared_prefix(conf)})
            loop = Loop(conf, StepRunner(conf, engines, scorer, data, start_step=int(state.get("step", 0))), sampler,
                        run_id, run_dir, base_model, policy_path, stop=stop)
            try:
                with record.ending(), learner_faults(engines, run_id, run_dir):
                    summary = loop.run(int(state.get("step", 0)), console)
            finally:
                stop.cleaning_up = True  # a further signal must not cut the engines' shutdown short
    summary.update(run_id=run_id, run_dir=str(run_dir), tracking_uri=uri)
    if base:
        summary["base_accuracy_t1"] = base.get("accuracy_t1")
    summary["max_log_s"] = rec.max_log_s
    _print_summary(summary, console)
    return summary


def _nothing_to_do(conf: DictConfig, state: dict, uri: str, console: Console) -> dict:
    """Resuming a run whose checkpoint is already at (or past) trainer.total_steps trains nothing:
    say so; send what its journal still holds and end an interrupted record FINISHED."""
    from stapoctl.trainer.run_status import http_fail_fast

    step, total, run_id = int(state["step"]), int(conf.trainer.total_steps), state["mlflow_run_id"]
    if step > total:
        raise UserError(f"trainer.total_steps={total} is below the checkpoint's step {step} of run {run_id}: "
                        f"set trainer.total_steps above {step} to continue it")
    with http_fail_fast():
        _finish_record(Path(state["run_dir"]), run_id, uri, console)
    console.print(f"run already complete at step {step}/{total}; nothing to do — raise trainer.total_steps "
                  "to continue")
    return {"run_id": run_id, "run_dir": state["run_dir"], "tracking_uri": uri, "steps": total, "final": {},
            "nothing_to_do": True}


def _finish_record(run_dir: Path, run_id: str, uri: str, console: Console) -> None:
    import mlflow

    from stapoctl.tracking.metric_buffer import MetricBuffer

    try:
        status = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id).info.status
    except Exception as exc:
        console.print(f"[yellow]MLflow at {uri} not reachable ({' '.join(str(exc).split())[:120]}); "
                      "the run's record is left as it is[/]")
        return
    from stapoctl.trainer.run_status import run_dir_lock

    with run_dir_lock(run_dir):
        buffer = MetricBuffer(run_dir, run_id, uri)
        if status == "RUNNING":  # its driver was killed after the last checkpoint
            buffer.end("FINISHED")
        buffer.close(timeout_s=60)


@contextlib.contextmanager
def learner_faults(engines, run_id: str, run_dir: Path):
    """A dead learner rank ends the run with one line: which rank, why, and how to resume."""
    try:
        yield
    except Exception as exc:
        rank = engines.learner_rank_of(exc)
        if rank is None:
            raise
        from stapoctl.errors import RunFailed
        from stapoctl.checkpoint import latest_step_dir
        from stapoctl.launch.actor_errors import describe_actor_death

        last = latest_step_dir(run_dir)
        where = f"from {last.name}" if last else "from the start (no checkpoint yet)"
        raise RunFailed(f"learner rank {rank} died ({describe_actor_death(exc)}): the run is FAILED; resume "
                        f"{where} with `stapoctl train resume={run_id}`") from exc


def _quiet_engine_logs(conf: DictConfig) -> None:
    """DeepSpeed announces its accelerator when imported (for the env snapshot): say it up front.

    A run that asks for no GPU needs DeepSpeed's CPU accelerator whatever the machine has, so
    only a GPU run imports torch to look (torch then loads on a thread while Ray starts)."""
    import os

    from stapoctl.preflight.machine import gpus_asked, local_gpus

    if not (gpus_asked(conf) and local_gpus() > 0):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


@dataclass
class Loop:
    conf: DictConfig
    runner: "StepRunner"
    sampler: Any
    run_id: str
    run_dir: Path
    base_model: str
    tokenizer_dir: str
    stop: Any = None  # GracefulStop: a signal ends the loop after the step in progress

    def run(self, start_step: int, console: Console) -> dict:
        """Steps start_step+1 … total: step, validate when due, log, checkpoint when due."""
        from stapoctl.tracking import mlflow_run
        from stapoctl.trainer.live_view import LiveView

        conf, runner = self.conf, self.runner
        total = int(conf.trainer.total_steps)
        val_every, save_freq = int(conf.eval.every_n_steps or 0), int(conf.trainer.save_freq or 0)
        diag_every = int(conf.trainer.get("diagnostics_every") or 0)
        val_sets = runner.data.val_sets
        last: dict = {}
        first_val: dict = {}
        replay = ReplayCheck()
        with LiveView(console, total, start_step, title=f"{conf.experiment} · {conf.loss.name}") as view:
            if val_sets and start_step == 0 and conf.trainer.val_before_train:
                view.status("validating the starting policy")
                first_val = self.validate(0)
                mlflow_run.log_metrics(first_val, step=0)
                view.step(0, first_val)
            ahead = int(conf.trainer.max_staleness) if conf.trainer.mode == "async" else 0
            launched: dict[int, PendingRollout] = {}
            next_launch = start_step + 1
            t_prev = time.perf_counter()
            if self.stop is not None:
                self.stop.in_loop, self.stop.step = True, start_step
            saved = start_step
            try:
                for step in range(start_step + 1, total + 1):
                    # async: the rollouts of the next `ahead` steps generate while this step updates
                    while next_launch <= min(step + ahead, total):
                        indices = self.sampler.next_batch()
                        launched[next_launch] = runner.launch_rollout(indices, next_launch, self.sampler.state_dict())
                        next_launch += 1
                    view.status("rollout → reward → update → sync" if not ahead else
                                f"update ‖ rollouts of the next {ahead} step(s) → sync")
                    pending = launched.pop(step)
                    batch, metrics = runner.finish(pending, wait_sync=not ahead)
                    if ahead:  # a step's wall time includes the overlapped generation
                        metrics["timing_s/step"] = time.perf_counter() - t_prev
                    t_prev = time.perf_counter()
                    if val_sets and (step % val_every == 0 or step == total):
                        view.status("validating")
                        metrics.update(self.validate(step))
                        _log_samples(conf, batch, step)
                    metrics["fault/rollout_restarts"] = float(runner.engines.rollout_restarts)
                    replay.check(step, metrics)
                    mlflow_run.log_metrics(metrics, step=step)
                    _set_tags({"stapoctl.step": str(step)})
                    if diag_every > 0 and step % diag_every == 0:
                        runner.log_diagnostics(batch, step, self.run_dir)
                    view.step(step, metrics)
                    last = metrics
                    if self.stop is not None:
                        self.stop.step_done(step, metrics.get("timing_s/step", 0.0))
                    stopping = self.stop is not None and self.stop.requested is not None
                    if (save_freq > 0 and (step % save_freq == 0 or step == total)) or (stopping and step < total):
                        view.status("checkpoint")
                        runner.engines.wait_weights()
                        self.save(step, pending.sampler_state)
                        saved = step
                    if stopping and step < total:
                        break
                runner.engines.wait_weights()
            finally:  # the figures still being drawn go into the run before its record ends
                runner.drain_diagnostics(lambda msg: console.print(f"[yellow]{msg}[/]"))
        replay.report(console)
        out: dict[str, Any] = {"steps": total, "final": dict(last), "replayed": replay.summary()}
        if first_val:
            out["first_val"] = first_val
        if self.stop is not None and self.stop.requested is not None and self.stop.step < total:
            from stapoctl.trainer.signals import signal_name

            self.stop.cleaning_up = True
            raise self.stop.stopped(f"{signal_name(self.stop.requested)}: stopped after step {self.stop.step} "
                                    f"(checkpoint step_{saved:06d}); resume with `stapoctl train resume={self.run_id}`")
        return out

    def validate(self, step: int) -> dict:
        """Validation through the rollout actors; re-run whole if one of them died meanwhile."""
        from stapoctl.trainer.engines import is_rollout_loss

        engines = self.runner.engines
        for attempt in range(3):
            try:
                return _validate(self.conf, engines, self.runner.scorer, self.runner.data.val_sets, step)
            except Exception as exc:
                if not is_rollout_loss(exc) or attempt == 2:
                    raise
                engines.recover_rollouts()
        return {}

    def save(self, step: int, sampler_state: dict) -> Path:
        from stapoctl.errors import RunFailed
        from stapoctl.checkpoint import latest_step_dir

        try:
            return _save(self.runner.engines, self.run_dir, step, sampler_state, self.run_id, self.base_model,
                         self.tokenizer_dir, self.conf)
        except OSError as exc:
            last = latest_step_dir(self.run_dir)
            raise RunFailed(f"the step-{step} checkpoint could not be written to {self.run_dir} ({exc.strerror or exc}): "
                            f"the run is FAILED; free space and resume from {last.name if last else 'the start'} with "
                            f"`stapoctl train resume={self.run_id}`") from exc


@dataclass
class ReplayCheck:
    """Steps a resumed run recomputes because its checkpoint is older than its last logged step.

    Their metrics were logged before the interruption and stay as first logged (each key once
    per step: the journal drops the repeat). The recomputation must draw the same batch, which
    `batch/fingerprint` (prompts and sampled tokens) checks against the logged value.
    """

    steps: list = field(default_factory=list)
    mismatched: list = field(default_factory=list)

    def check(self, step: int, metrics: dict) -> None:
        from stapoctl.tracking.metric_buffer import active

        buffer = active()
        logged = buffer.logged_value("batch/fingerprint", step) if buffer is not None else None
        if logged is None:
            return
        self.steps.append(step)
        if float(logged) != float(metrics.get("batch/fingerprint", float("nan"))):
            self.mismatched.append(step)

    def summary(self) -> dict:
        return {"steps": list(self.steps), "mismatched": list(self.mismatched)}

    def report(self, console: Console) -> None:
        if not self.steps:
            return
        span = f"{self.steps[0]}-{self.steps[-1]}" if len(self.steps) > 1 else str(self.steps[0])
        same = ("the same batches (fingerprints match)" if not self.mismatched else
                f"[yellow]different batches at steps {self.mismatched}[/] (non-deterministic sampling)")
        console.print(f"steps {span} had been trained before the interruption and were recomputed from the "
                      f"checkpoint: {same}; their metrics stay as first logged")
        _set_tags({"stapoctl.replayed_steps": span,
                   **({"stapoctl.replay_mismatch": ",".join(map(str, self.mismatched))} if self.mismatched else {})})


def _set_tags(tags: dict) -> None:
    """Through the run's journal when one is active (never blocks a step), else MLflow directly."""
    from stapoctl.tracking.metric_buffer import active

    buffer = active()
    if buffer is not None:
        buffer.set_tags(tags)
    else:
        import mlflow

        mlflow.set_tags(tags)


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


def validation_sets(conf: DictConfig, tokenizer, tokenizer_path: str, model_len: int) -> dict:
    """bench → (problems, k) for periodic validation; empty when eval.every_n_steps is 0."""
    if int(conf.eval.every_n_steps or 0) <= 0:
        return {}
    from stapoctl.data.benches import expand_benches, samples_per_problem
    from stapoctl.eval.runner import prepare_problems

    out = {}
    for bench in expand_benches(list(conf.eval.benches)):
        rows = load_rows(bench, conf, tokenizer_path)
        out[bench] = (prepare_problems(rows, tokenizer, model_len), samples_per_problem(bench, conf.eval.k))
    return out


def _log_samples(conf, batch, step: int) -> None:
    from stapoctl.tracking.metric_buffer import active

    n = int(conf.trainer.log_samples or 0)
    if n <= 0:
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
          conf: DictConfig) -> Path:
    import ray

    from stapoctl import checkpoint

    def payload(tmp: Path) -> None:
        ray.get([h.save.remote(str(tmp), tokenizer_dir) for h in engines.learners])

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
    return checkpoint.save(run_dir, step, payload, state)


def _print_summary(summary: dict, console: Console) -> None:
    final = summary.get("final", {})
    val = next((v for k, v in final.items() if k.startswith("val/") and "/avg_at_" in k), None)
    first = next((v for k, v in summary.get("first_val", {}).items() if k.startswith("val/") and "/avg_at_" in k), None)
    parts = [f"run {summary.get('run_id')}", f"{summary.get('steps')} steps"]
    if summary.get("base_accuracy_t1") is not None:
        parts.append(f"base model toy acc (T=1.0) {summary['base_accuracy_t1']:.1%}")
    if first is not None:
        parts.append(f"step 0 val {first:.1%}")
    if val is not None:
        parts.append(f"final val {val:.1%}")
    console.print("[bold green]done[/] · " + " · ".join(parts))
    console.print(f"checkpoints: {summary.get('run_dir')}/checkpoints · resume with "
                  f"`stapoctl train resume={summary.get('run_id')}`")
