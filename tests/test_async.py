"""Asynchronous training (`trainer.mode=async`): rollouts of the next step overlap the update.

- `max_staleness=0` is the synchronous loop exactly (same batches, losses, gradients);
- `max_staleness=1` trains step t+1 on a batch sampled by the weights of step t-1: staleness 1
  from step 2 on, and the decoupled-PPO importance weight is applied (its metrics appear) only
  there. The three runs share engines (an `EngineSession`) and pin the thread counts, so float
  summation orders are equal and "exactly" can mean bit for bit.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.e2e

# The same rollout threads in both modes (vLLM's are fixed at its start; auto would give the sync
# run every core and the async ones their share): every core, as the embedded default's sync runs
# have them, so these runs share the suite's default engines (tests/conftest.py POOL_ORDER).
COMMON = ["trainer.total_steps=3", "trainer.save_freq=0", "eval.every_n_steps=0",
          f"rollout.num_threads={len(os.sched_getaffinity(0))}", "learner.num_threads=1",
          "rollout.old_logprob_source=recompute", "learner.ppo_mini_batch_size=2"]
EXACT = ("batch/fingerprint", "critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
         "actor/pg_clipfrac", "stapo/spurious_ratio", "rollout/logprob_diff_max")


@pytest.fixture(scope="module")
def runs(training_store, engine_pool):
    from stapoctl.trainer.driver import train
    with training_store("async_store", COMMON) as t:
        out = {name: train(t.conf(extra), console=t.console, session=engine_pool)["run_id"] for name, extra in (
            ("sync", []),
            ("async0", ["trainer.mode=async", "trainer.max_staleness=0"]),
            ("async1", ["trainer.mode=async", "trainer.max_staleness=1"]),
        )}
    return {**out, "uri": t.uri}


def history(uri, run_id, key):
    import mlflow

    return {m.step: m.value for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key)}


def test_zero_staleness_is_the_synchronous_loop_exactly(runs):
    for key in EXACT:
        assert history(runs["uri"], runs["async0"], key) == history(runs["uri"], runs["sync"], key), key
    assert set(history(runs["uri"], runs["async0"], "async/staleness").values()) == {0.0}


def test_one_step_off_policy_trains_on_stale_batches_with_the_is_correction(runs):
    uri, run = runs["uri"], runs["async1"]
    assert history(uri, run, "async/staleness") == {1: 0.0, 2: 1.0, 3: 1.0}
    weights = history(uri, run, "rollout_corr/weight_mean")  # was async/is_weight_mean
    assert set(weights) == {2, 3}, "the correction applies to stale batches only"
    assert all(0.0 < w <= 2.0 for w in weights.values())
    # step 1 is the synchronous run's; from step 2 vLLM sampled with weights one update behind the
    # learner, so its log-probs differ from the learner's by the update, not by float noise
    assert history(uri, run, "batch/fingerprint")[1] == history(uri, runs["sync"], "batch/fingerprint")[1]
    sync_diff = max(history(uri, runs["sync"], "rollout/logprob_diff_max").values())
    assert history(uri, run, "rollout/logprob_diff_max")[2] > 10 * sync_diff
    import mlflow

    assert mlflow.MlflowClient(uri).get_run(run).info.status == "FINISHED"
