"""Data-parallel learner: 2 ranks (gloo, two Ray actors) compute the update 1 rank computes.

Both run the real DeepSpeed engine and get the same fixed batch: the 2-rank group in Ray actors,
the 1-rank reference in this process (as tests/test_learner.py runs it; a Ray actor would add an
engine start that tests nothing). The loss
normaliser and the mini-batch statistics (h*, the token-mean denominator) must be global, the
gradients all-reduced into a sum, the metrics combined over ranks — any of these done per rank
shows up as a difference in loss, grad norm or weights. Both are `reset` between cases (ZeRO
stage, loss), which also exercises the learner reuse sweeps depend on: a reset rank must start
from the base weights with a fresh optimizer.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import count_engine_start
from test_learner import EPS, LR, N, WD, fixed_batch, reference_updates

pytestmark = pytest.mark.engine

MINI_PROMPTS, MICRO = 2, 2  # 8 rows per mini-batch: 4 per rank → 2 micro-batches per rank


def learner_cfg(zero_stage: int, ranks: int) -> dict:
    return dict(zero_stage=zero_stage, lr=LR, betas=[0.9, 0.999], weight_decay=WD, adam_eps=EPS, warmup_steps=0,
                grad_clip=1.0, ppo_mini_batch_size=MINI_PROMPTS, micro_batch_size=MICRO, ppo_epochs=1,
                logits_chunk_size=7, cpus=0.5, num_ranks=ranks, gpus_per_rank=0)


def loss_cfg(name: str) -> dict:
    from stapoctl.losses import LOSSES

    cfg = {"name": name, **vars(LOSSES[name].config_cls())}
    if name == "stapo":
        cfg.update(tau_p=0.01)  # a random 512-token model: most probabilities are ~1/512, the mask fires
    return cfg


@pytest.fixture(scope="module")
def groups(tmp_path_factory, ray_runtime):
    import ray

    from stapoctl.config.schema import TinyModelConfig
    from stapoctl.launch.ray_runtime import ensure_ray
    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.learner.group import LearnerGroup
    from stapoctl.models.tiny import build_random

    model_dir = str(build_random(tmp_path_factory.mktemp("tiny_random"), TinyModelConfig(), seed=0))
    was_up = ray.is_initialized()
    ensure_ray(None)
    t0 = time.perf_counter()
    two, setup_refs = LearnerGroup.start(model_dir, learner_cfg(0, 2), loss_cfg("grpo"), n_per_prompt=N,
                                         temperature=1.0, dtype="float32", seed=0)
    count_engine_start(t0, (), setup_refs)
    one = Learner(rank=0, world_size=1)
    one.setup(model_dir, learner_cfg(0, 1), loss_cfg("grpo"), n_per_prompt=N, temperature=1.0, dtype="float32", seed=0)
    yield {"dir": model_dir, 1: one, 2: two}
    one.shutdown()
    ray.get([h.shutdown.remote() for h in two])
    for h in two:
        ray.kill(h)
    if not was_up:
        ray.shutdown()


def run_case(handles, model_dir, zero_stage, loss, batch):
    import ray

    from stapoctl.learner.group import LearnerGroup

    if not isinstance(handles, LearnerGroup):  # the in-process 1-rank reference
        handles.reset(model_dir, learner_cfg(zero_stage, 1), loss_cfg(loss), n_per_prompt=N, seed=0)
        return handles.train_step(batch, 1), handles.full_state_dict()
    ranks = len(handles)
    ray.get([h.reset.remote(model_dir, learner_cfg(zero_stage, ranks), loss_cfg(loss), n_per_prompt=N, seed=0)
             for h in handles])
    result = ray.get([h.train_step.remote(batch, 1) for h in handles])[0]
    weights = ray.get([h.full_state_dict.remote() for h in handles])[0]
    return result, weights


@pytest.mark.parametrize("loss", ["grpo", "stapo"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_two_ranks_equal_one_rank(groups, zero_stage, loss):
    from transformers import AutoTokenizer

    batch = fixed_batch(AutoTokenizer.from_pretrained(groups["dir"]).pad_token_id)
    one_step, w1 = run_case(groups[1], groups["dir"], zero_stage, loss, batch)
    two_step, w2 = run_case(groups[2], groups["dir"], zero_stage, loss, batch)
    one, two = one_step.metrics, two_step.metrics

    assert one["actor/optimizer_steps"] == two["actor/optimizer_steps"] == 2  # two mini-batches
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac", "stapo/spurious_ratio",
                "stapo/entropy_threshold", "loss/response_tokens"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    assert torch.allclose(two_step.old_log_probs, one_step.old_log_probs, atol=1e-6, rtol=0)
    worst = max(float((w2[k] - w1[k]).abs().max()) for k in w1)
    assert worst < 1e-5, f"2-rank weights differ from 1-rank weights by {worst:.3g}"
    if loss == "stapo":  # the global h* / renormaliser matter only if the mask fired
        assert one["stapo/spurious_ratio"] > 0.05
    else:  # and the 1-rank GRPO update is the plain-torch one (tests/test_learner.py's reference)
        ref_model, _, ref_norms, ref_losses = reference_updates(groups["dir"], batch, MINI_PROMPTS * N)
        assert one["actor/grad_norm"] == pytest.approx(sum(ref_norms) / 2, rel=1e-5)
        ref_worst = max(float((w1[n] - p.detach()).abs().max()) for n, p in ref_model.named_parameters())
        assert ref_worst < 1e-5


def test_reset_restores_the_base_weights_and_a_fresh_optimizer(groups):
    """After a trained case, a reset rank starts over: same first-step result as before."""
    from transformers import AutoTokenizer

    batch = fixed_batch(AutoTokenizer.from_pretrained(groups["dir"]).pad_token_id)
    first, w_first = run_case(groups[2], groups["dir"], 0, "grpo", batch)
    again, w_again = run_case(groups[2], groups["dir"], 0, "grpo", batch)
    assert again.metrics["actor/pg_loss"] == first.metrics["actor/pg_loss"]
    assert again.metrics["actor/grad_norm"] == first.metrics["actor/grad_norm"]
    assert max(float((w_again[k] - w_first[k]).abs().max()) for k in w_first) == 0.0
