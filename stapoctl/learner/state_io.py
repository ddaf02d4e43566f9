"""What leaves or enters a learner rank besides a batch: weights for the rollout workers
(full tensors, gathered from ZeRO-3 shards) and checkpoints (DeepSpeed state + an HF model dir).

Gathering ZeRO-3 parameters is a collective: every rank must enter it, even though only
rank 0 keeps the result. The driver therefore calls these methods on every rank.
"""

from __future__ import annotations

import time
from typing import Any, Sequence


class StateIO:
    """Mixin of the learner actor; needs the attributes `EngineSetup.reset` sets."""

    def weights(self) -> list:
        """(name, raw bytes, dtype, shape) of the full model for the rollout workers (rank 0's).

        The bytes are numpy views (`raw_views`); a torch tensor would go through torch's own
        pickling instead (25M fp32: put 0.14 s, read 0.02-0.09 s, against 0.05 s and 0.003 s).
        No copy is made here: Ray serialises a return value before the actor runs its next
        call. Under ZeRO-3 the gathered parameters are released when the block ends, so their
        bytes are copied out first."""
        from stapoctl.sync.source import gathered_one
        from stapoctl.sync.worker_extension import raw_views

        out = []
        for k, p in self.module.state_dict(keep_vars=True).items():  # ZeRO-3: one parameter gathered at a time
            with gathered_one(p, self.zero_stage):
                if self.rank == 0:
                    out += raw_views([(k, p.detach().to("cpu", copy=True) if self.zero_stage == 3 else p.detach())])
        return out

    def full_state_dict(self) -> dict:
        """name → full CPU tensor, tied weights under both names (None on ranks > 0 under ZeRO-3).

        Under ZeRO-3, DeepSpeed's own consolidation (what Accelerate and transformers' Trainer save
        with): one module's parameters gathered at a time onto rank 0's CPU, never the whole model on
        a GPU (which is out of memory from ~14B on 4 ranks). A collective: every rank calls it."""
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
            return dict(state) if state is not None else None
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def init_weight_transfer(self, method: str, rollout_handles: Sequence[Any], tp_size: int = 1,
                             timeout_s: float = 1800.0) -> None:
        """Open the registered transport's link to the vLLM workers (`sync.transports`). The link
        reads the rank's module at each push (`module_of`): a sweep's `reset` replaces it. No port is
        picked here: a linked transport's store listens on one the OS gives it before the workers are
        told (`CollectiveTrainer.listen`), so none can be taken in between."""
        from stapoctl.learner.engine_setup import node_ip
        from stapoctl.sync.trainer_engines import TrainerLink, build_trainer_engine

        self.transfer = build_trainer_engine(method, TrainerLink(
            module_of=lambda: self.module, zero_stage=int(self.zero_stage), rollout_handles=rollout_handles,
            rank=self.rank, master_address=node_ip(), master_port=0, tp_size=int(tp_size),
            timeout_s=float(timeout_s)))

    def transfer_update_info(self) -> dict:
        """Names, dtypes and shapes of what a push sends (fixed for the link's life)."""
        return self.transfer.update_info()

    def send_weights(self) -> float:
        """Every rank: the transfer iterates the weights (under ZeRO-3 each parameter is gathered
        alone, a collective); rank 0 sends them."""
        t0 = time.perf_counter()
        self.transfer.send_weights()
        return time.perf_counter() - t0

    def perturb_weights(self, scale: float, seed: int = 0, relative: bool = False) -> None:
        """Add seeded noise to every weight (tests, doctor: make the learner differ from vLLM); with
        `relative`, `scale` × each tensor's own std (a model keeps its structure at any size)."""
        import torch

        from stapoctl.sync.source import gathered_one

        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.module.parameters():  # ZeRO-3: one parameter gathered at a time, rank 0's change kept
                with gathered_one(p, self.zero_stage, modifier_rank=0):
                    noise = torch.randn(tuple(p.shape), generator=g, dtype=torch.float32).to(p) * scale
                    p.add_(noise * p.float().std().to(p) if relative and p.numel() > 1 else noise)

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, step_dir: str, tokenizer_dir: str) -> dict:
        """HF model dir (loadable by vLLM and eval) + DeepSpeed state (optimizer, scheduler, RNG).

        A full disk raises a plain `OSError` ENOSPC / EDQUOT naming the dir (torch's writer
        reports it as an "iostream error" without the errno), which the driver recognises."""
        import gc
        import traceback

        from stapoctl.checkpoint import disk_full

        try:
            return self._write_checkpoint(step_dir, tokenizer_dir)
        except Exception as exc:
            full = disk_full(exc, step_dir)
            if full is None:
                raise
            failed: Any = exc
            while failed is not None:  # the failed writer's open file keeps its bytes on the disk
                traceback.clear_frames(failed.__traceback__)
                failed = failed.__context__
        gc.collect()
        raise full

    def _write_checkpoint(self, step_dir: str, tokenizer_dir: str) -> dict:
        from pathlib import Path

        import torch
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        out = Path(step_dir)
        self.engine.save_checkpoint(str(out / "state"), tag="ds",
                                    client_state={"optimizer_steps": self.optimizer_steps,
                                                  "torch_rng": torch.get_rng_state()})
        state = self.full_state_dict() if self.zero_stage == 3 or self.rank == 0 else None  # ZeRO-3: every rank joins
        if self.rank == 0:
            self.module.save_pretrained(str(out / "model"), state_dict=state, safe_serialization=True)
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(str(out / "model"))
        return {"save_s": time.perf_counter() - t0}

    def load(self, step_dir: str) -> dict:
        from pathlib import Path

        import torch

        _, client = self.engine.load_checkpoint(str(Path(step_dir) / "state"), tag="ds",
                                                load_optimizer_states=True, load_lr_scheduler_states=True)
        client = client or {}
        self.optimizer_steps = int(client.get("optimizer_steps", 0))
        if "torch_rng" in client:
            torch.set_rng_state(client["torch_rng"])
        return {"optimizer_steps": self.optimizer_steps}
