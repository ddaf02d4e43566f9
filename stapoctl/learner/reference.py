"""The frozen reference policy of the KL term (`loss.kl_coef > 0`): a copy of the run's initial
policy on each learner rank, evaluated without gradients over the batch before the update.

On the learner's ranks rather than as an actor of its own: it reuses the rank's process, device,
micro-batching, trimming, shared-prefix forward and all-gather, costs no second process group or
object-store transfer of the batch, and its forward sits between the old-log-prob pass and the
update where the rank is idle anyway. Its price is one more copy of the weights per rank (no
gradients, no optimizer states): `stapoctl train --cfg job` prints it. verl colocates its
reference the same way (the `ref` role of the actor-rollout-ref worker).

The reference is the *initial* policy (the base model), also when a run resumes from a
checkpoint: the trainer passes its path separately from the policy's.
"""

from __future__ import annotations

from typing import Any, Optional


def needs_reference(loss: Any) -> bool:
    """A KL term to a reference: `kl_coef > 0` for every loss (tr_grpo's own form included); `loss`
    is the rank's typed loss config."""
    return float(getattr(loss, "kl_coef", 0.0) or 0.0) > 0.0


class ReferencePolicy:
    """Mixin of the learner actor: `load_reference` in `reset`, `reference_log_probs` per step."""

    reference = None

    def load_reference(self, path: Optional[str], *, bf16: bool) -> None:
        """Load (or drop, when the loss has no KL term) the frozen copy; in the policy's dtype."""
        import torch
        from transformers import AutoModelForCausalLM

        from stapoctl.learner import packing

        self.reference = None
        if path is None or not needs_reference(self.loss_config):
            return
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32)
        ref.config.use_cache = False
        if packing.enabled(self.learner):
            packing.use_packed_attention(ref)
        ref.requires_grad_(False)
        self.reference = ref.to(self.device).eval()

    def reference_log_probs(self, batch):
        """log π_ref of every response token (0 on padding), all ranks' rows, like
        `compute_log_probs` but through the reference's weights."""
        import torch

        mine = self._my_rows(len(batch))
        _, lp, _ = self._no_grad_pass(batch, mine, model=self.reference)
        return self._all_gather_rows(torch.where(batch.response_mask[mine], lp, 0.0))
