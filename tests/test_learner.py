"""The DeepSpeed learner against a plain-torch reference.

Two PPO mini-batch updates (two optimizer steps, gradient accumulation over two micro-batches
each) with GRPO on a fixed batch through the real DeepSpeed engine must equal the same
updates written out by hand: full-vocabulary log_softmax, the GRPO surrogate
(mean over responses of the mean over their tokens, clip 0.2), torch's clip_grad_norm_(1.0)
and torch's AdamW. The second update has ratio ≠ 1 (the weights moved), so clipping and the
accumulation normaliser both matter.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.engine

N_PROMPTS, N, MICRO = 4, 4, 4
# Adam normalises each gradient entry by its own magnitude: with eps=1e-8 an entry of 1e-7
# whose last bits differ (summation order) moves by a different fraction of lr, so parameters
# can differ by ~1e-5 although the gradients agree to 1e-7. eps=1e-3 keeps the comparison
# well conditioned (|Δθ error| ≲ lr/eps · |Δg| ≈ 3e-7) without changing what is compared.
LR, WD, EPS = 3e-3, 0.01, 1e-3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from stapoctl.config.schema import TinyModelConfig
    from stapoctl.models.tiny import build_random

    return str(build_random(tmp_path_factory.mktemp("tiny_random"), TinyModelConfig(), seed=0))


def fixed_batch(pad_id: int):
    """4 prompts × 4 responses of different lengths, with ±1 rewards and GRPO advantages."""
    from stapoctl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(k),), generator=g).tolist() for k in (5, 7, 6, 9)]
    resps, lps, trunc, texts = [], [], [], []
    for i in range(N_PROMPTS):
        lens = [3 + (i + j) % 5 for j in range(N)]
        resps.append([torch.randint(3, 500, (l,), generator=g).tolist() for l in lens])
        lps.append([[0.0] * l for l in lens])
        trunc.append([False] * N)
        texts.append([""] * N)
    batch = RolloutBatch.from_token_lists(prompts, resps, lps, trunc, texts, pad_id=pad_id)
    rewards = torch.tensor([1, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1, 1, 1, -1, 1, 1], dtype=torch.float32)
    # GRPO advantage by hand: (R - mean_G) / (population std_G + 1e-6)
    r = rewards.view(N_PROMPTS, N).double()
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1).float()
    return batch.with_(rewards=rewards, advantages=adv)


def reference_log_probs(model, batch):
    out = model(input_ids=batch.input_ids(), attention_mask=batch.attention_mask(),
                position_ids=batch.position_ids())
    p = batch.prompt_length
    logits = out.logits[:, p - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None])[..., 0]
    return torch.where(batch.response_mask, lp, 0.0)


def reference_updates(model_path, batch, mini_rows):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=WD, eps=EPS)
    with torch.no_grad():
        old = reference_log_probs(model, batch)
    norms, losses = [], []
    for start in range(0, len(batch), mini_rows):
        mini = batch.select(slice(start, start + mini_rows))
        lp = reference_log_probs(model, mini)
        mask = mini.response_mask.float()
        ratio = torch.exp(lp - old[start : start + mini_rows])
        a = mini.advantages[:, None]
        surrogate = torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
        per_seq = (surrogate * mask).sum(1) / mask.sum(1)
        loss = -per_seq.mean()
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        losses.append(float(loss.detach()))
        opt.step()
    return model, old, norms, losses


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_grpo_update_equals_plain_torch_reference(tiny_dir, zero_stage):
    from transformers import AutoTokenizer

    from stapoctl.learner.deepspeed_learner import Learner

    pad = AutoTokenizer.from_pretrained(tiny_dir).pad_token_id
    batch = fixed_batch(pad)
    mini_prompts = 2
    learner = Learner(rank=0, world_size=1)
    learner_cfg = dict(zero_stage=zero_stage, lr=LR, betas=[0.9, 0.999], weight_decay=WD, adam_eps=EPS, warmup_steps=0,
                       grad_clip=1.0, ppo_mini_batch_size=mini_prompts, micro_batch_size=MICRO,
                       ppo_epochs=1, logits_chunk_size=7, cpus=1, num_gpus=0)
    from stapoctl.losses import LOSSES

    loss_cfg = {"name": "grpo", **{k: v for k, v in vars(LOSSES["grpo"].config_cls()).items()}}
    learner.setup(tiny_dir, learner_cfg, loss_cfg, n_per_prompt=N, seed=0)
    assert learner.grad_accum == 2  # 2 prompts × 4 samples = 8 rows = 2 micro-batches of 4

    result = learner.train_step(batch, global_step=1)
    metrics = result.metrics
    ref_model, ref_old, ref_norms, ref_losses = reference_updates(tiny_dir, batch, mini_prompts * N)

    # old log-probs: chunked token_stats over hidden states == full log_softmax
    assert torch.allclose(result.old_log_probs, ref_old, atol=1e-6, rtol=0)
    # metrics average the two mini-batches
    assert metrics["actor/grad_norm"] == pytest.approx(sum(ref_norms) / 2, rel=1e-5)
    assert metrics["actor/pg_loss"] == pytest.approx(sum(ref_losses) / 2, abs=1e-6)
    assert metrics["actor/optimizer_steps"] == 2
    assert ref_norms[0] > 1.0, "the test must exercise grad clipping"
    worst = 0.0
    got = learner.full_state_dict()
    for name, p in ref_model.named_parameters():
        worst = max(worst, float((got[name] - p.detach()).abs().max()))
    assert worst < 1e-6, f"parameters differ from the reference update by {worst:.3g}"
    # and the update did move them (a no-op learner would also be 'equal' to a no-op reference)
    from transformers import AutoModelForCausalLM

    base = dict(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).named_parameters())
    moved = max(float((got[n] - base[n].detach()).abs().max()) for n in base)
    assert moved > 1e-3
    learner.shutdown()


def test_zero3_forward_computes_only_the_response_logits(tiny_dir):
    """Under ZeRO-3 the module's forward keeps the logits of the response + 1 positions only
    (`logits_to_keep`), and the log-probs are still those of the full forward, on left-padded
    prompts of 5-9 tokens and right-padded responses of 3-7."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.losses import LOSSES

    batch = fixed_batch(AutoTokenizer.from_pretrained(tiny_dir).pad_token_id)
    learner = Learner(rank=0, world_size=1)
    learner_cfg = dict(zero_stage=3, lr=LR, betas=[0.9, 0.999], weight_decay=WD, adam_eps=EPS, warmup_steps=0,
                       grad_clip=1.0, ppo_mini_batch_size=2, micro_batch_size=MICRO, ppo_epochs=1,
                       logits_chunk_size=7, cpus=1, num_gpus=0)
    learner.setup(tiny_dir, learner_cfg, {"name": "grpo", **vars(LOSSES["grpo"].config_cls())}, n_per_prompt=N, seed=0)
    widths: list[tuple[int, int]] = []
    hook = learner.module.register_forward_hook(lambda m, args, out: widths.append(tuple(out.logits.shape[:2])))
    try:
        got = learner.compute_log_probs(batch)["log_prob"]
    finally:
        hook.remove()
        learner.shutdown()
    assert batch.prompt_length == 9 and batch.response_length == 7
    assert widths == [(MICRO, 7 + 1)] * (len(batch) // MICRO)  # not 9 + 7 positions
    want = reference_log_probs(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), batch)
    assert torch.allclose(got, want.detach(), atol=1e-6, rtol=0)
