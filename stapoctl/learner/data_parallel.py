"""Data parallel over learner ranks: which rows a rank owns, and gathering rows and objects from
every rank (the loss's mini-batch statistics are taken over all ranks' rows)."""

from __future__ import annotations


class DataParallel:
    """Mixin of the learner actor; needs `rank`, `world_size` and `device`."""

    def _my_rows(self, n_rows: int) -> slice:
        if self.world_size == 1:
            return slice(0, n_rows)
        per = n_rows // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)

    def _all_gather_rows(self, t):
        if self.world_size == 1:
            return t
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(t).to(self.device) for _ in range(self.world_size)]
        dist.all_gather(parts, t.to(self.device))
        return torch.cat([p.cpu() for p in parts])

    def _all_gather_objects(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out
