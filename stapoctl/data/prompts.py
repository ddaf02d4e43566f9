"""A training run's prompts: its dataset rows, and their token ids from the caller's tokenizer.

The caller (the trainer) resolves the model and passes its tokenizer, or the tokenizer's path
for templating, so this layer never loads models itself.
"""

from __future__ import annotations

from omegaconf import DictConfig
from rich.console import Console

from stapoctl.errors import UserError

TRAIN_DATA = {"toy": "toy-train"}  # data.name → the registry's training split


def load_rows(name: str, conf: DictConfig, tokenizer_path: str) -> list[dict]:
    from stapoctl.data.registry import load_rows as registry_load

    return registry_load(name, conf.data, tokenizer_path=tokenizer_path)


def tokenize_prompts(rows: list[dict], tokenizer, max_len: int, what: str, console: Console) -> tuple[list, list]:
    """Token ids of every prompt, once; over-long prompts are dropped (verl does the same)."""
    ids = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    kept = [(i, r) for i, r in zip(ids, rows) if len(i) <= max_len]
    if not kept:
        raise UserError(
            f"every {what} prompt is longer than data.max_prompt_length={max_len} tokens: raise it"
        )
    if len(kept) < len(rows):
        console.print(f"[yellow]{len(rows) - len(kept)} of {len(rows)} {what} prompts exceed "
                      f"data.max_prompt_length={max_len} tokens and are skipped[/]")
    return [k[0] for k in kept], [k[1] for k in kept]
