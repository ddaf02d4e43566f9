"""How a rank's rows are cut into micro-batches: a fixed row count, or a budget of padded tokens.

Fixed (`learner.max_tokens_per_micro_batch=0`, the default): consecutive runs of
`learner.micro_batch_size` rows. Every micro-batch is forwarded at its own trimmed widths, so one
long response makes its whole micro-batch long.

Token budget (`learner.max_tokens_per_micro_batch=B > 0`): the cost of a micro-batch is its padded
tokens, rows × (trimmed prompt width + trimmed response width), or with `learner.remove_padding`
(learner/packing.py) its packed tokens (a unit's shared prompt once). The units (rows; with the
shared-prefix forward on, the runs of rows of one prompt, so that the prompt is forwarded once per
micro-batch) are sorted by width, longest first, and cut into runs: a run's cost stays ≤ B and its
rows ≤ `learner.micro_batch_size` (then a cap); a unit that alone is over the budget gets a
micro-batch of its own. Of all such cuts the learner takes the one with the fewest micro-batches
(fewer, larger forwards keep a GPU busy) and among those the least padding — an exact dynamic
programme over the cut points, O(units × units in one micro-batch). A greedy fill of the same order left 10,639 padded tokens where this cut leaves
9,786 (docs/PERFORMANCE.md's batch: 8,316 real, 12,992 in fixed micro-batches). verl balances its
dynamic micro-batches with Karmarkar-Karp over the sum of real tokens (`seqlen_balancing.py`)
because its forward has no padding; a padded forward is what grouping by length pays off for. The
cut depends on nothing but the batch's masks and group ids (ties keep row order), so the same batch
gives the same micro-batches and a resumed run recomputes the same update.

The loss does not see the cut: the token-mean denominators, STAPO's h* and every group statistic are
mini-batch statistics (`prepare_minibatch`), so the micro-batch losses add up to the mini-batch's.
What the cut must keep right around the loss is in `MicroBatching`: one optimizer step per
mini-batch whatever the number of micro-batches (the accumulation boundary is set explicitly), and
the same number of micro-batches on every rank (ZeRO-2 reduces gradients at every backward, so a
rank with fewer runs zero-weight micro-batches until the counts agree).
"""

from __future__ import annotations

from collections.abc import Sequence

from stapoctl.learner import packing


def fixed(rows: int, micro: int) -> list[slice]:
    return [slice(s, min(s + micro, rows)) for s in range(0, rows, micro)]


def units_of(group_ids: Sequence[int], together: bool, max_rows: int = 0) -> list[list[int]]:
    """The rows that stay in one micro-batch: each row alone, or (`together`) each run of consecutive
    rows of one prompt, split into pieces of at most `max_rows` rows when a cap is given."""
    if not together:
        return [[i] for i in range(len(group_ids))]
    units: list[list[int]] = []
    for i, g in enumerate(group_ids):
        if units and group_ids[units[-1][-1]] == g and (not max_rows or len(units[-1]) < max_rows):
            units[-1].append(i)
        else:
            units.append([i])
    return units


def token_budget(prompt_lens: Sequence[int], response_lens: Sequence[int], units: list[list[int]], *,
                 budget: int, max_rows: int = 0, packed: bool = False) -> list[list[int]]:
    """Micro-batches (each a sorted list of row indices) of at most `budget` tokens (padded, or
    `packed`: as learner/packing.py forwards them) and `max_rows` rows (0 = no row cap); every row in exactly one. The fewest
    micro-batches that runs of the length-sorted units allow, and among those the least padding
    (see the module's docstring)."""
    def width(u: list[int]) -> tuple[int, int, int]:  # packed, a unit's rows share one prompt
        p, r = [prompt_lens[i] for i in u], [response_lens[i] for i in u]
        return max(p), max(r), packing.packed_tokens(p, r, groups=[0] * len(u))

    w = [width(u) for u in units]
    order = sorted(range(len(units)), key=lambda k: (-(w[k][0] + w[k][1]), units[k][0]))
    best: list[tuple[int, int]] = [(0, 0)] + [(len(order) + 1, 0)] * len(order)  # (micro-batches, tokens)
    cut_at = [0] * (len(order) + 1)
    for i in range(len(order)):  # best[j]: the first j units; a run i..j-1 grows until over a limit
        p = r = rows = real = 0
        for j in range(i, len(order)):
            k = order[j]
            p, r, rows, real = max(p, w[k][0]), max(r, w[k][1]), rows + len(units[k]), real + w[k][2]
            cost = real if packed else rows * (p + r)
            if j > i and (cost > budget or (max_rows and rows > max_rows)):
                break
            if (best[i][0] + 1, best[i][1] + cost) < best[j + 1]:
                best[j + 1], cut_at[j + 1] = (best[i][0] + 1, best[i][1] + cost), i
    out, j = [], len(order)
    while j:
        out.append(sorted(x for k in order[cut_at[j]:j] for x in units[k]))
        j = cut_at[j]
    return out[::-1]


