"""Supervised warm start of the tiny model on toy demos, and the toy accuracy of a model.

A random model never writes `\\boxed{...}`, so RL from scratch would see reward -1 forever.
A short imitation pass teaches the answer layout; the demos' boxed/unboxed mix decides how
much headroom RL is left (see `stapoctl.data.toy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class Example:
    prompt: str
    response: str


def encode_batch(tokenizer, batch: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), right-padded; loss only on response + eos.

    Prompt and response are tokenized separately and concatenated: that is how the engine
    sees them (it tokenizes the prompt, then appends sampled tokens one by one).
    """
    eos = tokenizer.eos_token_id
    seqs, label_seqs = [], []
    for ex in batch:
        p = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(ex.response, add_special_tokens=False)["input_ids"] + [eos]
        seqs.append(p + r)
        label_seqs.append([-100] * len(p) + r)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, label_seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, : len(lab)] = torch.tensor(lab)
    return ids, mask, labels


def lr_at(step: int, total: int, peak: float, warmup_frac: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up then cosine decay to floor·peak: converges in a few hundred steps."""
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def warm_start(
    model,
    tokenizer,
    examples: Sequence[Example],
    *,
    batch_size: int,
    lr: float,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """One pass over examples in order, batch_size at a time; returns the loss per step.

    The caller fixes the order (seeded), so the same examples give the same weights.
    """
    steps = len(examples) // batch_size
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        batch = examples[step * batch_size : (step + 1) * batch_size]
        ids, mask, labels = encode_batch(tokenizer, batch)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


@torch.no_grad()
def sample_ids(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    n: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 512,
) -> list[list[list[int]]]:
    """n sampled responses per prompt as token ids, up to and including eos (what the engine
    returns and the learner scores); plain ancestral sampling, temperature 0 = greedy, no top-k."""
    torch.manual_seed(seed)
    flat = [p for p in prompts for _ in range(n)]
    eos, out_ids = tokenizer.eos_token_id, []
    for start in range(0, len(flat), batch_size):
        chunk = flat[start : start + batch_size]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        greedy = temperature == 0
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else temperature,
            top_k=None if greedy else 0,
            top_p=None if greedy else 1.0,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            out_ids.append(row[: row.index(eos) + 1] if eos in row else row)
    return [out_ids[i * n : (i + 1) * n] for i in range(len(prompts))]


def decode(tokenizer, ids: list[list[list[int]]]) -> list[list[str]]:
    return [tokenizer.batch_decode(group, skip_special_tokens=True) for group in ids]


def sample(model, tokenizer, prompts: Sequence[str], **kwargs) -> list[list[str]]:
    """n responses per prompt as text (`sample_ids` decoded)."""
    return decode(tokenizer, sample_ids(model, tokenizer, prompts, **kwargs))
