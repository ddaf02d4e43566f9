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


def naive64(logits, labels, temperature=1.0):
    """float64 log_softmax: the reference for the entropy gradient dH/dz = -p (log p + H)."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    p = logp_all.exp()
    logp = logp_all.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (labels >= 0)
    return -(p * logp_all).sum(-1), logp


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_gradient_from_logits_matches_float64(chunk, temperature):
    g = torch.Generator().manual_seed(10 + chunk)
    logits = (torch.randn(3, 6, 97, generator=g) * 4).requires_grad_(True)
    labels = torch.randint(0, 97, (3, 6), generator=g)
    labels[1, 2] = -100
    ent, lp = token_stats(logits, labels, chunk_size=chunk, temperature=temperature, entropy_grad=True)
    ent_n, lp_n = naive64(logits, labels, temperature)
    torch.testing.assert_close(ent.double(), ent_n, atol=1e-5, rtol=0)
    a, b = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    (ga,) = torch.autograd.grad((lp * a + ent * b).sum(), logits)
    (gb,) = torch.autograd.grad((lp_n * a.double() + ent_n * b.double()).sum(), logits)
    torch.testing.assert_close(ga.double(), gb.double(), atol=1e-5, rtol=0)
    (ge,) = torch.autograd.grad(token_stats(logits, labels, chunk_size=chunk, temperature=temperature,
                                            entropy_grad=True)[0].sum(), logits)  # the entropy alone
    (gn,) = torch.autograd.grad(naive64(logits, labels, temperature)[0].sum(), logits)
    torch.testing.assert_close(ge.double(), gn.double(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_gradient_from_hidden_states_matches_float64(temperature):
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    weight = torch.randn(41, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 41, (2, 5), generator=g)
    ent, lp = token_stats(hidden, labels, lm_head_weight=weight, chunk_size=3, temperature=temperature,
                          entropy_grad=True)
    ent_n, lp_n = naive64(hidden @ weight.t(), labels, temperature)
    a, b = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    ga = torch.autograd.grad((lp * a + ent * b).sum(), (hidden, weight))
    gb = torch.autograd.grad((lp_n * a.double() + ent_n * b.double()).sum(), (hidden, weight))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x.double(), y.double(), atol=1e-5, rtol=1e-5)


def test_without_entropy_grad_nothing_changes():
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(2, 4, 31, generator=g, requires_grad=True)
    labels = torch.randint(0, 31, (2, 4), generator=g)
    ent0, lp0 = token_stats(logits, labels, chunk_size=3)
    ent1, lp1 = token_stats(logits, labels, chunk_size=3, entropy_grad=True)
    assert torch.equal(ent0, ent1) and torch.equal(lp0, lp1)
    assert not ent0.requires_grad and ent1.requires_grad
    (g0,) = torch.autograd.grad(lp0.sum(), logits)
    (g1,) = torch.autograd.grad(lp1.sum(), logits)  # entropy unused: the log-prob gradient only
    torch.testing.assert_close(g0, g1, atol=1e-7, rtol=0)


def test_entropy_bonus_reaches_the_logits_through_the_loss():
    """loss = pg − c·agg(H): the logits gradient equals the naive float64 computation of the same loss."""
    from stapoctl.losses import compute_policy_loss

    g = torch.Generator().manual_seed(14)
    logits = (torch.randn(2, 4, 23, generator=g) * 2).requires_grad_(True)
    labels = torch.randint(0, 23, (2, 4), generator=g)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    kw = dict(advantages=torch.tensor([1.0, -1.0]), response_mask=mask, entropy_coef=0.05)
    ent, lp = token_stats(logits, labels, chunk_size=3, temperature=0.8, entropy_grad=True)
    loss, _ = compute_policy_loss("dapo", log_prob=lp, old_log_prob=lp.detach(), entropy=ent, **kw)
    (ga,) = torch.autograd.grad(loss, logits)
    ent_n, lp_n = naive64(logits, labels, 0.8)
    # at rho = 1: pg = -sum(A * rho) / 5, the bonus -0.05 * sum(H) / 5 (token-mean over 5 tokens)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)[:, None]
    ratio = torch.exp(lp_n - lp_n.detach())
    naive_loss = (torch.where(mask, -adv * ratio - 0.05 * ent_n, 0.0)).sum() / 5
    (gb,) = torch.autograd.grad(naive_loss, logits)
    torch.testing.assert_close(ga.double(), gb.double(), atol=1e-6, rtol=0)
