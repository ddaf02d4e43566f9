"""One training step, stage by stage: rollout → reward and advantages → update → weight sync
(each one Ray call to the engines), and the metrics of the scored batch.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from stapoctl.config.loss_settings import build_loss_config
from stapoctl.reward.overlong import overlong_stats
from stapoctl.trainer.setup import TrainData


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
        from stapoctl.trainer.engine_settings import old_logprob_source

        self.conf, self.engines, self.scorer, self.data = conf, engines, scorer, data
        self.prompt_ids, self.answers, self.questions = data.prompt_ids, data.answers, data.questions
        self.kinds = data.kinds  # answer kinds: how each list gold compares (None: by its form)
        # the typed loss config, built once per run: the advantages, drift and diagnostics all read this object
        self.loss_config = build_loss_config(conf.loss)
        self.pad_id = int(engines.info.get("pad_token_id") or 0)
        self.old_source = old_logprob_source(conf)
        self.start_step = int(start_step)
        self.weight_version = self.learner_version = 0
        self._worker_rows: list[int] = []  # the rollout worker of each row of the batch to train on
        self._diag_pool: Any = None
        self._diag_jobs: list = []
        self._last_drift: Any = None  # losses/drift.py Drift of the last measured step (the trace page reads it)

    # -- rollout ---------------------------------------------------------------------------
    def launch_rollout(self, indices: list[int], step: int, sampler_state: Optional[dict] = None, *,
                       seed_key: tuple = ()) -> PendingRollout:
        """Send the prompts to the workers (contiguous blocks; seeds per prompt, so the split
        does not change what is sampled) and return at once. `seed_key`: more parts of each
        request's seed (dynamic sampling's later rounds of a step draw other samples)."""
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
                seed=[prompt_seed(run_seed, step, i, *seed_key) for i in block],
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
        parts = self.engines.gather_rollouts(pending.refs, pending.submit, pending.jobs,
                                             doing=f"generating the step-{pending.step} rollouts")
        wait = time.perf_counter() - t0
        batch = RolloutBatch.concat([p[0] for p in parts], pad_id=self.pad_id)
        self._worker_rows = [j for j, p in enumerate(parts) for _ in range(len(p[0]))]
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
                                           [self.questions[i] for i in rows],
                                           [self.kinds[i] for i in rows] if self.kinds else None)
        penalty = overlong_penalty(batch, self.conf)  # DAPO's soft overlong punishment (0 when off)
        rewards_t = torch.as_tensor(rewards, dtype=torch.float32) + penalty
        adv = compute_advantages(self.loss_config, rewards_t, batch.group_ids)
        correct = float(self.conf.reward.get("correct", 1.0))  # the rule's verdict per row, before any shaping
        accuracy = torch.as_tensor([float(r == correct) for r in rewards], dtype=torch.float32)
        batch = batch.with_(rewards=rewards_t, advantages=adv, rule_accuracy=accuracy)
        metrics = dict(stats)
        metrics.update(overlong_stats(penalty.tolist(), batch.truncated.tolist(),
                                      bool(self.conf.reward.get("overlong_filter", False))))
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
        # async: the previous push may still be in flight; rank 0 runs train_step only after its
        # send, so wait on the push first, bounded by rollout.weight_sync_timeout_s (a worker stalled
        # in it is named there) rather than on train_step without a bound
        self.engines.wait_weights()
        result = self.engines.learners.train_step(loss_view(batch, self.conf), step, self.old_source,
                                                  measure=self.measure_due(step), behavior=staleness > 0)
        self.learner_version += 1
        m = dict(result.metrics)
        self._last_old, self._last_entropy = result.old_log_probs, result.entropy
        self._last_drift = self._drift(batch, result) if result.old_log_probs is not None else None
        for k, v in (self._last_drift.metrics.items() if self._last_drift is not None else ()):
            m.setdefault(k, v)  # the loss's own value stays where it measured one (behaviour log-probs given)
        diff_rows = result.logprob_diff_rows
        workers = self._worker_rows
        if diff_rows is not None and len(set(workers)) > 1 and len(workers) == len(diff_rows):
            for j in sorted(set(workers)):  # per rollout worker (the live view and tests read the max)
                rows = [k for k, w in enumerate(workers) if w == j]
                m[f"rollout/logprob_diff_max/worker_{j}"] = float(diff_rows[rows].max())
        if result.old_log_probs is not None and batch.rollout_log_probs is not None:  # the sync canary's p99
            from stapoctl.trainer.sync_canary import diff_p99, per_worker_p99

            view = loss_view(batch, self.conf)  # the response tokens the learner measured
            args = (result.old_log_probs, view.rollout_log_probs, view.response_mask)
            if "rollout/logprob_diff_p99" not in m:  # drift.py logs it where it ran (the same definition)
                m["rollout/logprob_diff_p99"] = diff_p99(*args)
            m.update(per_worker_p99(*args, workers))
        return m

    def _drift(self, batch, result):
        """Learner vs vLLM log-probs of the measured step, per cell and per rule (losses/drift.py)."""
        from stapoctl.losses.drift import drift

        if result.entropy is None or batch.rollout_log_probs is None:
            return None
        view = loss_view(batch, self.conf)
        mini_rows = int(self.conf.learner.ppo_mini_batch_size) * int(self.conf.rollout.n)
        return drift(self.loss_config, learner_log_prob=result.old_log_probs,
                     rollout_log_prob=view.rollout_log_probs, entropy=result.entropy, advantages=view.advantages,
                     response_mask=view.response_mask, mini_rows=mini_rows)

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
        args = (loss_view(batch, self.conf), self._last_old, self._last_entropy, self.loss_config)
        kwargs = dict(step=step, mini_rows=mini_rows, decode=self.data.tokenizer.decode, keep_dir=keep, buffer=active(),
                      drift=getattr(self, "_last_drift", None), seed=int(OmegaConf.select(self.conf, "trainer.seed",
                                                                                          default=0) or 0),
                      upload=bool(OmegaConf.select(self.conf, "tracking.log_artifacts", default=True)))
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
    correct = ((rewards - overlong_penalty(batch, conf)) > 0).float()  # the rule's verdict, before shaping
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


def overlong_penalty(batch, conf: DictConfig):
    """[N] DAPO's soft overlong penalty of each response (`reward/overlong.py`; zeros when
    reward.overlong_buffer is 0), with L_max = rollout.max_response_length. A function of the batch's
    lengths and the config alone, so `batch_metrics` can take it off the rewards again."""
    import torch

    from stapoctl.reward.overlong import overlong_penalties

    buffer = int(OmegaConf.select(conf, "reward.overlong_buffer", default=0) or 0)
    if not buffer:  # off (also for a config from before the knob existed)
        return torch.zeros(len(batch), dtype=torch.float32)
    factor = float(OmegaConf.select(conf, "reward.overlong_penalty", default=1.0))
    penalties = overlong_penalties(batch.response_lengths().tolist(), int(conf.rollout.max_response_length),
                                   buffer, factor)
    return torch.as_tensor(penalties, dtype=torch.float32)


def loss_view(batch, conf: DictConfig):
    """The batch as the learner's loss sees it. With reward.overlong_filter (DAPO's overlong
    filtering) the truncated rows — stopped by rollout.max_response_length, not by EOS — leave the
    loss entirely: their response_mask rows are cleared. That mask is what every loss sums over and
    what its denominators count (token-mean's tokens, seq-mean's non-empty rows, STAPO's entropy
    quantile over M), so the rows weigh nothing; zeroing their advantages instead would still count
    their tokens. Their rewards did enter their group's advantage baseline (as in verl). The scored
    batch itself stays whole for the metrics (lengths, clip ratio) and the logged samples."""
    if not OmegaConf.select(conf, "reward.overlong_filter", default=False) or not bool(batch.truncated.any()):
        return batch
    return batch.with_(response_mask=batch.response_mask & ~batch.truncated[:, None])


def fingerprint(*tensors) -> float:
    """A 24-bit hash of tensors, exact as an MLflow float: equal batches ⇔ equal numbers (w.h.p.)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return float(int(h.hexdigest()[:6], 16))
