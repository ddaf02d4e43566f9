"""Padding-free packed forward (`learner.remove_padding`) against the padded one.

Packing (learner/packing.py) changes how the rows are forwarded and nothing else: for every registered
loss, the update of the token-budget tests' batch (16 rows of 2-41-token responses, two optimizer
steps: the second at moved weights) with the rows packed gives the loss, the accumulated gradient at
each step and the weights of the padded forward in fixed micro-batches (1e-5, fp32) — rows alone or
a prompt once with its responses attending to it (the shared prefix), with fixed micro-batches and
with a token budget counted in real tokens, with gradient checkpointing (recomputation must see the
same spans), and for the frozen reference's log-probs. A packed forward that let rows attend to each
other fails all of these.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_learner_token_budget import (  # noqa: F401  (module fixtures)
    N, assert_same_update, fixed_run, fixed_runs, learner, learner_cfg, loss_cfg, run, spread_batch, tiny_dir,
)

pytestmark = pytest.mark.engine

REAL_BUDGET = 40  # real tokens: the 9 + 41-token row (49 packed) alone, the rest in runs of at most 40


def _losses():
    from stapoctl.losses import LOSSES

    return list(LOSSES)


def test_pack_lays_rows_end_to_end():
    from stapoctl.learner import packing

    batch = spread_batch().select(slice(0, 4))  # prompt 0 (5 tokens), responses of 2, 3, 2, 4 tokens
    ids, pos, spans, where = packing.pack(batch.trimmed(), "cpu")
    # each row: 5 prompt tokens + its response but the last token, no prefix
    assert spans == [(0, 6, 0, 0), (6, 13, 0, 0), (13, 19, 0, 0), (19, 27, 0, 0)]
    assert pos[0, :6].tolist() == list(range(6)) and pos[0, 6:13].tolist() == list(range(7))
    assert where.tolist() == [4, 5, 10, 11, 12, 17, 18, 23, 24, 25, 26]  # position 4 predicts response token 0
    assert ids[0, 6:11].tolist() == batch.prompt_ids[1, -5:].tolist()
    assert packing.packed_tokens([5, 5, 5, 5], [2, 3, 2, 4]) == 27


def test_pack_shares_a_prompt_between_its_responses():
    from stapoctl.learner import packing

    batch = spread_batch().select(slice(0, 4)).trimmed()
    ids, pos, spans, where = packing.pack(batch, "cpu", share_prompts=True)
    # the prompt once (0-5); each response but its last token after it, attending to 0-5
    assert spans == [(0, 5, 0, 0), (5, 6, 0, 5), (6, 8, 0, 5), (8, 9, 0, 5), (9, 12, 0, 5)]
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 5, 5, 6, 7]  # a response continues its prompt's positions
    assert where.tolist() == [4, 5, 4, 6, 7, 4, 8, 4, 9, 10, 11]  # token 0 of every row: the prompt's last
    assert ids[0, 6:8].tolist() == batch.response_ids[1, :2].tolist()
    assert packing.packed_tokens([5] * 4, [2, 3, 2, 4], groups=[0] * 4) == 12


def test_budget_counts_real_tokens_when_packed():
    from stapoctl.learner.micro_batches import token_budget, units_of

    p, r = [9, 9, 5, 5, 5], [41, 6, 20, 3, 2]
    units = units_of([0] * 5, together=False)
    cut = token_budget(p, r, units, budget=40, packed=True)
    assert cut[0] == [0] and sorted(i for mb in cut for i in mb) == list(range(5))
    assert all(sum(p[i] + r[i] - 1 for i in mb) <= 40 for mb in cut[1:])
    assert len(cut) == 3  # 49 alone; 24 + 14 | 7 + 6 (the fewest runs of the sorted rows)
    # padded, the same rows cost rows x widest: more micro-batches for the same budget
    assert len(token_budget(p, r, units, budget=40)) > len(cut)


@pytest.mark.parametrize("shared", [False, True], ids=["rows", "shared_prompts"])
@pytest.mark.parametrize("loss", _losses())
def test_every_loss_equals_the_padded_forward(learner, tiny_dir, fixed_runs, loss, shared):
    batch = spread_batch()
    want = fixed_run(fixed_runs, learner, tiny_dir, loss, batch)
    # shared: a prompt's 4 rows are a unit; a cap of 8 rows lets prompts 0 and 1 (12 + 17 tokens) share one
    cfg = learner_cfg(REAL_BUDGET, remove_padding=True, shared_prefix=shared, micro_batch_size=8 if shared else 4)
    got = run(learner, tiny_dir, cfg, loss, batch)
    assert learner.module.config._attn_implementation == "stapo_packed"
    assert_same_update(got, want)
    assert got["metrics"]["perf/update_micro_batches"] == (6 if shared else 12)  # fixed: 8 (2 epochs)


@pytest.mark.parametrize("extra", [{}, {"gradient_checkpointing": True},
                                   {"gradient_checkpointing": True, "shared_prefix": True}],
                         ids=["fixed_rows", "checkpointing", "checkpointing_shared_prompts"])
def test_fixed_micro_batches_packed(learner, tiny_dir, fixed_runs, extra):
    batch = spread_batch()
    want = fixed_run(fixed_runs, learner, tiny_dir, "stapo", batch)
    got = run(learner, tiny_dir, learner_cfg(remove_padding=True, **extra), "stapo", batch)
    assert_same_update(got, want)
    assert want["metrics"]["stapo/spurious_ratio"] > 0.05


def test_reference_log_probs_packed(learner, tiny_dir, tmp_path):
    batch = spread_batch()
    kl = {**loss_cfg("grpo"), "kl_coef": 0.1}
    out = {}
    for packed in (False, True):  # packed: the prompts shared (auto on a CPU learner)
        learner.reset(tiny_dir, learner_cfg(remove_padding=packed), kl, n_per_prompt=N, seed=0)
        assert learner.reference is not None
        out[packed] = learner.reference_log_probs(batch)
    assert learner.reference.config._attn_implementation == "stapo_packed"
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=0)
    assert float(out[True].abs().sum()) > 0
    # the attention's name stays in this process: a saved config (vLLM's, a checkpoint's) does not carry it
    learner.module.save_pretrained(str(tmp_path))
    assert "stapo_packed" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_refused_with_zero3(learner, tiny_dir):
    from stapoctl.config.compose import compose_config
    from stapoctl.errors import UserError

    with pytest.raises(UserError, match=r"remove_padding=true needs learner.zero_stage <= 2"):
        compose_config(["learner.remove_padding=true", "learner.zero_stage=3"])
    with pytest.raises(UserError, match="remove_padding"):  # the learner asks too
        learner.reset(tiny_dir, learner_cfg(remove_padding=True, zero_stage=3), loss_cfg("grpo"),
                      n_per_prompt=N, seed=0)
    conf = compose_config(["learner.remove_padding=true", "learner.max_tokens_per_micro_batch=256"])
    assert conf.learner.remove_padding is True


def test_sliding_window_models_are_refused():
    """The packed attention is causal within a span with no window: a model with sliding-window
    layers would silently attend too far, so packing it is refused in one line."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from stapoctl.errors import UserError
    from stapoctl.learner import packing

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    windowed = Qwen3Config(**shape, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(UserError, match="sliding-window attention"):
        packing.use_packed_attention(AutoModelForCausalLM.from_config(windowed))
    plain = AutoModelForCausalLM.from_config(Qwen3Config(**shape))
    packing.use_packed_attention(plain)
    assert plain.config._attn_implementation == "stapo_packed"
