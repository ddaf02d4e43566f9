"""RolloutBatch: the one record that crosses every boundary of a training step.

Rollout actors fill token ids and vLLM's log-probs, the driver adds rewards and advantages,
the learner adds its recomputed log-probs and entropies. Everything is a padded tensor, so
Ray ships it through the object store without per-token Python objects. Layout (verl's):
prompts left-padded [N, P], responses right-padded [N, R]; `cat` of the two is the model input.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Sequence

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    prompt_ids: Tensor  # [N, P] long, left-padded with pad_id
    prompt_mask: Tensor  # [N, P] bool
    response_ids: Tensor  # [N, R] long, right-padded with pad_id
    response_mask: Tensor  # [N, R] bool: sampled tokens (EOS included)
    rollout_log_probs: Tensor  # [N, R] float32, vLLM's log-prob of each sampled token, 0 on padding
    group_ids: Tensor  # [N] long: rows with the same id answer the same prompt (a GRPO group)
    truncated: Tensor  # [N] bool: stopped by max_tokens, not by EOS
    texts: list[str] = field(default_factory=list)  # decoded responses (the verifier reads these)
    prompt_index: Optional[Tensor] = None  # [N] long: the prompt's row in the dataset
    rewards: Optional[Tensor] = None  # [N] float32: the final score (rule reward + any shaping)
    rule_accuracy: Optional[Tensor] = None  # [N] float32: the rule verifier's verdict, 1 correct / 0 not
    advantages: Optional[Tensor] = None  # [N] or [N, R] float32
    old_log_probs: Optional[Tensor] = None  # [N, R] float32, the learner's recompute
    entropy: Optional[Tensor] = None  # [N, R] float32, from the same learner pass
    ref_log_probs: Optional[Tensor] = None  # [N, R] float32, the frozen reference's (loss.kl_coef > 0)

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_token_lists(
        cls,
        prompt_token_ids: Sequence[Sequence[int]],
        responses: Sequence[Sequence[Sequence[int]]],
        response_log_probs: Sequence[Sequence[Sequence[float]]],
        truncated: Sequence[Sequence[bool]],
        texts: Sequence[Sequence[str]],
        *,
        pad_id: int,
        group_offset: int = 0,
        prompt_index: Optional[Sequence[int]] = None,
    ) -> "RolloutBatch":
        """Pad per-prompt lists of n responses into one batch; row i*n+j = prompt i, sample j."""
        rows_prompt: list[Sequence[int]] = []
        rows_resp: list[Sequence[int]] = []
        rows_lp: list[Sequence[float]] = []
        rows_trunc: list[bool] = []
        rows_text: list[str] = []
        groups: list[int] = []
        pidx: list[int] = []
        for i, prompt in enumerate(prompt_token_ids):
            for j, resp in enumerate(responses[i]):
                rows_prompt.append(prompt)
                rows_resp.append(resp)
                rows_lp.append(response_log_probs[i][j])
                rows_trunc.append(bool(truncated[i][j]))
                rows_text.append(texts[i][j])
                groups.append(group_offset + i)
                pidx.append(prompt_index[i] if prompt_index is not None else i)
        n = len(rows_prompt)
        p_len = max((len(p) for p in rows_prompt), default=0)
        r_len = max((len(r) for r in rows_resp), default=0)
        r_len = max(r_len, 1)  # keep [N, R] two-dimensional even if every response is empty
        prompt_ids = torch.full((n, p_len), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_len), dtype=torch.bool)
        response_ids = torch.full((n, r_len), pad_id, dtype=torch.long)
        response_mask = torch.zeros((n, r_len), dtype=torch.bool)
        log_probs = torch.zeros((n, r_len), dtype=torch.float32)
        for k in range(n):
            p, r = rows_prompt[k], rows_resp[k]
            if len(p):
                prompt_ids[k, p_len - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
                prompt_mask[k, p_len - len(p):] = True
            if len(r):
                response_ids[k, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
                response_mask[k, : len(r)] = True
                log_probs[k, : len(r)] = torch.as_tensor(list(rows_lp[k]), dtype=torch.float32)
        return cls(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_log_probs=log_probs,
            group_ids=torch.as_tensor(groups, dtype=torch.long),
            truncated=torch.as_tensor(rows_trunc, dtype=torch.bool),
            texts=list(rows_text),
            prompt_index=torch.as_tensor(pidx, dtype=torch.long),
        )

    @classmethod
    def concat(cls, parts: Sequence["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """Join batches from several rollout actors (re-padding to the widest prompt/response)."""
        if len(parts) == 1:
            return parts[0]
        p_len = max(b.prompt_ids.shape[1] for b in parts)
        r_len = max(b.response_ids.shape[1] for b in parts)
        out: dict[str, Any] = {}
        for f in fields(cls):
            vals = [getattr(b, f.name) for b in parts]
            if f.name == "texts":
                out[f.name] = [t for v in vals for t in v]
                continue
            if any(v is None for v in vals):
                out[f.name] = None
                continue
            if f.name in ("prompt_ids", "prompt_mask"):
                fill = pad_id if f.name == "prompt_ids" else False
                vals = [_pad_left(v, p_len, fill) for v in vals]
            elif vals[0].dim() == 2:
                fill = pad_id if f.name == "response_ids" else 0
                vals = [_pad_right(v, r_len, fill) for v in vals]
            out[f.name] = torch.cat(vals, dim=0)
        return cls(**out)

    # -- views the learner needs --------------------------------------------------------
    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def prompt_length(self) -> int:
        return int(self.prompt_ids.shape[1])

    @property
    def response_length(self) -> int:
        return int(self.response_ids.shape[1])

    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1).long()

    def position_ids(self) -> Tensor:
        """Positions count real tokens only, so left padding does not shift the prompt."""
        mask = self.attention_mask()
        return (mask.cumsum(dim=1) - 1).clamp(min=0)

    def select(self, rows: Tensor | slice | Sequence[int]) -> "RolloutBatch":
        """A sub-batch (mini- or micro-batch) with every per-row field sliced alike."""
        if not isinstance(rows, (slice, Tensor)):
            rows = torch.as_tensor(list(rows), dtype=torch.long)
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif f.name == "texts":
                if isinstance(rows, slice):
                    out[f.name] = v[rows]
                else:
                    out[f.name] = [v[int(i)] for i in rows.tolist()] if v else []
            else:
                out[f.name] = v[rows]
        return RolloutBatch(**out)

    def trimmed(self) -> "RolloutBatch":
        """This batch without the columns that are padding in every row (the left of the prompts,
        the right of the responses). A sub-batch keeps the whole batch's widths; its own are
        often much smaller (one long sample sets R for all 64 rows), and the learner's forward
        and backward cost grows with the width."""
        p = max(int(self.prompt_mask.sum(dim=1).max()) if len(self) else 0, 1)
        r = max(int(self.response_mask.sum(dim=1).max()) if len(self) else 0, 1)
        if p >= self.prompt_length and r >= self.response_length:
            return self
        cut_p, cut_r = slice(self.prompt_length - min(p, self.prompt_length), None), slice(0, r)
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("prompt_ids", "prompt_mask"):
                v = v[:, cut_p]
            elif isinstance(v, Tensor) and v.dim() == 2:  # every other 2-D field is [N, R]
                v = v[:, cut_r]
            out[f.name] = v
        return RolloutBatch(**out)

    def with_(self, **changes: Any) -> "RolloutBatch":
        return replace(self, **changes)

    # -- statistics -----------------------------------------------------------------------
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(dim=1)

    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())


def _pad_left(t: Tensor, length: int, fill: Any) -> Tensor:
    if t.shape[1] == length:
        return t
    pad = torch.full((t.shape[0], length - t.shape[1]), fill, dtype=t.dtype)
    return torch.cat([pad, t], dim=1)


def _pad_right(t: Tensor, length: int, fill: Any) -> Tensor:
    if t.shape[1] == length:
        return t
    pad = torch.full((t.shape[0], length - t.shape[1]), fill, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)
