"""Chunked per-token log pi(y_t), entropy and sum_k pi_k^2 without a [B, T, V] fp32 softmax.

``labels`` are the tokens scored at each position, already aligned with the logits (the
caller does the next-token shift: labels[b, t] = input_ids[b, t + 1] for logits[b, t]).
Labels < 0 (e.g. -100 padding) give log_prob 0 and no gradient; their entropy is still computed.

Memory: the forward keeps only the per-row log-sum-exp; the backward recomputes each chunk's
softmax from it. From logits, the extra memory is the gradient w.r.t. the logits (one [B, T, V]
tensor in the logits' dtype, which autograd needs anyway) plus ~2 fp32 [chunk, V] buffers.
From hidden states + LM-head weight, no [B, T, V] tensor exists at all: logits are made and
dropped chunk by chunk, and the weight gradient is accumulated with addmm in the weight's dtype.

The log-prob is the sampling distribution's (docs/LOSSES.md, "What each side of a ratio is"): the
logits divided by the temperature and, at top_p < 1, renormalised over the kept set that vLLM's
sampler builds (`apply_top_k_top_p_pytorch` in vllm/v1/sample/ops/topk_topp_sampler.py: sort, softmax,
cumsum, drop while cumsum <= 1 - p, keep the last), recomputed here from the learner's own tempered
logits; the scored token is kept if it falls outside. Its gradient holds the kept set fixed. Entropy
and sum p^2 stay those of the whole tempered distribution (the policy's uncertainty, smooth in the
logits). At top_p < 1 a chunk sorts its logits: ~3 more [chunk, V] buffers while it is processed.
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


def _kept_cut(z: Tensor, top_p: float) -> Tensor:
    """[n]: the smallest logit of each row's top-p kept set, built as vLLM's sampler builds it (fp32)."""
    zs = z.sort(dim=-1).values  # ascending
    cum = zs.softmax(dim=-1).cumsum_(dim=-1)
    drop = cum <= 1 - torch.tensor(top_p, dtype=torch.float32, device=z.device)
    drop[:, -1] = False  # at least one token stays
    return zs.gather(1, drop.sum(dim=-1, keepdim=True)).squeeze(1)  # drop is a prefix: cum only grows


def _kept(z: Tensor, cut: Tensor, lab: Tensor) -> Tensor:
    """bool [n, V]: the kept set (logit >= the row's cut), the scored token always in it."""
    keep = z >= cut[:, None]
    return keep.scatter_(1, lab[:, None], True)


def _nucleus_stats(z: Tensor, lab: Tensor, top_p: float) -> tuple[Tensor, Tensor, Tensor]:
    """(log pi(label) renormalised over the kept set, the rows' cut, the kept set's log-sum-exp);
    z (tempered, fp32) is left as it is."""
    cut = _kept_cut(z, top_p)
    lse_kept = torch.logsumexp(z.masked_fill(~_kept(z, cut, lab), float("-inf")), dim=-1)
    return z.gather(1, lab[:, None]).squeeze(1) - lse_kept, cut, lse_kept


def _chunk_stats(z: Tensor, lab: Tensor, top_p: float) -> tuple[Tensor, ...]:
    """(log pi(label), entropy, sum p^2, lse, cut, lse_kept) of tempered fp32 logits z (consumed);
    the last two are empty at top_p = 1."""
    if top_p >= 1.0:
        return (*_softmax_stats(z, lab), z.new_empty(0), z.new_empty(0))
    logp, cut, lse_kept = _nucleus_stats(z, lab, top_p)
    _, ent, p2, lse = _softmax_stats(z, lab)
    return logp, ent, p2, lse, cut, lse_kept


def _grad_chunk(z: Tensor, lse: Tensor, lab: Tensor, g: Tensor, temperature: float,
                nucleus: Optional[tuple[Tensor, Tensor]] = None,
                g_ent: Optional[Tensor] = None, ent: Optional[Tensor] = None) -> Tensor:
    """`_grad_logits`, or at top_p < 1 (`nucleus` = (cut, lse_kept)): g * (onehot - p_kept) / T, p_kept
    zero outside the kept set, plus the whole distribution's entropy gradient when asked."""
    if nucleus is None:
        return _grad_logits(z, lse, lab, g, temperature, g_ent, ent)
    cut, lse_kept = nucleus
    ent_grad = None
    if g_ent is not None:  # -g_ent * p * (log p + H) over the whole tempered distribution
        logp = z - lse[:, None]
        ent_grad = logp.exp().mul_(logp.add_(ent[:, None])).mul_(g_ent[:, None]).neg_()
    keep = _kept(z, cut, lab)
    p = z.sub_(lse_kept[:, None]).exp_().masked_fill_(~keep, 0.0).mul_(-g[:, None])
    p.scatter_add_(1, lab[:, None], g[:, None])
    if ent_grad is not None:
        p.add_(ent_grad)
    if temperature != 1.0:
        p.div_(temperature)
    return p


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


def _nucleus_of(ctx, sl) -> Optional[tuple[Tensor, Tensor]]:
    """The saved (cut, lse_kept) of positions `sl`, or None at top_p = 1."""
    return None if ctx.top_p >= 1.0 else (ctx.cut[sl], ctx.lse_kept[sl])


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, top_p: float, chunk: int,
                entropy_grad: bool):
        x = _rows3d(logits)
        b, t, _ = x.shape
        lab = labels.reshape(b, t)
        valid = lab >= 0
        lab = lab.clamp(min=0)
        nucleus = top_p < 1.0
        out = [torch.empty(b, t, dtype=torch.float32, device=logits.device) for _ in range(4 + 2 * nucleus)]
        for i, s, e in _chunks(b, t, chunk):
            z = x[i, s:e].to(torch.float32, copy=True)
            if temperature != 1.0:
                z.div_(temperature)
            for buf, val in zip(out, _chunk_stats(z, lab[i, s:e], top_p)):
                buf[i, s:e] = val
            del z
        logp, ent, p2, lse, *kept = out
        logp = torch.where(valid, logp, 0.0)
        ctx.save_for_backward(logits, lab, valid, lse, *((ent,) if entropy_grad else ()))
        ctx.temperature, ctx.top_p, ctx.chunk = temperature, top_p, chunk
        ctx.cut, ctx.lse_kept = kept if nucleus else (None, None)
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
            gx[i, s:e] = _grad_chunk(z, lse[i, s:e], lab[i, s:e], g_all[i, s:e], ctx.temperature,
                                     _nucleus_of(ctx, (i, slice(s, e))), *(eg or ()))
            del z
        return grad, None, None, None, None, None


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, top_p: float,
                chunk: int, entropy_grad: bool):
        d = hidden.shape[-1]
        h = hidden.reshape(-1, d)
        n = h.shape[0]
        lab = labels.reshape(-1)
        valid = lab >= 0
        lab = lab.clamp(min=0)
        nucleus = top_p < 1.0
        out = [torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4 + 2 * nucleus)]
        for _, s, e in _chunks(1, n, chunk):
            z = (h[s:e] @ weight.t()).float()
            if temperature != 1.0:
                z.div_(temperature)
            for buf, val in zip(out, _chunk_stats(z, lab[s:e], top_p)):
                buf[s:e] = val
            del z
        logp, ent, p2, lse, *kept = out
        logp = torch.where(valid, logp, 0.0)
        ctx.save_for_backward(hidden, weight, lab, valid, lse, *((ent,) if entropy_grad else ()))
        ctx.temperature, ctx.top_p, ctx.chunk = temperature, top_p, chunk
        ctx.cut, ctx.lse_kept = kept if nucleus else (None, None)
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
            gz = _grad_chunk(z, lse[s:e], lab[s:e], g_all[s:e], ctx.temperature, _nucleus_of(ctx, slice(s, e)),
                             *(eg or ())).to(weight.dtype)
            if need_h:
                grad_h[s:e] = gz @ weight
            if need_w:
                grad_w.addmm_(gz.t(), h[s:e].to(weight.dtype))
            del z, gz
        return (None if grad_h is None else grad_h.view(hidden.shape)), grad_w, None, None, None, None, None


