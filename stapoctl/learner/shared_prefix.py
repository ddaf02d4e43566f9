"""Shared-prefix forward: each distinct prompt of a micro-batch is run through the model once.

GRPO-family batches hold n responses per prompt, and a plain forward recomputes the prompt for
every one of them. Here the prompts' keys and values are computed once per distinct prompt and
indexed out to its n rows as a KV cache; the responses then run on top of it. Every row still
sees exactly its own prompt, so the log-probs are the plain forward's (equal in fp32 in
tests/test_shared_prefix.py) and the gradients are too (the prompt's share is summed over its
rows by the indexing's backward instead of computed n times). The idea is Prefix Grouper (Liu
et al. 2025, "Prefix Grouper: Efficient GRPO Training through Shared-Prefix Forward").

It pays where prompts are a large share of the tokens (the embedded default: 33-token prompts,
~19-token responses, n = 8: 35% less learner work per forward and backward); with 20k-token
responses it changes little, and it does nothing for a micro-batch of distinct prompts.
"""

from __future__ import annotations

from typing import Any, Optional


def enabled(learner: dict, on_cuda: bool) -> bool:
    """`learner.shared_prefix`, where None (auto) is on for a CPU learner and off on a GPU.

    On a CPU the learner is compute-bound and the prompts it does not recompute are time saved
    (embedded default: update 0.098 -> 0.071 s). On an H100 the prefix pass is one more run of
    every layer's kernels for a handful of rows, and the host launching them becomes the limit:
    a 0.6B step with 128-token prompts and 256-1024-token responses ran 1.54x slower with it
    (8.5k against 13.0k response tok/s, `stapoctl bench gpu_learner`) for the same kernel time.
    Neither checkpointed layers nor ZeRO-3 keep the KV cache it is made of: off there. Packed
    (`learner.remove_padding`), a prompt is one span its responses attend to (learner/packing.py):
    no cache, so checkpointing keeps it."""
    if int(learner.get("zero_stage") or 0) == 3:
        return False
    if learner.get("gradient_checkpointing") and not learner.get("remove_padding"):
        return False
    setting = learner.get("shared_prefix")
    return (not on_cuda) if setting is None else bool(setting)


def prompt_groups(prompt_ids, prompt_mask):
    """(one row per distinct prompt, each row's index into those) or None when all differ."""
    import torch

    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    if len(uniq) == len(key):
        return None
    first = torch.empty(len(uniq), dtype=torch.long, device=key.device)
    first.scatter_(0, inverse, torch.arange(len(key), device=key.device))  # any row of each group
    return first, inverse


def shared_prefix_hidden(decoder: Any, input_ids, attention_mask, position_ids, prompt_length: int,
                         response_length: int) -> Optional[Any]:
    """Hidden states [B, r] of the positions that predict the r response tokens, or None when no
    two rows share a prompt (then the plain forward is as cheap).

    The prefix is the prompt without its last token; the suffix is that token plus the response
    (but its last token), so the suffix's hidden states are exactly the r predicting positions.
    Prompts are left-padded, so the last prompt column is a real token in every row."""
    p, r = prompt_length, response_length
    if p < 2:
        return None
    groups = prompt_groups(input_ids[:, :p], attention_mask[:, :p])
    if groups is None:
        return None
    first, inverse = groups
    prefix = decoder(input_ids=input_ids[first, : p - 1], attention_mask=attention_mask[first, : p - 1],
                     position_ids=position_ids[first, : p - 1], use_cache=True)
    cache = prefix.past_key_values
    cache.batch_select_indices(inverse)  # differentiable indexing: each row gets its prompt's K/V
    out = decoder(input_ids=input_ids[:, p - 1 : p + r - 1], attention_mask=attention_mask[:, : p + r - 1],
                  position_ids=position_ids[:, p - 1 : p + r - 1], past_key_values=cache, use_cache=True)
    return out.last_hidden_state