def padded_tokens(prompt_lens: Sequence[int], response_lens: Sequence[int], micro: list) -> int:
    """What the padded forward of these micro-batches costs in tokens: Σ rows × (prompt + response width)."""
    total = 0
    for mb in micro:
        idx = range(len(prompt_lens))[mb] if isinstance(mb, slice) else mb
        if len(idx):
            total += len(idx) * (max(prompt_lens[i] for i in idx) + max(response_lens[i] for i in idx))
    return total


def budgets(learner: dict) -> tuple[int, int]:
    """(update budget, log-prob budget) in tokens; 0 = fixed micro-batches. The log-prob and
    reference passes keep no activations for backward: twice the update's budget by default."""
    update = int(learner.get("max_tokens_per_micro_batch") or 0)
    log_prob = int(learner.get("log_prob_max_tokens_per_micro_batch") or 0) or 2 * update
    return update, log_prob


class MicroBatching:
    """Mixin of the learner actor: the micro-batches of the update and of the no-grad passes."""

    def _together(self) -> bool:
        from stapoctl.learner import shared_prefix

        return shared_prefix.enabled(self.learner, self.device.type == "cuda")

    def _cut(self, sub, budget: int, max_rows: int) -> list:
        """Micro-batches of the rows of `sub` (indices into it): slices when fixed, else index lists."""
        if not budget:
            return fixed(len(sub), max_rows)
        lens_p = sub.prompt_mask.sum(dim=1).tolist()
        lens_r = sub.response_mask.sum(dim=1).tolist()
        units = units_of(sub.group_ids.tolist(), self._together(), max_rows)
        return token_budget(lens_p, lens_r, units, budget=budget, max_rows=max_rows,
                            packed=packing.enabled(self.learner))

    def _update_micro_batches(self, mini, mine: slice) -> tuple[list, int]:
        """This rank's micro-batches of the mini-batch (absolute mini-batch rows: slices when fixed,
        index tensors under a budget) and the number every rank runs (the largest rank's)."""
        import torch

        budget, _ = budgets(self.learner)
        cut = self._cut(mini.select(mine), budget, self.micro)
        if not budget:
            return [slice(mine.start + s.start, mine.start + s.stop) for s in cut], len(cut)
        rows = [torch.as_tensor(mb, dtype=torch.long) + mine.start for mb in cut]
        return rows, max(self._all_gather_objects(len(rows)))

    def _no_grad_micro_batches(self, sub) -> list:
        budget, log_prob = budgets(self.learner)
        return self._cut(sub, log_prob if budget else 0, self.micro if not budget else 0)

    def _zero_weight_loss(self, mb):
        """A micro-batch whose gradient is zero: a rank with fewer micro-batches than another runs it
        so that every rank joins every backward's gradient reduction (ZeRO-2) the same number of times."""
        _, lp, _ = self._token_stats(mb)
        return lp.sum() * 0.0

    def _set_boundary(self, boundary: bool) -> None:
        """The optimizer steps at the end of each mini-batch, not after DeepSpeed's fixed count of
        micro-batches (`gradient_accumulation_steps` in its config)."""
        self.engine.set_gradient_accumulation_boundary(bool(boundary))

