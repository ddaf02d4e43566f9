"""Padding-free forward (`learner.remove_padding`): a micro-batch's rows packed into one sequence.

A padded forward runs every row at the micro-batch's widest prompt + response, so with responses of
48-384 tokens a third of its tokens are padding; sorting by length (a token budget) removes only part
of it. Here the real tokens are laid end to end in one row and attention runs span by span over the
packed queries, keys and values, so no token is padding and the linear layers see one long matrix.

- Without the shared prefix, a span is a row: its prompt (no left padding) and its response but the
  last token (whose prediction no loss reads), positions from 0, causal within the span.
- With it (`learner.shared_prefix`, auto on a CPU learner), each distinct prompt of the micro-batch
  is one span, and each of its responses a span that attends to all of that prompt and causally to
  itself, positions continuing after the prompt — Prefix Grouper's shared-prefix forward without a
  second pass or a KV cache, so it also works with gradient checkpointing. The first response token
  is predicted from the prompt's last position, as in the padded forward.

The log-probs, entropies and gradients are the padded forward's (tests/test_learner_packing.py,
every registered loss to 1e-5 in fp32). verl calls it `use_remove_padding` (flash-attn's varlen
kernel); OpenRLHF `--packing_samples`.

Attention goes through transformers' `AttentionInterface` under its own name; where no packing is
asked (the padded paths) the same function is transformers' SDPA. Span by span is one SDPA call per
span and layer: on a CPU that costs what the padded forward's batched call costs; on a GPU it is a
launch per span and layer (untested there: a GPU session should measure it against flash-attn's or
PyTorch's varlen kernel before it becomes a GPU default). The frozen reference and gradient
checkpointing use it as the policy does (recomputation gets the same spans).
"""

from __future__ import annotations

from typing import Any

ATTENTION = "stapo_packed"


def enabled(learner: dict) -> bool:
    return bool(learner.get("remove_padding"))


def use_packed_attention(model: Any) -> None:
    """Route `model`'s attention through `packed_attention` (SDPA unless a forward passes spans)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from stapoctl.errors import UserError

    if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        raise UserError("learner.remove_padding=true: this model has sliding-window attention layers, which the "
                        "packed attention does not window: set learner.remove_padding=false")
    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.config._attn_implementation = ATTENTION


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     stapo_spans=None, **kwargs):
    """Attention over packed spans ([1, heads, T, d] in, [1, T, heads, d] out): each span (start, end,
    prefix start, prefix end) sees all of its prefix and itself causally; without `stapo_spans`,
    transformers' SDPA attention."""
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if stapo_spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = []
    for s, e, ps, pe in stapo_spans:
        q = query[:, :, s:e]
        if ps == pe:
            out.append(sdpa(q, key[:, :, s:e], value[:, :, s:e], dropout_p=dropout, scale=scaling, is_causal=True))
            continue
        k = torch.cat([key[:, :, ps:pe], key[:, :, s:e]], dim=2)
        v = torch.cat([value[:, :, ps:pe], value[:, :, s:e]], dim=2)
        mask = torch.ones(e - s, pe - ps + e - s, dtype=torch.bool, device=q.device).tril(pe - ps)
        out.append(sdpa(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def packed_tokens(prompt_lens, response_lens, groups=None) -> int:
    """Tokens a packed forward of these rows runs: each prompt (once per group when `groups`, the
    rows' prompt ids, is given) and each response but its last token."""
    if groups is None:
        return sum(p + r - 1 for p, r in zip(prompt_lens, response_lens) if r)
    prompts = {g: p for g, p, r in zip(groups, prompt_lens, response_lens) if r}
    return sum(prompts.values()) + sum(r - 1 for r in response_lens if r)


def pack(mb, device, share_prompts: bool = False) -> tuple[Any, Any, list, Any]:
    """(input ids [1, T], position ids [1, T], spans, the packed position predicting each response
    token, in the row-major order of `mb.response_mask`); (None, None, [], None) without responses."""
    import torch

    p_lens, r_lens = mb.prompt_mask.sum(dim=1).tolist(), mb.response_mask.sum(dim=1).tolist()
    ids, pos, where, spans, prompt_at = [], [], [], [], {}
    size = 0

    def put(tokens, first_pos: int, prefix: tuple[int, int] = (0, 0)) -> int:
        """Append a span (a prefix of (0, 0): none) and return where it starts."""
        nonlocal size
        ids.append(tokens)
        pos.append(torch.arange(first_pos, first_pos + len(tokens)))
        spans.append((size, size + len(tokens), *prefix))
        size += len(tokens)
        return size - len(tokens)

    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        if not r:
            continue
        prompt = mb.prompt_ids[i, mb.prompt_length - p:]
        if not share_prompts:
            start = put(torch.cat([prompt, mb.response_ids[i, : r - 1]]), 0)
            where.append(torch.arange(start + p - 1, start + p - 1 + r))
            continue
        key = tuple(prompt.tolist())
        if key not in prompt_at:
            prompt_at[key] = put(prompt, 0)
        ps = prompt_at[key]
        where.append(torch.tensor([ps + p - 1]))
        if r > 1:
            start = put(mb.response_ids[i, : r - 1], p, (ps, ps + p))
            where.append(torch.arange(start, start + r - 1))
    if not ids:
        return None, None, [], None
    return torch.cat(ids)[None].to(device), torch.cat(pos)[None].to(device), spans, torch.cat(where).to(device)


def packed_hidden(decoder: Any, mb, device, share_prompts: bool = False) -> tuple[Any, Any]:
    """(hidden states [N, h] of the positions predicting the N response tokens, their labels [N]) in
    the row-major order of `mb.response_mask`; (None, None) when no row has a response token."""
    ids, pos, spans, where = pack(mb, device, share_prompts)
    if ids is None:
        return None, None
    masks = {kind: None for kind in set(getattr(decoder.config, "layer_types", None) or ["full_attention"])}
    out = decoder(input_ids=ids, position_ids=pos, attention_mask=masks, use_cache=False, stapo_spans=spans)
    labels = mb.response_ids[mb.response_mask].to(device)
    return out.last_hidden_state[0, where], labels


def packed_token_stats(model: Any, mb, device, share_prompts: bool = False, **stats_kwargs) -> Any:
    """`token_stats` of `mb`'s response tokens from a packed forward, as [B, R] tensors with zeros on
    padding; None when no row has a response token (the caller's padded forward handles that)."""
    from stapoctl.losses import token_stats

    hidden, labels = packed_hidden(model.get_decoder(), mb, device, share_prompts)
    if hidden is None:
        return None
    stats = token_stats(hidden[None], labels[None], lm_head_weight=model.get_output_embeddings().weight,
                        **stats_kwargs)
    return tuple(unpack(t[0], mb.response_mask) for t in stats)


def unpack(flat, mask):
    """A [N] per-token tensor back to [B, R] with zeros on padding (differentiable)."""
    import torch

    return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask.to(flat.device), flat)
