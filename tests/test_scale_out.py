"""`stapoctl train learner.num_ranks=2 rollout.num_workers=2` end to end on 2 cores.

Two vLLM actors and two DeepSpeed ranks (gloo) with half a CPU each train the tiny experiment
for 3 steps. Checked against a 1-worker / 1-rank run of the same seed: the first step samples
the same batch (rollouts are seeded per prompt, not per worker) and computes the same update
(the ranks' loss normaliser and mini-batch statistics are global). Every worker gets every sync
(`rollout/logprob_diff_max/worker_j` stays at float noise), and the 2-rank checkpoint resumes
to the same step 3 (same batch). The 1-worker run takes vLLM's log-probs as the old ones (the default in fp32 at
T=1) while the 2x2 run recomputes them, so the equal first step also shows that skipping the pass
does not change the update.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

# recompute: the learner's no-grad pass every step, hence the per-worker sync canary every step
TWO_BY_TWO = ["learner.num_ranks=2", "rollout.num_workers=2", "rollout.cpus_per_worker=0.5", "learner.cpus=0.5",
              "trainer.total_steps=3", "trainer.save_freq=2", "eval.every_n_steps=3",
              "rollout.old_logprob_source=recompute"]
# the default old-log-prob source (vLLM's, fp32 at T=1): the same update to float noise
ONE_BY_ONE = ["trainer.total_steps=1", "trainer.save_freq=0", "eval.every_n_steps=0"]
SAME_STEP_1 = ("batch/fingerprint", "critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
               "actor/pg_clipfrac", "response_length/mean")


@pytest.fixture(scope="module")
def runs(training_store, engine_pool):
    """On the suite's engines: the 2x2 engines serve the 2x2 run and its resume; the 1x1 run
    starts the embedded default's, which the modules after it in POOL_ORDER reuse."""
    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.driver import train

    with training_store("scale_store") as t:
        wide = train(t.conf(TWO_BY_TWO), console=t.console, session=engine_pool)
        step2 = f"{wide['run_dir']}/checkpoints/step_000002"
        resumed = train(compose_config([f"resume={step2}", f"tracking.uri={t.uri}"]), console=t.console,
                        session=engine_pool)
        resumed_reused = engine_pool.engines.info["reused"]
        narrow = train(t.conf(ONE_BY_ONE), console=t.console, session=engine_pool)
    return {"wide": wide, "resumed": resumed, "narrow": narrow, "uri": t.uri, "resumed_reused": resumed_reused}


def history(uri, run_id, key):
    import mlflow

    return [(m.step, m.value) for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key)]


def test_two_by_two_trains_and_every_worker_is_synced(runs):
    import mlflow

    wide = runs["wide"]["run_id"]
    run = mlflow.MlflowClient(runs["uri"]).get_run(wide)
    assert run.info.status == "FINISHED"
    assert run.data.params["learner.num_ranks"] == "2" and run.data.params["rollout.num_workers"] == "2"
    for j in (0, 1):
        diffs = history(runs["uri"], wide, f"rollout/logprob_diff_max/worker_{j}")
        assert [s for s, _ in diffs][:3] == [1, 2, 3]
        assert max(v for _, v in diffs) <= 1e-4, (j, diffs)
    assert [s for s, _ in history(runs["uri"], wide, "val/toy/train/avg_at_4")] == [0, 3]


def test_same_seed_same_first_step_whatever_the_workers_and_ranks(runs):
    wide, narrow = runs["wide"]["run_id"], runs["narrow"]["run_id"]
    for key in SAME_STEP_1:
        a = dict(history(runs["uri"], wide, key))[1]
        b = dict(history(runs["uri"], narrow, key))[1]
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), key
    assert dict(history(runs["uri"], wide, "actor/grad_norm"))[1] > 0


def test_two_rank_checkpoint_resumes_to_the_same_step(runs):
    """Step 3 was trained before the resume from step 2: the resumed run recomputes it, draws the
    same batch (its fingerprint checked against the logged one) and keeps the first-logged metrics."""
    wide = runs["wide"]["run_id"]
    assert runs["resumed"]["run_id"] == wide
    assert runs["resumed"]["replayed"] == {"steps": [3], "mismatched": []}  # the same batch, on the 2x2 engines
    assert runs["resumed_reused"], "the 2-rank resume started new engines"
    for key in ("batch/fingerprint", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert [s for s, _ in history(runs["uri"], wide, key)] == [1, 2, 3], key
