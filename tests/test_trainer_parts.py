"""The trainer's engine-free parts: batch layout, prompt sampling, checkpoint files, config checks.

Each test states the numbers it expects; none starts Ray, vLLM or DeepSpeed.
"""

from __future__ import annotations

import json

import pytest
import torch

from stapoctl.errors import UserError
from stapoctl.rollout.batch import RolloutBatch


def small_batch(pad=0, offset=0):
    # prompt 0 = [11, 12, 13] with responses [21] and [22, 23]; prompt 1 = [14] with [24, 25, 26] and []
    return RolloutBatch.from_token_lists(
        [[11, 12, 13], [14]],
        [[[21], [22, 23]], [[24, 25, 26], []]],
        [[[-0.5], [-0.1, -0.2]], [[-1.0, -2.0, -3.0], []]],
        [[False, True], [True, False]],
        [["a", "b"], ["c", "d"]],
        pad_id=pad,
        group_offset=offset,
        prompt_index=[7, 3],
    )


def test_rollout_batch_pads_prompts_left_and_responses_right():
    b = small_batch(pad=0)
    assert b.prompt_ids.tolist() == [[11, 12, 13]] * 2 + [[0, 0, 14]] * 2
    assert b.response_ids.tolist() == [[21, 0, 0], [22, 23, 0], [24, 25, 26], [0, 0, 0]]
    assert b.response_mask.sum(1).tolist() == [1, 2, 3, 0]
    assert b.rollout_log_probs[2].tolist() == [-1.0, -2.0, -3.0]
    assert b.group_ids.tolist() == [0, 0, 1, 1] and b.prompt_index.tolist() == [7, 7, 3, 3]
    assert b.truncated.tolist() == [False, True, True, False]
    # positions count real tokens only: the left-padded prompt 1 starts at 0
    assert b.position_ids()[2].tolist() == [0, 0, 0, 1, 2, 3]
    assert b.position_ids()[0].tolist() == [0, 1, 2, 3, 3, 3]


def test_rollout_batch_concat_and_select_keep_rows_aligned():
    a = small_batch(offset=0)
    c = RolloutBatch.from_token_lists([[9, 9, 9, 9, 9]], [[[31, 32, 33, 34]]], [[[-0.3] * 4]], [[False]],
                                      [["e"]], pad_id=0, group_offset=2, prompt_index=[5])
    both = RolloutBatch.concat([a, c], pad_id=0)
    assert both.prompt_ids.shape == (5, 5) and both.response_ids.shape == (5, 4)
    assert both.prompt_ids[0].tolist() == [0, 0, 11, 12, 13]
    assert both.response_ids[4].tolist() == [31, 32, 33, 34]
    assert both.group_ids.tolist() == [0, 0, 1, 1, 2] and both.texts == ["a", "b", "c", "d", "e"]
    sub = both.select([4, 1])
    assert sub.texts == ["e", "b"] and sub.group_ids.tolist() == [2, 0]
    assert torch.equal(sub.response_ids[1], both.response_ids[1])


def test_sampler_is_deterministic_and_resumes_exactly():
    from stapoctl.trainer.sampler import PromptSampler

    a = PromptSampler(10, 4, seed=3)
    drawn = [a.next_batch() for _ in range(5)]  # 20 rows = 2 epochs exactly
    assert sorted(drawn[0] + drawn[1] + drawn[2][:2]) == list(range(10)), "epoch 0 is a permutation"
    assert a.state_dict() == {"epoch": 2, "position": 0}
    b = PromptSampler(10, 4, seed=3)
    b.next_batch(), b.next_batch()
    saved = b.state_dict()
    c = PromptSampler(10, 4, seed=3)
    c.load_state_dict(saved)
    assert [c.next_batch() for _ in range(3)] == drawn[2:]
    assert PromptSampler(10, 4, seed=4).next_batch() != drawn[0]
    assert PromptSampler(10, 4, seed=3, shuffle=False).next_batch() == [0, 1, 2, 3]


def test_checkpoint_save_is_atomic_and_latest_points_at_the_newest(tmp_path):
    from stapoctl import checkpoint

    def payload(d):
        (d / "model").mkdir()
        (d / "model" / "config.json").write_text("{}")

    checkpoint.save(tmp_path, 2, payload, {"step": 2})
    checkpoint.save(tmp_path, 4, payload, {"step": 4})
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000004"]

    def crash(d):
        (d / "model").mkdir()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        checkpoint.save(tmp_path, 6, crash, {"step": 6})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000004"]
    assert checkpoint.resolve_resume(str(tmp_path)).name == "step_000004"
    assert checkpoint.resolve_resume(str(root / "step_000002")).name == "step_000002"
    assert json.loads((root / "step_000002" / "trainer_state.json").read_text()) == {"step": 2}
    with pytest.raises(UserError, match="resume=.*no complete checkpoint"):
        checkpoint.resolve_resume(str(tmp_path / "checkpoints" / "step_000002" / "model"))
    with pytest.raises(UserError, match="32-hex MLflow run id"):
        checkpoint.resolve_resume("not-a-run")


