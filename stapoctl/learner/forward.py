"""The learner's forward passes over a batch's response tokens: entropy, log-prob and Σp² per token
(`losses.token_stats`), through the padded, shared-prefix or packed forward; the no-grad
measuring pass and `compute_log_probs` (the old log-probs and the sync canary)."""

from __future__ import annotations


class PolicyForward:
    """Mixin of the learner actor; needs the attributes `EngineSetup.reset` sets."""

    def _token_stats(self, mb, model=None, entropy_grad: bool = False):
        """(entropy, log_prob, sum_p2) [n, R] of the response tokens; log_prob carries grads
        (entropy too with `entropy_grad`, for the entropy bonus). `model`: another model than the
        policy's (the frozen reference), run whole even under ZeRO-3.

        The forward runs on the micro-batch's own widths (`RolloutBatch.trimmed`); the results
        are padded back to the batch's R with zeros, on positions every loss masks out. Not under
        ZeRO-3: there a STAPO update over several mini-batches drifted from the untrimmed one
        (pg_loss of the later mini-batches ~5% off in tests/test_learner_ranks.py, although each
        micro-batch's statistics and a single optimizer step matched exactly); cause not found."""
        import torch

        full_r = mb.response_length
        if self.zero_stage != 3:
            mb = mb.trimmed()
        stats = self._token_stats_on(mb, model, entropy_grad)
        if mb.response_length == full_r:
            return stats
        return tuple(torch.nn.functional.pad(t, (0, full_r - mb.response_length)) for t in stats)

    def _token_stats_on(self, mb, model=None, entropy_grad: bool = False):
        import torch

        from stapoctl.learner import packing, shared_prefix
        from stapoctl.losses import token_stats

        input_ids = mb.input_ids().to(self.device)
        attn = mb.attention_mask().to(self.device)
        pos = mb.position_ids().to(self.device)
        p, r = mb.prompt_length, mb.response_length
        labels = torch.where(mb.response_mask, mb.response_ids, -100).to(self.device)
        chunk = int(self.learner.get("logits_chunk_size") or 1024)
        grad = {"entropy_grad": True} if entropy_grad else {}
        if self.zero_stage == 3 and model is None:
            # Partitioned weights: go through the module (its hooks gather the shards). The input is
            # exactly prompt + response (never trimmed or packed here), so its last r + 1 positions
            # hold the r predicting the response: `logits_to_keep` computes only those (the last
            # one is dropped), not a [B, P, V] of prompt logits (and their gradient) thrown away.
            keep = {"logits_to_keep": r + 1} if _keeps_logits(self.module) else {}
            logits = self.engine(input_ids=input_ids, attention_mask=attn, position_ids=pos, **keep).logits
            first = logits.shape[1] - (r + 1)  # p - 1 without logits_to_keep
            return token_stats(logits[:, first : first + r], labels, chunk_size=chunk, temperature=self.temperature,
                               top_p=self.top_p, return_sum_p2=True, **grad)
        model = self.module if model is None else model
        share = shared_prefix.enabled(self.learner, self.device.type == "cuda")
        if packing.enabled(self.learner):
            stats = packing.packed_token_stats(model, mb, self.device, share, chunk_size=chunk,
                                               temperature=self.temperature, top_p=self.top_p,
                                               return_sum_p2=True, **grad)
            if stats is not None:
                return stats
            share = False  # no response token in the micro-batch: the plain forward below
        decoder = model.get_decoder()
        hidden = None
        if share:
            hidden = shared_prefix.shared_prefix_hidden(decoder, input_ids, attn, pos, p, r)
        if hidden is None:
            hidden = decoder(input_ids=input_ids, attention_mask=attn, position_ids=pos)
            hidden = hidden.last_hidden_state[:, p - 1 : p + r - 1]
        return token_stats(hidden, labels, lm_head_weight=model.get_output_embeddings().weight, chunk_size=chunk,
                           temperature=self.temperature, top_p=self.top_p, return_sum_p2=True, **grad)

    def _no_grad_pass(self, batch, rows: slice, model=None):
        """Entropy, log-prob and sum p² of batch[rows] in row order, micro-batch by micro-batch
        (under a token budget cut by `learner.log_prob_max_tokens_per_micro_batch`), no grad
        (`model`: the frozen reference instead of the policy)."""
        import torch

        sub = batch.select(rows)
        out = torch.zeros(3, len(sub), sub.response_length)
        self.module.eval()  # no dropout in a measurement (Qwen3 has none; other models may)
        try:
            with torch.no_grad():
                for mb in self._no_grad_micro_batches(sub):
                    for k, t in enumerate(self._token_stats(sub.select(mb), model=model)):
                        out[k, mb] = t.float().cpu()
        finally:
            self.module.train()
        return out[0], out[1], out[2]

    def compute_log_probs(self, batch, raw: bool = False) -> dict:
        """Learner log-probs and entropies of every response token (0 on padding), all ranks' rows, under
        the rollout's sampling distribution; `raw`: under the model's own (T = 1, no top-p), as vLLM's
        prompt log-probs are (the doctor's weight-sync row)."""
        import torch

        mine = self._my_rows(len(batch))
        sampling = self.temperature, self.top_p
        if raw:
            self.temperature, self.top_p = 1.0, 1.0
        try:
            ent, lp, p2 = self._no_grad_pass(batch, mine)
        finally:
            self.temperature, self.top_p = sampling
        mask = batch.response_mask[mine]
        ent, lp, p2 = (torch.where(mask, t, 0.0) for t in (ent, lp, p2))
        ent, lp, p2 = (self._all_gather_rows(t) for t in (ent, lp, p2))
        return {"log_prob": lp, "entropy": ent, "sum_p2": p2}


def _keeps_logits(module) -> bool:
    """The model's forward takes transformers' `logits_to_keep` (its causal LMs do; a remote-code
    model may not, and then computes every position's logits)."""
    import inspect

    return "logits_to_keep" in inspect.signature(module.forward).parameters
