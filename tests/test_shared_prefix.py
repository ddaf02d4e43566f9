"""The shared-prefix forward against the plain forward, on a random tiny Qwen3 (no engine).

Two prompts of different lengths (left padding) × 4 responses of different lengths (right
padding): the log-probs of the response tokens and every parameter's gradient must be the plain
forward's, and the prompts must really have been run once each."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from stapoctl.config.schema import TinyModelConfig
    from stapoctl.models.tiny import build_random

    path = build_random(tmp_path_factory.mktemp("tiny_random"), TinyModelConfig(), seed=0)
    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    m.train()
    return m


def make_batch(prompt_lens=(6, 9), n=4, distinct=False):
    from stapoctl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    prompts, resps = [], []
    for k, plen in enumerate(prompt_lens):
        base = torch.randint(3, 500, (plen,), generator=g).tolist()
        for j in range(n):
            # `distinct`: every row its own prompt (one token changed), nothing to share
            prompts.append(base[:-1] + [3 + j] if distinct else base)
            resps.append(torch.randint(3, 500, (2 + (k + 2 * j) % 6,), generator=g).tolist())
    rows = len(prompts)
    return RolloutBatch.from_token_lists(
        prompts, [[r] for r in resps], [[[0.0] * len(r)] for r in resps],
        [[False]] * rows, [[""]] * rows, pad_id=0)


def log_probs(model, batch, shared: bool):
    from stapoctl.learner.shared_prefix import shared_prefix_hidden

    ids, attn, pos = batch.input_ids(), batch.attention_mask(), batch.position_ids()
    p, r = batch.prompt_length, batch.response_length
    hidden = shared_prefix_hidden(model.get_decoder(), ids, attn, pos, p, r) if shared else None
    if hidden is None:
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
        hidden = hidden[:, p - 1 : p + r - 1]
    logits = hidden @ model.get_output_embeddings().weight.t()
    lp = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None])[..., 0]
    return torch.where(batch.response_mask, lp, 0.0)


def grads_and_log_probs(model, batch, shared: bool):
    model.zero_grad()
    lp = log_probs(model, batch, shared)
    # weights per token, so every position's gradient counts differently
    w = torch.linspace(-1.0, 2.0, lp.numel()).view_as(lp)
    (lp * w).sum().backward()
    return lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_prompt_groups_finds_each_prompt_once():
    from stapoctl.learner.shared_prefix import prompt_groups

    batch = make_batch()
    first, inverse = prompt_groups(batch.prompt_ids, batch.prompt_mask)
    assert inverse.tolist() in ([0] * 4 + [1] * 4, [1] * 4 + [0] * 4)
    assert torch.equal(batch.prompt_ids[first][inverse], batch.prompt_ids)
    distinct = make_batch(distinct=True)
    assert prompt_groups(distinct.prompt_ids, distinct.prompt_mask) is None


def test_shared_prefix_equals_plain_forward(model):
    batch = make_batch()
    assert batch.prompt_mask.all(1).tolist() != [True] * len(batch), "the batch must have left padding"
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        lp_s, g_s = grads_and_log_probs(model, batch, shared=True)
    finally:
        hook.remove()
    p, r = batch.prompt_length, batch.response_length
    assert seen == [(2, p - 1), (8, r)], "each prompt forwarded once, then the responses on top"
    lp_p, g_p = grads_and_log_probs(model, batch, shared=False)
    assert (lp_p != 0).sum() == batch.response_mask.sum()
    assert torch.allclose(lp_s, lp_p, atol=1e-5, rtol=0)
    for name, g in g_p.items():  # fp32 summation order: ~5e-7 of each tensor's largest entry
        assert float((g_s[name] - g).abs().max()) <= 1e-5 * float(g.abs().max()), name
    assert max(float(g.abs().max()) for g in g_p.values()) > 1e-3  # the comparison compared something


def test_distinct_prompts_use_the_plain_forward(model):
    from stapoctl.learner.shared_prefix import shared_prefix_hidden

    batch = make_batch(distinct=True)
    out = shared_prefix_hidden(model.get_decoder(), batch.input_ids(), batch.attention_mask(),
                               batch.position_ids(), batch.prompt_length, batch.response_length)
    assert out is None


@pytest.mark.parametrize("setting, on_cuda, zero_stage, checkpointing, expected", [
    (None, False, 0, False, True),  # auto: a CPU learner shares the prompts
    (None, True, 0, False, False),  # auto: a GPU learner does not (launch-bound, docs/PERFORMANCE.md)
    (True, True, 0, False, True),  # an explicit setting wins on either device
    (False, False, 0, False, False),
    (True, False, 3, False, False),  # ZeRO-3 and checkpointing keep no KV cache to share
    (True, False, 0, True, False),
])
def test_enabled_resolves_auto_by_device(setting, on_cuda, zero_stage, checkpointing, expected):
    from stapoctl.learner.shared_prefix import enabled

    learner = {"shared_prefix": setting, "zero_stage": zero_stage, "gradient_checkpointing": checkpointing}
    assert enabled(learner, on_cuda) is expected


def test_the_run_tag_says_what_auto_resolved_to():
    from stapoctl.config.compose import compose_config
    from stapoctl.trainer.engine_settings import learner_shared_prefix

    assert learner_shared_prefix(compose_config([])) == "on"
    assert learner_shared_prefix(compose_config(["learner.gpus_per_rank=1"])) == "off"
    assert learner_shared_prefix(compose_config(["learner.gpus_per_rank=1", "learner.shared_prefix=true"])) == "on"
    assert learner_shared_prefix(compose_config(["learner.shared_prefix=false"])) == "off"