def test_rng_state_round_trips():
    import random

    from stapoctl import checkpoint

    state = json.loads(json.dumps(checkpoint.rng_state()))
    expected = (random.random(), torch.rand(3).tolist())
    checkpoint.set_rng_state(state)
    assert (random.random(), torch.rand(3).tolist()) == expected


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.train_batch_size=6", "learner.ppo_mini_batch_size=4"], "learner.ppo_mini_batch_size=4"),
        (["rollout.n=0"], "rollout.n=0"),
        (["trainer.total_steps=0"], "trainer.total_steps=0"),
        (["learner.micro_batch_size=6"], "learner.micro_batch_size=6"),
        (["learner.offload_optimizer=true"], "learner.offload_optimizer=true needs learner.zero_stage"),
        (["rollout.weight_sync=nccl"], "rollout.weight_sync=nccl needs GPUs"),  # no GPU asked for
    ],
)
def test_config_errors_name_the_field(overrides, message):
    from stapoctl.config.compose import compose_config

    # refused when composed (config.validate), so also by --cfg job and eval
    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        compose_config(overrides)


def test_weight_sync_method_choice():
    from stapoctl.sync.transports import choose_method

    assert choose_method("auto", on_gpu=False, placement="disaggregated") == "object_store"
    assert choose_method("auto", on_gpu=True, placement="colocated") == "ipc"
    assert choose_method("auto", on_gpu=True, placement="disaggregated") == "nccl"
    with pytest.raises(UserError, match="rollout.weight_sync='nccl' needs GPUs"):
        choose_method("nccl", on_gpu=False, placement="disaggregated")


def test_request_seeds_differ_per_prompt_and_step():
    from stapoctl.rollout.vllm_engine import request_seeds

    seeds = request_seeds(7, 3, n=8)
    # vLLM gives child j of a request seed + j: prompts must be n apart to never share a stream
    assert seeds[1] - seeds[0] == 8 and seeds[2] - seeds[1] == 8
    assert request_seeds(8, 3, n=8)[0] not in range(seeds[0], seeds[2] + 8)
    assert request_seeds(None, 2, n=8) == [None, None]


def test_resume_keeps_the_runs_config_and_applies_new_overrides():
    from omegaconf import OmegaConf

    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.setup import resume_config

    original = compose_config(["loss=grpo", "learner.lr=3e-5"])
    state = {"config": OmegaConf.to_container(original, resolve=True)}
    plain = resume_config(compose_config(["resume=/x"]), state)
    assert plain.loss.name == "grpo" and plain.learner.lr == 3e-5 and plain.resume == "/x"
    extended = resume_config(compose_config(["resume=/x", "trainer.total_steps=200"]), state)
    assert extended.trainer.total_steps == 200 and extended.loss.name == "grpo"


