"""DAPO dynamic sampling (`trainer.dynamic_sampling`, stapoctl/trainer/dynamic_sampling.py).

The bookkeeping first, without engines: which groups are dropped (acc vs score), how rounds fill a
batch, the short-batch rule, the seeds and sampler states of rounds in the synchronous and the
asynchronous loop, a step's update on the kept groups. A fake `StepRunner` returns hand-made
batches in place of vLLM. Then (`e2e`) the tiny default through the real engines: kept_frac between
0 and 1 at its warm start, full batches, a short batch with its one console line, a step without
an update, a resume that draws what the uninterrupted run drew, async with two rollout workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from stapoctl.errors import UserError
from stapoctl.rollout.batch import RolloutBatch
from stapoctl.trainer import dynamic_sampling as ds

N = 4  # responses per prompt in the hand-made batches


def scored(prompts: list[int], acc: list[list[int]], penalty: list[list[float]] | None = None,
           offset: int = 0) -> RolloutBatch:
    """A scored round: prompt p's group gets the rule verdicts acc[k] (reward ±1) plus a penalty."""
    k = len(prompts)
    b = RolloutBatch.from_token_lists(
        [[100 + p] for p in prompts], [[[p, j + 1] for j in range(N)] for p in prompts],
        [[[-0.1, -0.2]] * N] * k, [[False] * N] * k, [[f"{p}.{j}" for j in range(N)] for p in prompts],
        pad_id=0, group_offset=offset, prompt_index=prompts)
    a = torch.tensor([float(v) for row in acc for v in row])
    pen = torch.tensor([float(v) for row in (penalty or [[0.0] * N] * k) for v in row])
    return b.with_(rule_accuracy=a, rewards=2 * a - 1 + pen, advantages=torch.zeros(len(a)))


MIXED, RIGHT, WRONG = [1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]


# -- which groups are dropped ----------------------------------------------------------------------
def test_acc_drops_uniform_verdicts_even_when_a_penalty_makes_the_scores_differ():
    b = scored([7, 8, 9, 3], [RIGHT, MIXED, WRONG, RIGHT], [[0, -0.5, 0, 0], [0] * 4, [0] * 4, [0] * 4])
    assert ds.informative_groups(b, "acc") == [1]
    # score: the final reward; the penalised all-correct group now differs, the plain one does not
    assert ds.informative_groups(b, "score") == [0, 1]


