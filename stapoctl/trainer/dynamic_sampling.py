"""DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476 §3.2; verl's `algorithm.filter_groups`).

A prompt group whose n responses all score alike carries no GRPO gradient: every advantage is 0.
With `trainer.dynamic_sampling=true` a step generates rounds of `data.train_batch_size` new
prompts, drops each group whose n values of `trainer.dynamic_sampling_metric` are all equal (acc:
the rule verdicts, so an overlong penalty does not make an all-correct group differ; score: the
final rewards, shaping included) and goes on until `train_batch_size` groups are kept. Groups kept
beyond the batch are dropped, their prompts consumed (as verl does). After
`trainer.max_gen_batches` rounds (0: no limit) the step trains on the largest multiple of
`learner.ppo_mini_batch_size` groups it kept, or makes no update when that is none; verl raises
"Generated too many" there and the run ends. The console says so once; `dynamic_sampling/*`
logs it every step.

The bookkeeping (`informative_groups`, `gather_groups`, `assemble`) is pure and tested without
engines; `RoundStream` launches, collects and scores rounds through the `StepRunner`;
`DynamicSampling.step` is one training step (advantages on the kept groups, update, sync, metrics).

Rounds in the asynchronous loop: K = `trainer.max_staleness` rounds stay in flight beyond the one
being collected, so the next step's first rounds generate while the learner updates (K = 0 is the
synchronous loop: a round is sent when the step needs it). A step's batch may then mix groups
sampled by weights 0..K updates behind. Every row keeps vLLM's log-probs of the weights that sampled
it, so the learner's importance weight min(π_old/π_behav, C) is right row by row; the step's
`async/staleness` is the largest among its groups. The checkpoint's sampler state is the one right
after the last round the step consumed: a resumed run redraws the rounds that were in flight.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omegaconf import DictConfig

from stapoctl.trainer.step_runner import batch_metrics, overlong_penalty

PREFIX = "dynamic_sampling/"
SUMMED = ("reward/verify_timeouts", "reward/verify_errors")  # counts of the verifier's events, per step
GENERATION = ("timing_s/", "perf/", "async/")  # what a step without an update logs besides SUMMED


def train_unit(conf: DictConfig) -> int:
    """Groups the learner's batch must be a multiple of: `learner.ppo_mini_batch_size`. The learner
    cuts its batch into mini-batches of that many groups (× rollout.n rows) and each mini-batch into
    equal shares of its ranks, which its set-up already checks divide the mini-batch's rows; so any
    multiple of the mini-batch splits over any rank count the run was allowed to start with."""
    return int(conf.learner.ppo_mini_batch_size)


def group_values(batch, metric: str):
    """[N] what a group's responses must differ in: the rule verdicts (acc) or the final rewards (score)."""
    values = batch.rule_accuracy if metric == "acc" else batch.rewards
    if values is None:
        raise ValueError(f"dynamic sampling on {metric} needs a scored batch (StepRunner.score)")
    return values


def informative_groups(batch, metric: str) -> list[int]:
    """The ids of the groups whose values are not all equal, in row order (verl keeps std > 0)."""
    values, ids = group_values(batch, metric), batch.group_ids
    out: list[int] = []
    for g in dict.fromkeys(ids.tolist()):
        v = values[ids == g]
        if bool((v != v[0]).any()):
            out.append(int(g))
    return out


@dataclass
class Round:
    """One generation round: the scored groups of `data.train_batch_size` new prompts."""

    batch: Any  # RolloutBatch with rewards and rule_accuracy
    staleness: int = 0  # updates its sampling weights lagged the learner by when it was collected
    sampler_state: dict = field(default_factory=dict)  # the prompt sampler right after its prompts
    metrics: dict = field(default_factory=dict)  # its generation and reward metrics
    workers: list = field(default_factory=list)  # the rollout worker of each row (empty: unknown)

    @property
    def groups(self) -> int:
        return len(set(self.batch.group_ids.tolist()))


@dataclass
class StepGroups:
    """What a step's rounds gave: the batch to train on (None: no update) and the counts."""

    rounds: list
    kept: int = 0  # groups that were not uniform, over all rounds (before the cut to the batch)
    batch: Any = None  # the trained groups, ids renumbered 0..K-1 in draw order
    workers: list = field(default_factory=list)  # the rollout worker of each row of `batch`
    staleness: int = 0  # the largest staleness among the trained groups

    @property
    def generated(self) -> int:
        """Groups generated = prompts consumed (each prompt is one group of n responses)."""
        return sum(r.groups for r in self.rounds)

    @property
    def trained(self) -> int:
        return 0 if self.batch is None else len(set(self.batch.group_ids.tolist()))


