"""The GPU path computes what the CPU path computes: every registered loss, token_stats, and the
DeepSpeed learner's update (NCCL, one GPU) against the plain-torch reference of test_learner.

Skipped where torch sees no CUDA device (CI, this project's 2-core machine); run on a GPU
machine with `pytest tests/test_cuda.py`. The loss and token_stats checks compare the same
float32 inputs on both devices, so a mask that flips (a token silenced on one device and not
the other) fails them, as it would change what a GPU run trains on.
"""

from __future__ import annotations

import pytest
import torch

from stapoctl.losses import LOSSES, compute_advantages, compute_policy_loss, prepare_minibatch, slice_context
from stapoctl.losses import token_stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROWS, N, T = 64, 8, 300


def random_minibatch(seed: int = 0) -> dict:
    """64 responses (8 groups of 8), lengths 20..300, probabilities down to 1e-6 with entropies
    spread over 0..4, so STAPO/20-Entropy/WAPO masks and weights all have work to do."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, T + 1, (ROWS,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    log_prob = -(torch.rand(ROWS, T, generator=g) ** 3) * 14
    old = log_prob + torch.randn(ROWS, T, generator=g) * 0.1
    entropy = torch.rand(ROWS, T, generator=g) * 4
    sum_p2 = torch.rand(ROWS, T, generator=g) * 0.9 + 0.05
    rewards = torch.randint(0, 2, (ROWS,), generator=g).float() * 2 - 1
    group_ids = torch.arange(ROWS) // N
    return dict(log_prob=log_prob, old_log_prob=old, entropy=entropy, sum_p2=sum_p2, response_mask=mask,
                rewards=rewards, group_ids=group_ids)


SPLIT = (slice(0, 20), slice(20, ROWS))  # two micro-batches, the cut inside a group


def _loss_on(device: str, name: str, raw: dict):
    """The learner's call pattern (ppo_step): prepare_minibatch over the mini-batch, then each
    micro-batch's loss with its slice of the context, gradients accumulated."""
    cfg = {k: v for k, v in vars(LOSSES[name].config_cls()).items() if k != "name"}
    d = {k: v.to(device) for k, v in raw.items()}
    adv = compute_advantages(name, d["rewards"], d["group_ids"], **cfg)
    adv_t = adv[:, None].expand(ROWS, T).contiguous()
    lp = d["log_prob"].clone().requires_grad_(True)
    common = dict(old_log_prob=d["old_log_prob"], response_mask=d["response_mask"], entropy=d["entropy"],
                  sum_p2=d["sum_p2"], group_ids=d["group_ids"], global_step=3, max_response_length=T)
    ctx = prepare_minibatch(name, log_prob=lp.detach(), advantages=adv_t, **common, **cfg)
    total, metrics = torch.zeros((), device=device), []
    for rows in SPLIT:
        part = {k: (v[rows] if torch.is_tensor(v) else v) for k, v in common.items()}
        loss, m = compute_policy_loss(name, log_prob=lp[rows], advantages=adv_t[rows], **part,
                                      **slice_context(ctx, rows), **cfg)
        total = total + loss
        metrics.append(m)
    (grad,) = torch.autograd.grad(total, lp)
    return adv.cpu(), total.detach().cpu(), grad.cpu(), metrics


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_on_cuda_equals_cpu(name):
    raw = random_minibatch()
    adv_c, loss_c, grad_c, met_c = _loss_on("cpu", name, raw)
    adv_g, loss_g, grad_g, met_g = _loss_on("cuda", name, raw)
    torch.testing.assert_close(adv_g, adv_c, rtol=1e-5, atol=1e-6)
    assert (grad_c != 0).sum() > 1000, "the batch must give the loss something to compute"
    torch.testing.assert_close(loss_g, loss_c, rtol=1e-5, atol=1e-6)
    # the same tokens carry gradient on both devices (a flipped mask would show here first)
    assert torch.equal(grad_g != 0, grad_c != 0), f"{name}: different tokens silenced on CUDA"
    torch.testing.assert_close(grad_g, grad_c, rtol=1e-4, atol=1e-8)
    for mc, mg in zip(met_c, met_g):
        assert mc.keys() == mg.keys()
        for k in mc:
            assert mg[k] == pytest.approx(mc[k], rel=1e-4, abs=1e-6), f"{name}: metric {k}"