# -- rounds → batch --------------------------------------------------------------------------------
def rounds_of(*patterns, staleness=None):
    """A `next_round` returning, in turn, rounds whose groups have the given verdict patterns."""
    made = []
    for r, pattern in enumerate(patterns):
        prompts = [10 * r + g for g in range(len(pattern))]
        made.append(ds.Round(scored(prompts, pattern), staleness=(staleness or [0] * len(patterns))[r],
                             sampler_state={"epoch": 0, "position": 4 * (r + 1)},
                             workers=[g * 2 // len(pattern) for g in range(len(pattern)) for _ in range(N)]))
    it = iter(made)
    return lambda: next(it)


def test_rounds_continue_until_the_batch_is_full_and_the_surplus_is_dropped():
    got = ds.gather_groups(rounds_of([MIXED, WRONG, MIXED, MIXED], [RIGHT, MIXED, MIXED, WRONG]),
                           target=4, max_rounds=10, unit=2, metric="acc")
    assert len(got.rounds) == 2 and got.kept == 5 and got.generated == 8 and got.trained == 4
    b = got.batch
    # round 0's groups 0, 2, 3 then round 1's group 1; round 1's group 2 is kept but beyond the batch
    assert b.prompt_index.tolist() == [p for p in (0, 2, 3, 11) for _ in range(N)]
    assert b.group_ids.tolist() == [g for g in range(4) for _ in range(N)], "ids renumbered: rounds reuse them"
    assert b.rule_accuracy.tolist() == MIXED * 4
    assert got.workers == [0] * N + [1] * N + [1] * N + [0] * N


def test_the_round_limit_trains_a_multiple_of_the_mini_batch_or_nothing():
    three = ds.gather_groups(rounds_of([MIXED, MIXED, WRONG, MIXED]), target=4, max_rounds=1, unit=2, metric="acc")
    assert three.kept == 3 and three.trained == 2  # the largest multiple of the mini-batch
    one = ds.gather_groups(rounds_of([MIXED, RIGHT, WRONG, RIGHT], [RIGHT] * 4), target=4, max_rounds=2, unit=2,
                           metric="acc")
    assert len(one.rounds) == 2 and one.kept == 1 and one.batch is None and one.trained == 0
    unlimited = ds.gather_groups(rounds_of(*([[WRONG] * 4] * 5 + [[MIXED] * 4])), target=4, max_rounds=0, unit=2,
                                 metric="acc")
    assert len(unlimited.rounds) == 6 and unlimited.trained == 4


def test_a_batch_is_as_stale_as_its_stalest_trained_group():
    # round 0 (sampled one update behind) gives no group; the batch is round 1's, on-policy
    fresh = ds.gather_groups(rounds_of([WRONG] * 4, [MIXED] * 4, staleness=[1, 0]), target=4, max_rounds=3, unit=2,
                             metric="acc")
    assert fresh.staleness == 0
    mixed = ds.gather_groups(rounds_of([MIXED, WRONG, WRONG, MIXED], [MIXED] * 4, staleness=[1, 0]), target=4,
                             max_rounds=3, unit=2, metric="acc")
    assert mixed.staleness == 1


def test_round_metrics_sum_times_and_counts_and_average_the_rest():
    a = ds.Round(scored([1], [MIXED]), metrics={"timing_s/gen": 1.0, "perf/gen_tokens_per_s": 100.0,
                                                "reward/verify_timeouts": 1.0, "reward/no_answer": 0.5,
                                                "async/staleness": 1.0})
    b = ds.Round(scored([2], [MIXED]), metrics={"timing_s/gen": 3.0, "perf/gen_tokens_per_s": 300.0,
                                                "reward/verify_timeouts": 2.0, "reward/no_answer": 0.0,
                                                "async/staleness": 0.0})
    m = ds.round_metrics([a, b])
    assert m["timing_s/gen"] == 4.0 and m["reward/verify_timeouts"] == 3.0 and m["async/staleness"] == 1.0
    assert m["perf/gen_tokens_per_s"] == pytest.approx(1000 / 4) and m["reward/no_answer"] == 0.25


# -- the engine side, with a fake runner ------------------------------------------------------------
class FakeRunner:
    """The StepRunner calls dynamic sampling makes; a prompt's verdicts come from `pattern(prompt)`."""

    def __init__(self, pattern, loss="grpo"):
        from stapoctl.config.loss_settings import build_loss_config

        self.pattern, self.pad_id, self.loss_config = pattern, 0, build_loss_config({"name": loss})
        self.learner_version = self.weight_version = 0
        self.launched, self.updates, self.syncs, self._worker_rows = [], [], [], []

    def launch_rollout(self, indices, step, sampler_state=None, *, seed_key=()):
        self.launched.append((step, seed_key, list(indices)))
        return SimpleNamespace(indices=list(indices), version=self.weight_version, sampler_state=dict(sampler_state))

    def collect(self, pending):
        b = scored(pending.indices, [self.pattern(p) for p in pending.indices])
        self._worker_rows = [0] * len(b)
        return b, {"timing_s/gen": 0.1, "perf/gen_tokens_per_s": 10.0,
                   "async/staleness": float(self.learner_version - pending.version)}

    def score(self, batch):
        return batch, {"reward/accuracy": float(batch.rule_accuracy.mean()), "timing_s/reward": 0.01}

    def update(self, batch, step, *, staleness=0):
        self.updates.append((step, batch, staleness))
        self.learner_version += 1
        return {"actor/pg_loss": 0.0}

    def sync(self, wait=True):
        self.syncs.append(wait)
        self.weight_version += 1
        return {"timing_s/sync": 0.0}


def conf(*extra):
    from stapoctl.config.compose import compose_config

    return compose_config(["trainer.dynamic_sampling=true", "data.train_batch_size=4",
                           "learner.ppo_mini_batch_size=2", *extra])


def sampler(num_rows=64, shuffle=True):
    from stapoctl.trainer.sampler import PromptSampler

    return PromptSampler(num_rows, 4, seed=0, shuffle=shuffle)


def every_third_mixed(p):
    return MIXED if p % 3 == 0 else RIGHT


def test_a_full_step_updates_once_on_the_kept_groups_with_their_own_advantages():
    from stapoctl.losses import compute_advantages

    runner, said = FakeRunner(every_third_mixed), []
    dyn = ds.DynamicSampling(conf(), runner, sampler(), ahead=0, total=5, say=said.append)
    batch, m, state = dyn.step(1)
    assert len(runner.updates) == 1 and runner.syncs == [True] and said == []
    assert batch.group_ids.tolist() == [g for g in range(4) for _ in range(N)]
    assert all(p % 3 == 0 for p in batch.prompt_index.tolist())
    assert torch.equal(batch.advantages, compute_advantages("grpo", batch.rewards, batch.group_ids))
    assert batch.advantages.abs().sum() > 0
    rounds = len(runner.launched)
    assert m["dynamic_sampling/gen_rounds"] == rounds and m["dynamic_sampling/prompts_consumed"] == 4 * rounds
    assert m["dynamic_sampling/groups_trained"] == 4 and m["dynamic_sampling/short_batch"] == 0.0
    assert 0 < m["dynamic_sampling/kept_frac"] < 1
    assert state == {"epoch": 0, "position": 4 * rounds}, "the checkpoint counts every consumed prompt"
    # a step's rounds: the first seeded as a plain run's batch, the later ones with their number
    assert [key for _, key, _ in runner.launched] == [()] + [(k,) for k in range(1, rounds)]
    assert m["reward/accuracy"] == 0.5 and m["reward/mean"] == 0.0, "reward/* describe the trained batch"
    assert m["dynamic_sampling/generated_accuracy"] > 0.5


def test_short_steps_say_so_once_and_a_step_without_groups_makes_no_update():
    runner, said = FakeRunner(lambda p: MIXED if p in (0, 1, 2) else WRONG), []
    dyn = ds.DynamicSampling(conf("trainer.max_gen_batches=1"), runner, sampler(shuffle=False), ahead=0, total=3,
                             say=said.append)
    batch, m, _ = dyn.step(1)  # prompts 0-3: three mixed groups → two trained
    assert m["dynamic_sampling/groups_trained"] == 2 and m["dynamic_sampling/short_batch"] == 1.0
    assert len(runner.updates) == 1 and len(batch) == 2 * N
    batch, m, _ = dyn.step(2)  # prompts 4-7: nothing kept → no update, no sync
    assert batch is None and len(runner.updates) == 1 and len(runner.syncs) == 1
    assert m["dynamic_sampling/groups_trained"] == 0 and m["dynamic_sampling/short_batch"] == 1.0
    assert "actor/pg_loss" not in m and "critic/score/mean" not in m and "reward/accuracy" not in m
    assert m["timing_s/gen"] > 0 and m["timing_s/reward"] > 0
    assert len(said) == 1 and "\n" not in said[0] and "step 1 kept 3/4 groups" in said[0], said
    dyn.close()
    assert len(said) == 2 and "2 of 2 steps" in said[1]


def test_async_keeps_rounds_in_flight_and_the_checkpoint_state_excludes_them():
    runner = FakeRunner(every_third_mixed)
    dyn = ds.DynamicSampling(conf(), runner, sampler(), ahead=1, total=3)
    _, m1, state1 = dyn.step(1)
    used1 = int(m1["dynamic_sampling/gen_rounds"])
    assert len(runner.launched) == used1 + 1 and len(dyn.stream.queue) == 1, "one round generates during the update"
    assert state1["position"] == 4 * used1 and runner.syncs == [False]
    _, m2, _ = dyn.step(2)
    # the round launched before step 1's update was sampled one update behind
    assert m2["async/staleness"] == 1.0 and runner.updates[-1][2] == 1
    dyn.step(3)  # the last step launches nothing ahead
    assert len(dyn.stream.queue) == 0
    dyn.close()


def test_a_resumed_run_draws_the_prompts_of_the_uninterrupted_one():
    def run(steps, state=None):
        s = sampler()
        if state:
            s.load_state_dict(state)
        runner = FakeRunner(every_third_mixed)
        dyn = ds.DynamicSampling(conf(), runner, s, ahead=0, total=4)
        out = [dyn.step(t) for t in steps]
        return runner.launched, [o[2] for o in out]

    launched, states = run([1, 2, 3, 4])
    resumed, resumed_states = run([3, 4], json.loads(json.dumps(states[1])))
    assert resumed == [x for x in launched if x[0] >= 3] and resumed_states == states[2:]


def test_without_dynamic_sampling_a_step_is_one_batch_launched_ahead_in_async_mode():
    """The loop's plain source (trainer/loop.py PlainSteps): what the loop did before dynamic sampling."""
    from stapoctl.trainer.loop import PlainSteps

    runner = FakeRunner(every_third_mixed)
    runner.finish = lambda pending, wait_sync=True: (pending.indices, {"wait_sync": wait_sync})
    plain = PlainSteps(runner, sampler(), ahead=1, total=3)
    out = [plain.step(t) for t in (1, 2, 3)]
    assert [step for step, _, _ in runner.launched] == [1, 2, 3] and all(k == () for _, k, _ in runner.launched)
    assert [o[0] for o in out] == [x[2] for x in runner.launched], "each step trains on its own batch"
    assert [o[2]["position"] for o in out] == [4, 8, 12] and out[0][1] == {"wait_sync": False}
    runner.launched.clear()
    sync = PlainSteps(runner, sampler(), ahead=0, total=2)
    assert sync.step(1)[2] == {"epoch": 0, "position": 4} and len(runner.launched) == 1


# -- the config -----------------------------------------------------------------------------------
def test_the_knobs_default_off_and_their_values_are_checked():
    from stapoctl.config.compose import compose_config

    t = compose_config([]).trainer
    assert (t.dynamic_sampling, t.dynamic_sampling_metric, t.max_gen_batches) == (False, "acc", 10)
    with pytest.raises(UserError, match=r"trainer\.max_gen_batches=-1 must lie in \[0, inf\)"):
        compose_config(["trainer.max_gen_batches=-1"])
    with pytest.raises(UserError, match=r"trainer\.dynamic_sampling_metric=reward must be acc or score"):
        compose_config(["trainer.dynamic_sampling_metric=reward"])
    # greedy rollouts (identical responses: every group dropped) are refused for every run now (#48)
    with pytest.raises(UserError, match=r"rollout\.temperature=0\.0 must lie in \[1e-05, inf\)"):
        compose_config(["trainer.dynamic_sampling=true", "rollout.temperature=0"])


def test_a_refusal_is_one_line_and_exit_2():
    res = subprocess.run([sys.executable, "-m", "stapoctl.cli", "train", "--dry-run", "trainer.max_gen_batches=-2"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "trainer.max_gen_batches=-2" in lines[0], res.stderr


# -- end to end: the tiny default through the real engines ----------------------------------------
E2E = ["trainer.dynamic_sampling=true", "eval.every_n_steps=0", "trainer.diagnostics_every=0"]
# as test_weight_transport_e2e's two workers (threads and the push's bound are keys of the
# engines): its object-store run, next in the suite, starts on this async run's engines
TWO_WORKERS = ["rollout.num_workers=2", "rollout.cpus_per_worker=0.5", "learner.cpus=0.5", "rollout.num_threads=1",
               "rollout.weight_sync_timeout_s=60"]


def _state(run_dir: str, step: int) -> dict:
    from pathlib import Path

    return json.loads((Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def e2e(training_store, engine_pool):
    """Runs on one engine session: full (4 steps, checkpoints at 2 and 4), short (one round a step),
    idle (no group can be right: no update), the resume of `full` from step 2, async on 2 workers."""
    from rich.console import Console

    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.driver import train
    out: dict = {}
    session = engine_pool
    with training_store("dynamic_store", E2E) as t:
        def run(name, conf):
            console = Console(width=200, record=True)
            out[name] = train(conf, console=console, session=session)
            out[name]["log"] = console.export_text()

        run("full", t.conf(["trainer.total_steps=4", "trainer.save_freq=2"]))
        out["full_state_4"] = _state(out["full"]["run_dir"], 4)
        run("short", t.conf(["trainer.total_steps=3", "trainer.save_freq=0", "trainer.max_gen_batches=1"]))
        run("idle", t.conf(["trainer.total_steps=2", "trainer.save_freq=2", "trainer.max_gen_batches=2",
                            "rollout.max_response_length=1"]))  # one token: never a boxed answer
        step2 = f"{out['full']['run_dir']}/checkpoints/step_000002"
        run("resumed", compose_config([f"resume={step2}", f"tracking.uri={t.uri}"]))
        run("async", t.conf(["trainer.total_steps=3", "trainer.save_freq=0", "trainer.mode=async", *TWO_WORKERS]))
    out["uri"] = t.uri
    return out


def history(uri: str, run_id: str, key: str) -> dict[int, float]:
    import mlflow

    return {m.step: m.value for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key)}


def status(uri: str, run_id: str) -> str:
    import mlflow

    return mlflow.MlflowClient(uri).get_run(run_id).info.status


@pytest.mark.e2e
def test_full_batches_of_informative_groups_at_the_warm_start(e2e):
    uri, run = e2e["uri"], e2e["full"]["run_id"]
    h = lambda key: history(uri, run, key)  # noqa: E731
    steps = [1, 2, 3, 4]
    kept = h("dynamic_sampling/kept_frac")
    assert sorted(kept) == steps and all(0 < v < 1 for v in kept.values()), kept
    assert h("dynamic_sampling/groups_trained") == {s: 8.0 for s in steps}
    assert h("dynamic_sampling/short_batch") == {s: 0.0 for s in steps}
    rounds, consumed = h("dynamic_sampling/gen_rounds"), h("dynamic_sampling/prompts_consumed")
    assert all(consumed[s] == 8 * rounds[s] for s in steps)
    # the learner saw 8 groups: 4 mini-batches of 2, one optimizer step each
    assert h("actor/optimizer_steps") == {s: 4.0 * s for s in steps}
    # no trained group is uniform (verdicts): none all right, none all wrong
    assert set(h("batch/solve_all").values()) == {0.0} and set(h("batch/solve_none").values()) == {0.0}
    assert 0 < min(h("reward/accuracy").values()) and max(h("reward/accuracy").values()) < 1
    # the checkpoint's sampler counts every prompt the steps consumed
    assert _state(e2e["full"]["run_dir"], 2)["sampler"] == {"epoch": 0, "position": int(consumed[1] + consumed[2])}
    assert "dynamic sampling:" not in e2e["full"]["log"]
    assert status(uri, run) == "FINISHED"


@pytest.mark.e2e
def test_one_round_a_step_trains_a_short_batch_and_says_so_once(e2e):
    uri, run = e2e["uri"], e2e["short"]["run_id"]
    assert history(uri, run, "dynamic_sampling/gen_rounds") == {1: 1.0, 2: 1.0, 3: 1.0}
    trained = history(uri, run, "dynamic_sampling/groups_trained")
    assert all(v % 2 == 0 and v < 8 for v in trained.values()), trained  # multiples of the mini-batch
    assert history(uri, run, "dynamic_sampling/short_batch") == {1: 1.0, 2: 1.0, 3: 1.0}
    lines = [line for line in e2e["short"]["log"].splitlines() if "dynamic sampling: step" in line]
    assert len(lines) == 1 and "trainer.max_gen_batches=1" in lines[0], e2e["short"]["log"]
    assert "3 of 3 steps trained on fewer than 8 groups" in e2e["short"]["log"]
    assert status(uri, run) == "FINISHED"


@pytest.mark.e2e
def test_a_step_without_an_informative_group_leaves_the_weights_untouched(e2e):
    from transformers import AutoModelForCausalLM

    uri, idle = e2e["uri"], e2e["idle"]
    run = idle["run_id"]
    assert history(uri, run, "dynamic_sampling/groups_trained") == {1: 0.0, 2: 0.0}
    assert history(uri, run, "dynamic_sampling/gen_rounds") == {1: 2.0, 2: 2.0}
    assert history(uri, run, "actor/optimizer_steps") == {} and history(uri, run, "timing_s/sync") == {}
    state = _state(idle["run_dir"], 2)
    assert state["sampler"]["position"] == 2 * 2 * 8
    model = AutoModelForCausalLM.from_pretrained(f"{idle['run_dir']}/checkpoints/step_000002/model")
    base = AutoModelForCausalLM.from_pretrained(state["base_model"])
    for (name, a), b in zip(model.state_dict().items(), base.state_dict().values()):
        assert torch.equal(a, b), name
    assert "no update" in idle["log"] and status(uri, run) == "FINISHED"


@pytest.mark.e2e
def test_a_resumed_run_draws_the_same_rounds(e2e):
    uri, first, resumed = e2e["uri"], e2e["full"], e2e["resumed"]
    assert resumed["run_id"] == first["run_id"]
    # steps 3-4 recomputed from the step-2 checkpoint: the same trained batches (prompts and tokens)
    assert resumed["replayed"] == {"steps": [3, 4], "mismatched": []}
    rounds = history(uri, first["run_id"], "dynamic_sampling/gen_rounds")
    assert rounds[3] + rounds[4] > 2, "every step filled its batch in one round: the check would be vacuous"
    for key in ("dynamic_sampling/gen_rounds", "dynamic_sampling/prompts_consumed", "dynamic_sampling/kept_frac",
                "batch/prompts_fingerprint", "critic/score/mean"):
        assert resumed["final"][key] == history(uri, first["run_id"], key)[4], key
    assert _state(first["run_dir"], 4)["sampler"] == e2e["full_state_4"]["sampler"]


@pytest.mark.e2e
def test_async_rounds_on_two_workers(e2e):
    uri, run = e2e["uri"], e2e["async"]["run_id"]
    assert history(uri, run, "dynamic_sampling/groups_trained") == {1: 8.0, 2: 8.0, 3: 8.0}
    staleness = history(uri, run, "async/staleness")
    assert staleness[1] == 0.0 and set(staleness.values()) <= {0.0, 1.0}
    # every trained row is attributed to the worker that sampled it (the sync canary per worker)
    for j in (0, 1):
        assert history(uri, run, f"rollout/logprob_diff_max/worker_{j}"), j
    assert status(uri, run) == "FINISHED"