def test_packed_weights_round_trip_bit_exactly():
    """The multiprocess-engine fallback of the CPU sync: bytes + dtype + shape, no tensor pickling."""
    from stapoctl.sync.worker_extension import pack_for_rpc, unpack

    named = [("w", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("s", torch.tensor(2.5))]
    packed = pack_for_rpc(named)
    assert all(isinstance(raw, bytes) for _, raw, _, _ in packed)
    for (name, t), item in zip(named, packed):
        got_name, got = unpack(item)
        assert got_name == name and got.dtype == t.dtype and torch.equal(got, t)


@pytest.mark.engine
def test_learner_weight_payload_survives_ray_bit_exactly_and_is_read_in_place():
    """The learner's sync payload (numpy views of the raw bytes, bf16 included) through a real
    Ray object store: the reader gets the same values, as a view of the store's pages (no copy)."""
    import numpy as np
    import ray

    from stapoctl.launch.ray_runtime import ensure_ray
    from stapoctl.sync.worker_extension import raw_views, unpack

    named = [("w", torch.randn(64, 32)), ("b", torch.randn(7).to(torch.bfloat16)), ("s", torch.tensor(2.5))]
    payload = raw_views(named)  # what StateIO.weights returns
    started = ensure_ray()
    try:
        back = ray.get(ray.put(payload))
        for (name, t), item in zip(named, back):
            got_name, got = unpack(item)
            assert got_name == name and got.dtype == t.dtype and torch.equal(got, t)
        big = back[0][1]
        assert isinstance(big, np.ndarray) and not big.flags.writeable  # mapped from the store, not copied
        assert unpack(back[0])[1].data_ptr() == big.ctypes.data
    finally:
        if started:
            ray.shutdown()


def test_trimmed_drops_only_the_columns_that_are_padding_in_every_row():
    """Rows 0-1 of a batch padded to the widest prompt (5) and response (4) of all its rows: the
    sub-batch keeps prompt width 3 (the right end of the left-padded prompts) and response width 2."""
    pad = 0
    b = RolloutBatch.from_token_lists(
        [[7, 8], [5, 6, 7], [1, 2, 3, 4, 5]], [[[11]], [[12, 13]], [[14, 15, 16, 17]]],
        [[[-0.1]], [[-0.2, -0.3]], [[-0.4, -0.5, -0.6, -0.7]]], [[False]] * 3, [["a"], ["b"], ["c"]], pad_id=pad)
    b = b.with_(advantages=torch.tensor([1.0, -1.0, 0.5]), old_log_probs=b.rollout_log_probs.clone())
    sub = b.select(slice(0, 2))
    assert (sub.prompt_length, sub.response_length) == (5, 4)
    t = sub.trimmed()
    assert (t.prompt_length, t.response_length) == (3, 2)
    assert t.prompt_ids.tolist() == [[pad, 7, 8], [5, 6, 7]]
    assert t.response_ids.tolist() == [[11, pad], [12, 13]]
    assert torch.equal(t.old_log_probs, torch.tensor([[-0.1, 0.0], [-0.2, -0.3]]))
    assert t.advantages.tolist() == [1.0, -1.0] and t.texts == ["a", "b"]
    # the model sees the same tokens at the same positions: only all-padding columns went
    assert t.position_ids()[:, -2:].tolist() == sub.position_ids()[:, 5:7].tolist()
    assert t.input_ids()[t.attention_mask().bool()].tolist() == sub.input_ids()[sub.attention_mask().bool()].tolist()
    assert b.trimmed() is b  # nothing to drop


def test_token_diagnostics_run_in_the_background_and_a_failure_only_warns(monkeypatch):
    """The figure is drawn on a worker thread; `drain_diagnostics` waits for it and turns a failed
    one into a warning naming its step (a lost figure must not fail a training run)."""
    import threading
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from stapoctl.tracking import token_diagnostics
    from stapoctl.trainer.step_runner import StepRunner

    seen: list = []

    def fake_log_step(batch, old, entropy, loss_cfg, *, step, **kwargs):
        seen.append((step, threading.current_thread().name))
        if step == 4:
            raise OSError("disk full")

    monkeypatch.setattr(token_diagnostics, "log_step", fake_log_step)
    runner = StepRunner.__new__(StepRunner)
    runner.conf = OmegaConf.create({"learner": {"ppo_mini_batch_size": 2}, "rollout": {"n": 2}})
    runner.loss_config, runner.data = {"name": "stapo"}, SimpleNamespace(tokenizer=SimpleNamespace(decode=str))
    runner._last_old = runner._last_entropy = torch.zeros(2, 2)
    runner._diag_pool, runner._diag_jobs = None, []
    for step in (2, 4):
        runner.log_diagnostics(small_batch(), step)
    warnings: list[str] = []
    runner.drain_diagnostics(warnings.append)
    assert [s for s, _ in seen] == [2, 4]
    assert all(name.startswith("stapoctl-diagnostics") for _, name in seen)
    assert warnings == ["token diagnostics of step 4 not written: OSError: disk full"]
    assert runner._diag_pool is None and runner._diag_jobs == []


def test_a_user_error_raised_in_an_actor_constructor_is_found_in_rays_text():
    from stapoctl.launch.actor_errors import user_error_in

    text = ("The actor died because of an error raised in its creation task, ray::RolloutWorker.__init__() (pid=1)\n"
            "  File \"x.py\", line 3, in make_llm\n    raise UserError(\n"
            "stapoctl.errors.UserError: rollout.kv_cache_gb=1e-05 GiB is too small: raise it\n")
    found = user_error_in(RuntimeError(text))
    assert isinstance(found, UserError) and str(found) == "rollout.kv_cache_gb=1e-05 GiB is too small: raise it"
    assert user_error_in(RuntimeError("ValueError: something else")) is None