def test_stapo_batch_has_silenced_tokens():
    # guards the test above: STAPO must actually silence some tokens of this batch
    raw = random_minibatch()
    _, _, grad_stapo, _ = _loss_on("cuda", "stapo", raw)
    _, _, grad_grpo, _ = _loss_on("cuda", "grpo", raw)
    silenced = (grad_grpo != 0) & (grad_stapo == 0)
    assert int(silenced.sum()) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
def test_token_stats_on_cuda_equals_full_log_softmax(dtype, hidden):
    g = torch.Generator().manual_seed(1)
    tokens, vocab, width = 300, 151_936, 64
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    h = torch.randn(1, tokens, width, generator=g).to(dtype)
    w = (torch.randn(vocab, width, generator=g) * 0.3).to(dtype)
    logits = (h.double() @ w.double().T)  # reference from the same rounded inputs, in float64
    ref_lp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    p = torch.softmax(logits, -1)
    ref_ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    if hidden:
        ent, lp = token_stats(h.cuda(), labels.cuda(), lm_head_weight=w.cuda(), chunk_size=64)
    else:
        ent, lp = token_stats((h.cuda() @ w.cuda().T), labels.cuda(), chunk_size=64)
    # bf16 matmul output rounding (hidden path: inside the chunk; logits path: the input itself)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(lp.double().cpu(), ref_lp, rtol=0, atol=tol)
    torch.testing.assert_close(ent.double().cpu(), ref_ent, rtol=0, atol=tol)


@pytest.mark.engine
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_deepspeed_learner_on_cuda_equals_plain_torch_reference(tmp_path, zero_stage):
    """One GPU, NCCL: two GRPO mini-batch updates equal the CPU plain-torch reference."""
    from transformers import AutoTokenizer

    from stapoctl.config.schema import TinyModelConfig
    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.learner.engine_setup import free_port
    from stapoctl.models.tiny import build_random
    from test_learner import EPS, LR, MICRO, WD, fixed_batch, reference_updates

    model_dir = str(build_random(tmp_path / "tiny", TinyModelConfig(), seed=0))
    batch = fixed_batch(AutoTokenizer.from_pretrained(model_dir).pad_token_id)
    learner = Learner(rank=0, world_size=1)
    cfg = dict(zero_stage=zero_stage, lr=LR, betas=[0.9, 0.999], weight_decay=WD, adam_eps=EPS, warmup_steps=0,
               grad_clip=1.0, ppo_mini_batch_size=2, micro_batch_size=MICRO, ppo_epochs=1, logits_chunk_size=7,
               gpus_per_rank=1)
    loss_cfg = {"name": "grpo", **vars(LOSSES["grpo"].config_cls())}
    learner.setup(model_dir, cfg, loss_cfg, n_per_prompt=4, seed=0, master_port=free_port())
    try:
        assert learner.device.type == "cuda" and next(learner.module.parameters()).is_cuda
        result = learner.train_step(batch, global_step=1)
        metrics = result.metrics
        ref_model, ref_old, ref_norms, ref_losses = reference_updates(model_dir, batch, 2 * 4)
        torch.testing.assert_close(result.old_log_probs, ref_old, atol=1e-5, rtol=0)
        assert metrics["actor/grad_norm"] == pytest.approx(sum(ref_norms) / 2, rel=1e-4)
        assert metrics["actor/pg_loss"] == pytest.approx(sum(ref_losses) / 2, abs=1e-5)
        got = learner.full_state_dict()
        worst = max(float((got[n].cpu() - p.detach()).abs().max()) for n, p in ref_model.named_parameters())
        assert worst < 1e-5, f"CUDA learner's parameters differ from the reference by {worst:.3g}"
    finally:
        learner.shutdown()
