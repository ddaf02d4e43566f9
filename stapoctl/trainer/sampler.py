"""Which prompts each step trains on: a seeded permutation per epoch, so a run's batches are a
pure function of (seed, epoch, position) and a resumed run draws exactly the same ones."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # rows of this epoch's permutation already served


class PromptSampler:
    def __init__(self, num_rows: int, batch_size: int, *, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError("the training set is empty")
        self.num_rows, self.batch_size = int(num_rows), int(batch_size)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.state = SamplerState()
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            import torch

            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                self._perm = torch.randperm(self.num_rows, generator=g).tolist()
            else:
                self._perm = list(range(self.num_rows))
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> list[int]:
        """The next batch_size row indices, running into the next epoch when this one ends."""
        out: list[int] = []
        while len(out) < self.batch_size:
            perm = self._permutation(self.state.epoch)
            take = min(self.batch_size - len(out), self.num_rows - self.state.position)
            out.extend(perm[self.state.position : self.state.position + take])
            self.state.position += take
            if self.state.position >= self.num_rows:
                self.state = SamplerState(epoch=self.state.epoch + 1, position=0)
        return out

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = SamplerState(epoch=int(state["epoch"]), position=int(state["position"]))
