"""TRL's side of `learner_budget`: GRPOTrainer's update of one fixed batch, as TRL runs it.

TRL (1.16) pads a generation batch's completions to its longest and its prompts to the longest on
the left, then splits it into micro-batches of `per_device_train_batch_size` rows; each runs
`GRPOTrainer._compute_loss` (its forward over prompt + completion, the clipped objective, TRL's
`loss_type="dapo"`: token mean over the accumulation window) and a backward; one optimizer step
follows. Here those tensors are built from the same `RolloutBatch` stapoctl's learners update (same
token ids, masks, advantages) and the same calls run, without TRL's generation and scoring (as the
stapoctl side times its update only). On-policy (num_iterations 1, one step per generation), so TRL
keeps no old log-probs and runs no pass before the update; stapoctl's update does run one (its
no-grad pass for the mini-batch's loss statistics), part of what its side is timed for.
"""

from __future__ import annotations

import tempfile
import time


def make_trainer(model_dir: str, rows: int, n: int, micro: int, max_completion: int):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-budget-"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro, num_generations=n,
        max_completion_length=max_completion, learning_rate=0.0, beta=0.0, loss_type="dapo",
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_list([{"prompt": "x"}] * rows)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                          args=args, train_dataset=data, processing_class=tok)
    trainer.create_optimizer()
    return trainer


def micro_batches(batch, micro: int) -> list[dict]:
    """TRL's buffered inputs for `batch`: prompts left-padded and completions right-padded to the
    whole batch's longest, in micro-batches of `micro` rows."""
    import torch

    p = int(batch.prompt_mask.sum(1).max())
    r = int(batch.response_mask.sum(1).max())
    full = {"prompt_ids": batch.prompt_ids[:, -p:], "prompt_mask": batch.prompt_mask[:, -p:].long(),
            "completion_ids": batch.response_ids[:, :r], "completion_mask": batch.response_mask[:, :r].long(),
            "advantages": batch.advantages.float()}
    tokens = torch.tensor(float(batch.response_mask.sum()))
    return [{**{k: v[s:s + micro] for k, v in full.items()}, "num_items_in_batch": tokens}
            for s in range(0, len(batch), micro)]


def update(trainer, inputs: list[dict]) -> dict:
    """One update as TRL's training loop makes it: forward + backward per micro-batch (the loss
    divided by the accumulation steps, as `_compute_loss` does in train mode), clip, one step."""
    import torch

    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = len(inputs)  # what Trainer's loop sets per window
    t0 = time.perf_counter()
    total = 0.0
    for inp in inputs:
        loss = trainer._compute_loss(model, inp)
        loss.backward()
        total += float(loss)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm))
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return {"seconds": time.perf_counter() - t0, "loss": total, "grad_norm": norm,
            "padded_tokens": sum(int(i["prompt_ids"].numel() + i["completion_ids"].numel()) for i in inputs)}