def token_stats(
    logits_or_hidden: Tensor,
    labels: Tensor,
    *,
    lm_head_weight: Optional[Tensor] = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    top_p: float = 1.0,
    return_sum_p2: bool = False,
    entropy_grad: bool = False,
):
    """(entropy, log_prob) or (entropy, log_prob, sum_p2), each [B, T] fp32.

    ``logits_or_hidden``: logits [B, T, V], or hidden states [B, T, D] when ``lm_head_weight``
    [V, D] is given. Logits are divided by ``temperature`` and log_prob is renormalised over the
    ``top_p`` kept set (match the rollout's: the module docstring). log_prob
    carries a gradient; sum_p2 is detached, and so is entropy unless ``entropy_grad`` (for an
    entropy bonus: dH/dz = -p (log p + H), through the temperature like log_prob; costs one
    saved fp32 value per position and, in the backward, one more [chunk, V] buffer).
    ``chunk_size``: positions per chunk; the transient fp32 buffers are ~2 x chunk_size x V x 4 bytes.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    if not 0.0 < top_p <= 1.0:
        raise ValueError("top_p must be in (0, 1]")
    x = logits_or_hidden
    if labels.shape != x.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal the leading shape {tuple(x.shape[:-1])}")
    labels = labels.to(device=x.device, dtype=torch.long)
    if lm_head_weight is None:
        logp, ent, p2 = _FromLogits.apply(x, labels, float(temperature), float(top_p), int(chunk_size),
                                        bool(entropy_grad))
    else:
        if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != x.shape[-1]:
            raise ValueError(f"lm_head_weight must be [V, D={x.shape[-1]}], got {tuple(lm_head_weight.shape)}")
        logp, ent, p2 = _FromHidden.apply(x, lm_head_weight, labels, float(temperature), float(top_p),
                                          int(chunk_size), bool(entropy_grad))
    return (ent, logp, p2) if return_sum_p2 else (ent, logp)
