"""One training step of a data-parallel rank: recompute old log-probs, then PPO mini-batch updates
(the forward passes are `forward.py`, the rank arithmetic `data_parallel.py`).

π and H for the STAPO mask come from the learner's own forward pass over the mini-batch (000
Alg. 1 line 8): for the first mini-batch of a step the recompute pass *is* that pass (same
weights); later mini-batches get a no-grad pass first when they span several micro-batches,
and reuse the gradient pass's own detached values when they are a single micro-batch on one rank.

Data parallel: every rank owns an equal slice of each mini-batch. The mini-batch statistics the
loss needs (h*, the token-mean denominator, group normalisers) are computed over the *whole*
mini-batch (all ranks' rows, all-gathered), so N ranks give the update 1 rank gives.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

from stapoctl.learner.metric_accumulator import MetricAccumulator
from stapoctl.learner.step_result import StepResult


class PPOStep:
    """Mixin of the learner actor; needs the attributes `EngineSetup.reset` sets."""

    # -- the step -------------------------------------------------------------------------
    def train_step(self, batch, global_step: int, old_logprob_source: str = "recompute", *, measure: bool = True,
                   behavior: bool = False) -> StepResult:
        """Old log-probs (and the reference's, with a KL term), then PPO updates over mini-batches;
        returns the metrics and, for the driver, the measured log-probs and entropies (rank 0).

        old_logprob_source: "recompute" (a no-grad pass of the learner, verl style) or "rollout"
        (vLLM's own log-probs of the sampling distribution, equal to the learner's in fp32: the pass is skipped).
        measure: run the no-grad pass anyway, for the sync canary (the driver's p99 of |Δ log p|) and
        the token diagnostics (the driver asks for it on the first step and periodically).
        behavior: the batch was sampled by older weights than the learner's (asynchronous
        training). The loss then gets vLLM's log-probs as the behaviour policy's, and so does
        every recomputed batch under an explicit `loss.rollout_correction` (`corrects`).
        """
        import torch

        t0 = time.perf_counter()
        stats = self.compute_log_probs(batch) if (old_logprob_source == "recompute" or measure) else None
        t_ref = time.perf_counter() - t0
        old = stats["log_prob"] if old_logprob_source == "recompute" else batch.rollout_log_probs
        batch = batch.with_(old_log_probs=old, entropy=stats["entropy"] if stats else None)
        t_policy = time.perf_counter()
        if self.reference is not None:
            batch = batch.with_(ref_log_probs=self.reference_log_probs(batch))
        t_policy = time.perf_counter() - t_policy
        t1 = time.perf_counter()
        behavior = behavior or corrects(self.loss_config, old_logprob_source)
        metrics = self._update(batch, global_step, first_pass=stats, behavior=behavior)
        t_update = time.perf_counter() - t1
        rmask = batch.response_mask
        metrics.update({
            "timing_s/ref": t_ref,
            "timing_s/update": t_update,
            "perf/train_tokens_per_s": float(rmask.sum()) / max(t_ref + t_update, 1e-9),
        })
        if self.reference is not None:
            metrics["timing_s/ref_policy"] = t_policy
        if stats is None:
            return StepResult(metrics)
        diff = torch.where(rmask, (stats["log_prob"] - batch.rollout_log_probs).abs(), 0.0)
        metrics["rollout/logprob_diff_max"] = float(diff.max()) if rmask.any() else 0.0
        metrics["rollout/logprob_diff_mean"] = float(diff.sum() / rmask.sum().clamp(min=1))
        # in fp32 a token past float noise is one whose top-p kept set differs on the two sides (or wrong weights)
        metrics["rollout/logprob_diff_frac_above_1e-4"] = float((diff > 1e-4).sum() / rmask.sum().clamp(min=1))
        return StepResult(metrics, old_log_probs=stats["log_prob"], entropy=stats["entropy"],
                          logprob_diff_rows=diff.max(dim=1).values)  # per row: which worker drifted

    def _update(self, batch, global_step: int, first_pass: Optional[dict], *, behavior: bool = False) -> dict:
        """`ppo_epochs` passes over the batch, one optimizer step per mini-batch."""
        acc = MetricAccumulator(self._all_gather_objects)
        epochs = int(self.learner.get("ppo_epochs") or 1)
        n_rows = len(batch)
        self.micro_batches_run = 0
        updated = False
        grad_norms = []
        for _ in range(epochs):
            for start in range(0, n_rows, self.mini_rows):
                mini_sl = slice(start, min(start + self.mini_rows, n_rows))
                measured = None if updated else first_pass  # after an update the weights have moved on
                grad_norms.append(self._update_minibatch(batch, mini_sl, global_step, measured, acc,
                                                         behavior=behavior))
                updated = True
        return self._step_metrics(acc, grad_norms)

    def _update_minibatch(self, batch, mini_sl: slice, global_step: int, first_pass: Optional[dict],
                          acc: MetricAccumulator, *, behavior: bool) -> float:
        """One optimizer step on batch[mini_sl]: this rank's rows, micro-batch by micro-batch,
        accumulated into a single update (the boundary set at the last, however many there are).
        Returns its grad norm."""
        mini = batch.select(mini_sl)
        mine = self._my_rows(len(mini))
        micro_rows, count = self._update_micro_batches(mini, mine)
        single = count == 1 and self.world_size == 1
        extras = {"group_ids": mini.group_ids, "global_step": int(global_step)}
        if self.max_response_length:
            extras["max_response_length"] = int(self.max_response_length)
        extras.update(_policy_inputs(mini, behavior))
        ent, context = self._minibatch_context(mini, mini_sl, mine, extras, first_pass, single)
        for k in range(count):
            self._set_boundary(k == count - 1)
            if k < len(micro_rows):
                rows = micro_rows[k]
                loss, m, context = self._micro_loss(mini.select(rows), rows, ent, context, extras, behavior=behavior)
                acc.add(m)
            else:  # another rank has more micro-batches: join its gradient reductions, adding nothing
                loss = self._zero_weight_loss(mini.select(micro_rows[-1][:1]))
            boundary_norm = self._backward(loss, boundary=k == count - 1)
        self.micro_batches_run += count
        norm = self._optimizer_step(boundary_norm)
        acc.end_minibatch()
        return norm

    def _minibatch_context(self, mini, mini_sl: slice, mine: slice, extras: dict, first_pass: Optional[dict],
                           single: bool):
        """(entropy, loss context) of the whole mini-batch, all ranks' rows, at the current weights:
        the loss's mini-batch statistics must not depend on how the rows are split. (None, None)
        when the single gradient pass can supply both."""
        from stapoctl.losses import prepare_minibatch

        if first_pass is not None:  # the measuring pass ran at these weights
            ent, lp, p2 = (first_pass[k][mini_sl] for k in ("entropy", "log_prob", "sum_p2"))
        elif single:
            return None, None  # taken from the gradient pass below
        else:
            ent, lp, p2 = self._no_grad_pass(mini, mine)
            ent, lp, p2 = (self._all_gather_rows(t) for t in (ent, lp, p2))
        context = prepare_minibatch(self.loss_config, log_prob=lp, advantages=mini.advantages,
                                    response_mask=mini.response_mask, entropy=ent,
                                    old_log_prob=mini.old_log_probs, sum_p2=p2, **extras)
        return ent, context

    def _micro_loss(self, mb, rows: slice, ent, context, extras: dict, *, behavior: bool):
        """The gradient forward of one micro-batch (mini-batch rows `rows`) and its loss.
        Returns (loss, metrics, context): the context is built here when none was passed in."""
        from stapoctl.losses import compute_policy_loss, prepare_minibatch, slice_context

        cfg = self.loss_config  # built once at set-up/reset: no config per micro-batch
        bonus = float(getattr(cfg, "entropy_coef", 0.0) or 0.0) != 0  # the entropy term (either sign) needs ∇H
        ent_g, lp_g, p2_g = self._token_stats(mb, entropy_grad=bonus)
        mask = mb.response_mask.to(self.device)
        mb_extras = dict(extras, group_ids=mb.group_ids.to(self.device))
        mb_extras.update((k, v.to(self.device)) for k, v in _policy_inputs(mb, behavior).items())
        if context is None:
            context = prepare_minibatch(cfg, log_prob=lp_g.detach(),
                                        advantages=mb.advantages, response_mask=mask,
                                        entropy=ent_g.detach(), old_log_prob=mb.old_log_probs,
                                        sum_p2=p2_g, **mb_extras)
            ent_mb = ent_g
        else:
            ent_mb = ent_g if bonus else ent[rows].to(self.device)
        loss, m = compute_policy_loss(
            cfg,
            log_prob=lp_g,
            old_log_prob=mb.old_log_probs.to(self.device),
            advantages=_dev(mb.advantages, self.device),
            response_mask=mask,
            entropy=ent_mb,
            sum_p2=p2_g,
            **mb_extras,
            **slice_context(context, rows),
        )
        return loss, m, context

    def _step_metrics(self, acc: MetricAccumulator, grad_norms: list[float]) -> dict:
        """The step's metrics: the accumulated loss metrics plus the optimizer's."""
        out = acc.result()
        out["actor/grad_norm"] = float(sum(grad_norms) / max(len(grad_norms), 1))
        out["actor/lr"] = float(self.scheduler.get_last_lr()[0]) if self.scheduler else float(self.learner["lr"])
        out["actor/optimizer_steps"] = float(self.optimizer_steps)
        out["perf/update_micro_batches"] = float(self.micro_batches_run)  # per rank, this step
        return out

    def _backward(self, loss, boundary: bool) -> Optional[float]:
        """backward + engine.step(); at the accumulation boundary that step is the optimizer's.

        The loss library already normalises by the mini-batch (sum of micro losses = mini
        loss), so DeepSpeed must not divide by the accumulation steps; its allreduce
        averages over ranks, so each rank's share is scaled back up to a sum.
        """
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        norm = None
        if boundary and self.zero_stage == 0:
            # ZeRO-0 keeps no norm: measure it before the step (at the boundary the gradients are
            # already all-reduced, so every rank sees the global norm). In fp32 the learner clips
            # here too, with the norm it just took (`clips_itself`; DeepSpeed's clip is off).
            import torch

            params = [p for p in self.module.parameters() if p.grad is not None]
            total = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
            if params and self.clip:
                torch.nn.utils.clip_grads_with_norm_(params, self.clip, total)
            norm = float(total)
        self.engine.step()
        return norm

    def _optimizer_step(self, measured: Optional[float]) -> float:
        """The last micro-batch's `engine.step()` was the accumulation boundary: its grad norm."""
        self.optimizer_steps += 1
        norm = self.engine.get_global_grad_norm()
        if norm is None or not math.isfinite(float(norm)):
            norm = measured
        return float(norm) if norm is not None else float("nan")



def _dev(t, device):
    return t.to(device) if t is not None else None




def corrects(loss: Any, old_logprob_source: str) -> bool:
    """Whether the loss sees the behaviour policy's log-probs (vLLM's) on a batch that is not
    stale: under an explicit `loss.rollout_correction` every batch whose old log-probs are the
    learner's recompute is weighted by π_old/π_behav; under `off` the loss only measures it
    (`rollout_corr/*`); `auto` keeps it to stale async batches."""
    return str(getattr(loss, "rollout_correction", None) or "auto") != "auto" and old_logprob_source == "recompute"


def _policy_inputs(mb, behavior: bool) -> dict:
    """The loss's optional per-token inputs of these rows: the behaviour policy's log-probs
    (vLLM's, when the batch is corrected) and the frozen reference's (KL term)."""
    out = {}
    if behavior:
        out["behavior_log_prob"] = mb.rollout_log_probs
    if mb.ref_log_probs is not None:
        out["ref_log_prob"] = mb.ref_log_probs
    return out
