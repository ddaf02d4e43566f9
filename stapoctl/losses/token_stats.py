"""Chunked per-token log pi(y_t), entropy and sum_k pi_k^2 without a [B, T, V] fp32 softmax.

``labels`` are the tokens scored at each position, already aligned with the logits (the
caller does the next-token shift: labels[b, t] = input_ids[b, t + 1] for logits[b, t]).
Labels < 0 (e.g. -100 padding) give log_prob 0 and no gradient; their entropy is still computed.

Memory: the forward keeps only the per-row log-sum-exp; the backward recomputes each chunk's
softmax from it. From logits, the extra memory is the gradient w.r.t. the logits (one [B, T, V]
tensor in the logits' dtype, which autograd needs anyway) plus ~2 fp32 [chunk, V] buffers.
From hidden states + LM-head weight, no [B, T, V] tensor exists at all: logits are made and
dropped chunk by chunk, and the weight gradient is accumulated with addmm in the weight's dtype.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


def _rows3d(x: Tensor) -> Tensor:
    """A [B', T', V] view of ``x`` ([..., V]) without copying: flat when possible, else per leading row."""
    v = x.shape[-1]
    try:
        return x.view(1, -1, v)
    except RuntimeError:
        if x.dim() != 3:
            raise ValueError("non-contiguous logits must be 3-D [B, T, V]") from None
        return x


def _chunks(b: int, t: int, chunk: int) -> Iterator[tuple[int, int, int]]:
    for i in range(b):
        for s in range(0, t, chunk):
            yield i, s, min(s + chunk, t)


def _softmax_stats(z: Tensor, lab: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(log pi(label), entropy, sum p^2, lse) of fp32 logits z [n, V] (z is consumed)."""
    lse = torch.logsumexp(z, dim=-1)
    logp_all = z.sub_(lse[:, None])  # log-softmax in place; H = -sum p log p avoids lse - sum p z cancellation
    logp = logp_all.gather(1, lab[:, None]).squeeze(1)
    p = logp_all.exp()
    # elementwise products, not bmm: a matmul could run in TF32 on GPUs and lose ~1e-3
    tmp = torch.mul(p, logp_all)
    ent = -tmp.sum(dim=-1)
    p2 = torch.mul(p, p, out=tmp).sum(dim=-1)
    return logp, ent, p2, lse


def _grad_logits(z: Tensor, lse: Tensor, lab: Tensor, g: Tensor, temperature: float,
                 g_ent: Optional[Tensor] = None, ent: Optional[Tensor] = None) -> Tensor:
    """d(sum g * log pi(label) + g_ent * H) / d logits, in place over z (fp32):
    g * (onehot - p) / T, plus -g_ent * p * (log p + H) / T when the entropy has a gradient."""
    if g_ent is None:
        p = z.sub_(lse[:, None]).exp_()
        p.mul_(-g[:, None])
    else:
        logp = z.sub_(lse[:, None])
        p = logp.exp()
        # -p * (g + g_ent * (log p + H)): one more [chunk, V] buffer, only on this path
        p.mul_(logp.add_(ent[:, None]).mul_(g_ent[:, None]).add_(g[:, None])).neg_()
    p.scatter_add_(1, lab[:, None], g[:, None])
    if temperature != 1.0:
        p.div_(temperature)
    return p