def gather_groups(next_round: Callable[[], Round], *, target: int, max_rounds: int, unit: int, metric: str,
                  pad_id: int = 0) -> StepGroups:
    """Rounds until `target` groups are kept or `max_rounds` rounds ran (0: no limit). The batch is
    the first `target` kept groups, else the largest multiple of `unit` of them (possibly none)."""
    rounds: list[Round] = []
    kept: list[tuple[int, int]] = []  # (round, group id), in draw order
    while True:
        rounds.append(next_round())
        kept.extend((len(rounds) - 1, g) for g in informative_groups(rounds[-1].batch, metric))
        if len(kept) >= target or (max_rounds > 0 and len(rounds) >= max_rounds):
            break
    take = target if len(kept) >= target else len(kept) // unit * unit
    out = StepGroups(rounds, kept=len(kept))
    if take > 0:
        out.batch, out.workers, out.staleness = assemble(rounds, kept[:take], pad_id)
    return out


def assemble(rounds: list, chosen: list, pad_id: int = 0) -> tuple[Any, list, int]:
    """(batch, row workers, max staleness) of the `chosen` (round, group id) groups, in that order,
    with group ids renumbered 0..K-1 (ids repeat across rounds: each round numbers its own)."""
    import torch

    from stapoctl.rollout.batch import RolloutBatch

    by_round: dict[int, list[int]] = {}
    for k, g in chosen:
        by_round.setdefault(k, []).append(g)
    parts, workers, staleness, new_id = [], [], 0, 0
    for k, groups in by_round.items():
        r = rounds[k]
        rows, ids = [], []
        for g in groups:
            mine = (r.batch.group_ids == g).nonzero().flatten().tolist()
            rows += mine
            ids += [new_id] * len(mine)
            new_id += 1
        parts.append(r.batch.select(rows).with_(group_ids=torch.as_tensor(ids, dtype=torch.long)))
        workers += [r.workers[i] for i in rows] if r.workers else []
        staleness = max(staleness, int(r.staleness))
    return RolloutBatch.concat(parts, pad_id=pad_id), workers, staleness


def round_metrics(rounds: list) -> dict[str, float]:
    """The rounds' generation and reward metrics as one step's: times and the verifier's counts
    summed, throughput over all, staleness the largest, every other key averaged over the rounds
    (= over every generated response: rounds are equally large)."""
    out: dict[str, float] = {}
    keys = dict.fromkeys(k for r in rounds for k in r.metrics)
    for key in keys:
        values = [float(r.metrics[key]) for r in rounds if key in r.metrics]
        if key.startswith("timing_s/") or key in SUMMED:
            out[key] = sum(values)
        elif key == "async/staleness":
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    gen = sum(float(r.metrics.get("timing_s/gen", 0.0)) for r in rounds)
    tokens = sum(float(r.metrics.get("perf/gen_tokens_per_s", 0.0)) * float(r.metrics.get("timing_s/gen", 0.0))
                 for r in rounds)
    if "perf/gen_tokens_per_s" in out:
        out["perf/gen_tokens_per_s"] = tokens / max(gen, 1e-9)
    return out


def sampling_metrics(got: StepGroups, target: int) -> dict[str, float]:
    """`dynamic_sampling/*` of one step."""
    import torch

    accuracy = torch.cat([r.batch.rule_accuracy.float() for r in got.rounds])
    return {
        PREFIX + "gen_rounds": float(len(got.rounds)),
        PREFIX + "kept_frac": got.kept / max(got.generated, 1),
        PREFIX + "prompts_consumed": float(got.generated),
        PREFIX + "groups_kept": float(got.kept),
        PREFIX + "groups_trained": float(got.trained),
        PREFIX + "short_batch": float(got.trained < target),
        PREFIX + "generated_accuracy": float(accuracy.mean()),  # the policy's, before the filter
    }


def trained_reward_metrics(batch, conf: DictConfig) -> dict[str, float]:
    """The reward/* of the trained batch (the rounds' averages describe every generated response)."""
    from stapoctl.reward.extract import extract_answer
    from stapoctl.reward.overlong import overlong_stats

    out = {"reward/mean": float(batch.rewards.mean()),
           "reward/no_answer": sum(extract_answer(t) is None for t in batch.texts) / max(len(batch.texts), 1)}
    out.update(overlong_stats(overlong_penalty(batch, conf).tolist(), batch.truncated.tolist(),
                              bool(conf.reward.get("overlong_filter", False))))
    return out


