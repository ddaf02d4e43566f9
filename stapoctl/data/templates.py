"""How a problem becomes a prompt string: the STAPO instruction, wrapped by a chat template
or a plain one. Training data, the toy task and the benchmarks all go through here, so the
model sees the same framing in warm start, RL and evaluation."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from stapoctl.errors import UserError

TEMPLATES = ("chat", "plain")


def user_message(problem: str, instruction: str) -> str:
    """The problem, then the instruction on its own line (the DAPO/JustRL prompt layout)."""
    problem = problem.strip()
    return f"{problem}\n{instruction}" if instruction else problem


# tokenizer_config.json classes that *are* transformers' generic fast tokenizer (the embedded model's)
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


@lru_cache(maxsize=8)
def load_tokenizer(path: str):
    """A tokenizer from a local dir or an HF id (cached: prep renders thousands of rows)."""
    try:
        generic = generic_tokenizer(path)
        if generic is not None:
            return generic
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # OSError, ValueError, HF hub errors: all mean "cannot load it"
        raise UserError(
            f"model.path='{path}': cannot load its tokenizer for the chat template "
            f"({type(exc).__name__}); point model.path at a model dir/HF id or use --template plain"
        ) from exc


def generic_tokenizer(path: str):
    """The class AutoTokenizer resolves for a local dir saved as the generic fast tokenizer, loaded
    without AutoTokenizer's import, which pulls in every model config, `generation` and
    scikit-learn (~4 s of the driver's start-up on 2 cores). None for any other tokenizer."""
    import json

    folder = Path(path)
    config = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not config.is_file():
        return None
    try:
        name = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    if name not in GENERIC_TOKENIZER_CLASSES:
        return None
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def render_prompt(problem: str, *, template: str, instruction: str, tokenizer=None) -> str:
    """The exact prompt text handed to the engine (generation prompt included for chat)."""
    if template not in TEMPLATES:
        raise UserError(f"data.template='{template}': use chat or plain")
    content = user_message(problem, instruction)
    if template == "plain":
        return content + "\n"
    if tokenizer is None:
        raise UserError("data.template=chat needs a tokenizer: set model.path or use --template plain")
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "the tokenizer")
        raise UserError(
            f"{name} has no chat template: use --template plain (data.template=plain)"
        )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def tokenizer_for_template(template: str, tokenizer_path: str | Path | None):
    """The tokenizer a template needs (None for plain)."""
    if template == "plain":
        return None
    if tokenizer_path is None:
        raise UserError("data.template=chat needs a tokenizer: set model.path or use --template plain")
    return load_tokenizer(str(tokenizer_path))
