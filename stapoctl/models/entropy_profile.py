"""A model's token-entropy profile on its own T=1.0 samples: how peaked it is, and what
STAPO's S2T mask (000 Eq. 1) would silence at each swept tau_p.

Why: a tau_p or tau_h sweep only means something if the base model has a spread of token
entropies (a confident majority and a tail of forks, as LLM chains of thought have) and its
sampled low-entropy tokens fall on both sides of the swept thresholds. The tiny model's
build records this profile in `base_eval.json`; `python -m stapoctl.testbed.entropy_profile
MODEL_DIR` measures any HF model dir (a checkpoint, say) on the toy task.

h* here is the quantile over all sampled response tokens, not per mini-batch as in training
(a stable summary; a mini-batch's quantile scatters around it). Advantages are GRPO's over
each problem's group of samples, rewards from the DAPO rule verifier.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch

TAU_PS = (2e-3, 2e-2, 2e-1)  # the swept tau_p (SPEC)
TAU_H = 0.2  # STAPO's default: h* = 80th percentile
TOP_CONFIDENT = 0.999


@torch.no_grad()
def token_stats(model, tokenizer, prompts: Sequence[str], responses: Sequence[Sequence[int]],
                batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pi of the sampled token, entropy, top prob, response mask), each [N, T_max], for the
    responses (token ids) scored after their prompts (one prompt per response)."""
    n, width = len(responses), max((len(r) for r in responses), default=0)
    out = [torch.zeros(n, width) for _ in range(3)]
    mask = torch.zeros(n, width, dtype=torch.bool)
    for start in range(0, n, batch_size):
        rows = []
        for i in range(start, min(n, start + batch_size)):
            p = tokenizer(prompts[i], add_special_tokens=False)["input_ids"]
            rows.append((p, list(responses[i])))
        seq_len = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), seq_len), tokenizer.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for j, (p, r) in enumerate(rows):  # left-padded, like generation
            s = p + r
            ids[j, seq_len - len(s):] = torch.tensor(s)
            attn[j, seq_len - len(s):] = 1
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
        logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        for j, (p, r) in enumerate(rows):
            if not r:
                continue
            pos = torch.arange(seq_len - len(r) - 1, seq_len - 1)  # logits predicting the response
            lp = logp[j, pos]
            probs = lp.exp()
            i = start + j
            out[0][i, : len(r)] = probs.gather(1, torch.tensor(r)[:, None])[:, 0]
            out[1][i, : len(r)] = -(probs * lp).sum(-1)
            out[2][i, : len(r)] = probs.max(-1).values
            mask[i, : len(r)] = True
    return out[0], out[1], out[2], mask


def profile(prob: torch.Tensor, ent: torch.Tensor, top: torch.Tensor, mask: torch.Tensor,
            adv: torch.Tensor, *, tau_ps: Sequence[float] = TAU_PS, tau_h: float = TAU_H,
            token_text: Any = None) -> dict[str, Any]:
    """The summary recorded in base_eval.json (see the module docstring). `adv` is [N];
    `token_text(i, t)` (optional) names a token for the list of what each tau_p silences."""
    from stapoctl.losses.masks import entropy_threshold, masked_quantile, s2t_mask

    a = adv.reshape(-1, 1).expand_as(prob)
    h = entropy_threshold(ent, mask, tau_h)
    m = mask
    pos = m & (a > 0)
    low = pos & (ent < h)
    out: dict[str, Any] = {
        "tokens": int(m.sum()),
        "tau_h": tau_h,
        "h_star": round(float(h), 4),
        "entropy_mean": round(float(ent[m].mean()), 4) if m.any() else 0.0,
        "entropy_p50": round(float(masked_quantile(ent, m, 0.5)), 4),
        "entropy_p95": round(float(masked_quantile(ent, m, 0.95)), 4),
        "top_prob_gt_0999": round(float((top[m] > TOP_CONFIDENT).float().mean()), 4) if m.any() else 0.0,
        "pos_adv_tokens": int(pos.sum()),
        "pos_adv_low_entropy_tokens": int(low.sum()),
        "by_tau_p": {},
    }
    for tau_p in tau_ps:
        s2t = s2t_mask(a, prob, ent, m, tau_p=tau_p, threshold=h, kind="s2t")
        prob_only = s2t_mask(a, prob, ent, m, tau_p=tau_p, threshold=h, kind="prob_only")
        row: dict[str, Any] = {
            "s2t": int(s2t.sum()),  # what STAPO silences
            "prob_only": int(prob_only.sum()),
            "high_entropy": int((prob_only & ~s2t).sum()),
            "spurious_ratio": round(float(s2t.sum()) / max(1, int(m.sum())), 6),
        }
        if token_text is not None:
            names = Counter(token_text(int(i), int(t)) for i, t in s2t.nonzero().tolist())
            row["s2t_top_tokens"] = [[k, v] for k, v in names.most_common(6)]
        out["by_tau_p"][f"{tau_p:g}"] = row
    return out


def measure(model, tokenizer, prompts: Sequence[str], responses: list[list[list[int]]],
            answers: Sequence[str], **kwargs) -> dict[str, Any]:
    """Profile of grouped samples: responses[k] are the token ids sampled for prompts[k]."""
    from stapoctl.losses import compute_advantages
    from stapoctl.reward import dapo_reward

    flat_prompts, flat, rewards, groups = [], [], [], []
    for k, (prompt, group, answer) in enumerate(zip(prompts, responses, answers)):
        for ids in group:
            flat_prompts.append(prompt)
            flat.append(ids)
            rewards.append(dapo_reward(tokenizer.decode(ids, skip_special_tokens=True), answer))
            groups.append(k)
    adv = compute_advantages("grpo", torch.tensor(rewards), torch.tensor(groups))
    prob, ent, top, mask = token_stats(model, tokenizer, flat_prompts, flat)

    def text(i: int, t: int) -> str:
        return tokenizer.decode([flat[i][t]])

    return profile(prob, ent, top, mask, adv, token_text=text, **kwargs)