class RoundStream:
    """The run's generation rounds in draw order, each `data.train_batch_size` new prompts, launched
    through the `StepRunner`; `ahead` of them stay in flight beyond the one being collected."""

    def __init__(self, runner, sampler, ahead: int):
        self.runner, self.sampler, self.ahead = runner, sampler, int(ahead)
        self.queue: deque = deque()
        self._label = (0, 0)  # (step, rounds launched during it): a round's seed, unique in the run

    def _launch(self, step: int) -> None:
        seq = self._label[1] if self._label[0] == step else 0
        self._label = (step, seq + 1)
        indices = self.sampler.next_batch()
        # a step's first round is seeded as a run without dynamic sampling would seed its batch
        self.queue.append(self.runner.launch_rollout(indices, step, self.sampler.state_dict(),
                                                     seed_key=(seq,) if seq else ()))

    def next(self, step: int, prefetch: bool = True) -> Round:
        """The oldest round, collected and scored (with `prefetch`, `ahead` more stay in flight)."""
        while len(self.queue) < 1 + (self.ahead if prefetch else 0):
            self._launch(step)
        pending = self.queue.popleft()
        batch, m_gen = self.runner.collect(pending)
        workers = list(self.runner._worker_rows)
        batch, m_rew = self.runner.score(batch)
        return Round(batch, int(m_gen["async/staleness"]), dict(pending.sampler_state), {**m_gen, **m_rew}, workers)

    def drain(self) -> None:
        """Wait for the rounds still in flight and drop them: no rollout stays queued on an actor
        (a sweep's next trial reuses the actors)."""
        while self.queue:
            self.runner.collect(self.queue.popleft())


class DynamicSampling:
    """The steps of a run with dynamic sampling: `step(n)` → (trained batch or None, metrics,
    sampler state for the checkpoint)."""

    def __init__(self, conf: DictConfig, runner, sampler, *, ahead: int, total: int,
                 say: Optional[Callable[[str], None]] = None):
        t = conf.trainer
        self.conf, self.runner, self.ahead, self.total = conf, runner, int(ahead), int(total)
        self.stream = RoundStream(runner, sampler, ahead)
        self.target = int(conf.data.train_batch_size)
        self.max_rounds = int(t.get("max_gen_batches", 10))
        self.metric = str(t.get("dynamic_sampling_metric", "acc"))
        self.unit = train_unit(conf)
        self.say = say or (lambda msg: None)
        self.steps = self.short_steps = 0
        self.status = ("rounds → reward → filter → update → sync" if not ahead else
                       f"update ‖ {ahead} round(s) ahead → filter → sync")

    def step(self, step: int) -> tuple[Any, dict, dict]:
        t0 = time.perf_counter()
        got = gather_groups(lambda: self.stream.next(step, prefetch=step < self.total), target=self.target,
                            max_rounds=self.max_rounds, unit=self.unit, metric=self.metric,
                            pad_id=self.runner.pad_id)
        metrics = round_metrics(got.rounds)
        batch = None
        if got.batch is not None:
            batch, trained = self._train(got, step)
            metrics.update(trained)
        else:  # nothing trained: no metric of a batch (the rounds' averages would describe another one)
            metrics = {k: v for k, v in metrics.items() if k.startswith(GENERATION) or k in SUMMED}
        metrics.update(sampling_metrics(got, self.target))
        self.steps += 1
        if got.trained < self.target:
            self._short(step, got)
        metrics["timing_s/step"] = time.perf_counter() - t0
        return batch, metrics, got.rounds[-1].sampler_state

    def _train(self, got: StepGroups, step: int) -> tuple[Any, dict]:
        """GRPO advantages on the kept groups (each group's own), the update, the weight sync."""
        from stapoctl.losses import compute_advantages

        runner = self.runner
        batch = got.batch
        batch = batch.with_(advantages=compute_advantages(runner.loss_config, batch.rewards, batch.group_ids))
        runner._worker_rows = list(got.workers)  # the per-worker sync canary of these rows
        metrics = runner.update(batch, step, staleness=got.staleness)
        metrics.update(runner.sync(wait=not self.ahead))
        metrics.update(trained_reward_metrics(batch, self.conf))
        metrics.update(batch_metrics(batch, self.conf))
        metrics["async/staleness"] = float(got.staleness)
        return batch, metrics

    def _short(self, step: int, got: StepGroups) -> None:
        """The first short step says so on the console, in one line; the others are counted."""
        self.short_steps += 1
        if self.short_steps > 1:
            return
        what = f"trained on {got.trained} (whole mini-batches)" if got.trained else "no update (under one mini-batch)"
        self.say(f"dynamic sampling: step {step} kept {got.kept}/{self.target} groups in trainer.max_gen_batches="
                 f"{self.max_rounds} rounds; {what}; later short steps are only logged")

    def close(self, stopping: bool = False) -> None:
        """After the last step: the rounds still in flight collected (not when a signal stopped the
        run), the short steps counted on the console (when more than the first) and as a tag."""
        from stapoctl.tracking.metric_buffer import active

        if not stopping:
            self.stream.drain()
        if self.short_steps > 1:
            self.say(f"dynamic sampling: {self.short_steps} of {self.steps} steps trained on fewer than "
                     f"{self.target} groups (dynamic_sampling/short_batch)")
        buffer = active()
        if buffer is not None:
            buffer.set_tags({"stapoctl.dynamic_sampling_short_steps": str(self.short_steps)})