def _entropy_grad(g_ent: Optional[Tensor], valid_shape: torch.Size) -> Optional[Tensor]:
    return None if g_ent is None else g_ent.reshape(valid_shape).float()


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, chunk: int, entropy_grad: bool):
        x = _rows3d(logits)
        b, t, _ = x.shape
        lab = labels.reshape(b, t)
        valid = lab >= 0
        lab = lab.clamp(min=0)
        out = [torch.empty(b, t, dtype=torch.float32, device=logits.device) for _ in range(4)]
        for i, s, e in _chunks(b, t, chunk):
            z = x[i, s:e].to(torch.float32, copy=True)
            if temperature != 1.0:
                z.div_(temperature)
            for buf, val in zip(out, _softmax_stats(z, lab[i, s:e])):
                buf[i, s:e] = val
            del z
        logp, ent, p2, lse = out
        logp = torch.where(valid, logp, 0.0)
        ctx.save_for_backward(logits, lab, valid, lse, *((ent,) if entropy_grad else ()))
        ctx.temperature, ctx.chunk = temperature, chunk
        shape = logits.shape[:-1]
        logp, ent, p2 = logp.view(shape), ent.view(shape), p2.view(shape)
        ctx.mark_non_differentiable(*((p2,) if entropy_grad else (ent, p2)))
        return logp, ent, p2

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp: Tensor, g_ent: Optional[Tensor], _g_p2: Optional[Tensor]):
        logits, lab, valid, lse, *saved_ent = ctx.saved_tensors
        x = _rows3d(logits)
        b, t, v = x.shape
        g_all = torch.where(valid, grad_logp.reshape(b, t).float(), 0.0)
        ge = _entropy_grad(g_ent if saved_ent else None, lab.shape)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gx = grad.view(b, t, v) if x.shape[0] == 1 else grad
        for i, s, e in _chunks(b, t, ctx.chunk):
            z = x[i, s:e].to(torch.float32, copy=True)
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            eg = None if ge is None else (ge[i, s:e], saved_ent[0][i, s:e])
            gx[i, s:e] = _grad_logits(z, lse[i, s:e], lab[i, s:e], g_all[i, s:e], ctx.temperature, *(eg or ()))
            del z
        return grad, None, None, None, None


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, chunk: int,
                entropy_grad: bool):
        d = hidden.shape[-1]
        h = hidden.reshape(-1, d)
        n = h.shape[0]
        lab = labels.reshape(-1)
        valid = lab >= 0
        lab = lab.clamp(min=0)
        out = [torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4)]
        for _, s, e in _chunks(1, n, chunk):
            z = (h[s:e] @ weight.t()).float()
            if temperature != 1.0:
                z.div_(temperature)
            for buf, val in zip(out, _softmax_stats(z, lab[s:e])):
                buf[s:e] = val
            del z
        logp, ent, p2, lse = out
        logp = torch.where(valid, logp, 0.0)
        ctx.save_for_backward(hidden, weight, lab, valid, lse, *((ent,) if entropy_grad else ()))
        ctx.temperature, ctx.chunk = temperature, chunk
        shape = hidden.shape[:-1]
        logp, ent, p2 = logp.view(shape), ent.view(shape), p2.view(shape)
        ctx.mark_non_differentiable(*((p2,) if entropy_grad else (ent, p2)))
        return logp, ent, p2

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp: Tensor, g_ent: Optional[Tensor], _g_p2: Optional[Tensor]):
        hidden, weight, lab, valid, lse, *saved_ent = ctx.saved_tensors
        d = hidden.shape[-1]
        h = hidden.reshape(-1, d)
        n = h.shape[0]
        g_all = torch.where(valid, grad_logp.reshape(-1).float(), 0.0)
        ge = _entropy_grad(g_ent if saved_ent else None, lab.shape)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        for _, s, e in _chunks(1, n, ctx.chunk):
            z = (h[s:e] @ weight.t()).float()
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            eg = None if ge is None else (ge[s:e], saved_ent[0][s:e])
            gz = _grad_logits(z, lse[s:e], lab[s:e], g_all[s:e], ctx.temperature, *(eg or ())).to(weight.dtype)
            if need_h:
                grad_h[s:e] = gz @ weight
            if need_w:
                grad_w.addmm_(gz.t(), h[s:e].to(weight.dtype))
            del z, gz
        return (None if grad_h is None else grad_h.view(hidden.shape)), grad_w, None, None, None, None


def token_stats(
    logits_or_hidden: Tensor,
    labels: Tensor,
    *,
    lm_head_weight: Optional[Tensor] = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_sum_p2: bool = False,
    entropy_grad: bool = False,
):
    """(entropy, log_prob) or (entropy, log_prob, sum_p2), each [B, T] fp32.

    ``logits_or_hidden``: logits [B, T, V], or hidden states [B, T, D] when ``lm_head_weight``
    [V, D] is given. Logits are divided by ``temperature`` (match the rollout's). log_prob
    carries a gradient; sum_p2 is detached, and so is entropy unless ``entropy_grad`` (for an
    entropy bonus: dH/dz = -p (log p + H), through the temperature like log_prob; costs one
    saved fp32 value per position and, in the backward, one more [chunk, V] buffer).
    ``chunk_size``: positions per chunk; the transient fp32 buffers are ~2 x chunk_size x V x 4 bytes.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    x = logits_or_hidden
    if labels.shape != x.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal the leading shape {tuple(x.shape[:-1])}")
    labels = labels.to(device=x.device, dtype=torch.long)
    if lm_head_weight is None:
        logp, ent, p2 = _FromLogits.apply(x, labels, float(temperature), int(chunk_size), bool(entropy_grad))
    else:
        if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != x.shape[-1]:
            raise ValueError(f"lm_head_weight must be [V, D={x.shape[-1]}], got {tuple(lm_head_weight.shape)}")
        logp, ent, p2 = _FromHidden.apply(x, lm_head_weight, labels, float(temperature), int(chunk_size),
                                          bool(entropy_grad))
    return (ent, logp, p2) if return_sum_p2 else (ent, logp)
