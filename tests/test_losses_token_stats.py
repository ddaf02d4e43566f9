"""token_stats equals the naive log_softmax computation, values and gradients (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from stapoctl.losses import token_stats


def naive(logits, labels, temperature=1.0):
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    valid = labels >= 0
    logp = logp_all.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * valid
    p = logp_all.exp()
    return -(p * logp_all).sum(-1), logp, (p * p).sum(-1)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_path_matches_naive(chunk, temperature):
    g = torch.Generator().manual_seed(chunk)
    logits = (torch.randn(3, 6, 97, generator=g) * 4).requires_grad_(True)
    labels = torch.randint(0, 97, (3, 6), generator=g)
    labels[1, 2] = -100  # ignored position
    ent, lp, p2 = token_stats(logits, labels, chunk_size=chunk, temperature=temperature, return_sum_p2=True)
    ent_n, lp_n, p2_n = naive(logits, labels, temperature)
    torch.testing.assert_close(lp, lp_n, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_n, atol=1e-5, rtol=0)
    torch.testing.assert_close(p2, p2_n, atol=1e-5, rtol=0)
    assert lp[1, 2].item() == 0.0
    w = torch.randn(3, 6, generator=g)
    (ga,) = torch.autograd.grad((lp * w).sum(), logits)
    (gb,) = torch.autograd.grad((lp_n * w).sum(), logits)
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=0)
    assert ga[1, 2].abs().max().item() == 0.0
    assert not ent.requires_grad and not p2.requires_grad


def test_non_contiguous_shifted_logits():
    g = torch.Generator().manual_seed(1)
    full = torch.randn(2, 8, 33, generator=g, requires_grad=True)
    logits = full[:, :-1]  # the usual next-token shift: a non-contiguous view
    labels = torch.randint(0, 33, (2, 7), generator=g)
    _, lp = token_stats(logits, labels, chunk_size=3)
    _, lp_n, _ = naive(logits, labels)
    torch.testing.assert_close(lp, lp_n, atol=1e-5, rtol=0)
    (ga,) = torch.autograd.grad(lp.sum(), full)
    (gb,) = torch.autograd.grad(lp_n.sum(), full)
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_hidden_path_matches_naive_with_weight_gradient(temperature):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    weight = torch.randn(41, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 41, (2, 5), generator=g)
    ent, lp, p2 = token_stats(hidden, labels, lm_head_weight=weight, chunk_size=3, temperature=temperature,
                              return_sum_p2=True)
    ent_n, lp_n, p2_n = naive(hidden @ weight.t(), labels, temperature)
    torch.testing.assert_close(lp, lp_n, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_n, atol=1e-5, rtol=0)
    torch.testing.assert_close(p2, p2_n, atol=1e-5, rtol=0)
    w = torch.randn(2, 5, generator=g)
    ga = torch.autograd.grad((lp * w).sum(), (hidden, weight))
    gb = torch.autograd.grad((lp_n * w).sum(), (hidden, weight))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bf16_logits_give_fp32_stats_and_bf16_gradient():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 50, generator=g).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 50, (2, 4), generator=g)
    ent, lp = token_stats(logits, labels, chunk_size=3)
    assert ent.dtype == lp.dtype == torch.float32
    ent_n, lp_n, _ = naive(logits, labels)  # naive upcasts too: same fp32 numbers
    torch.testing.assert_close(lp, lp_n, atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    assert grad.dtype == torch.bfloat16


def test_shape_errors():
    with pytest.raises(ValueError, match="labels shape"):
        token_stats(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="lm_head_weight"):
        token_stats(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), lm_head_weight=torch.randn(7, 6))
