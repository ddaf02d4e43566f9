"""The model a run loads: a causal LM with weights, a tokenizer, a chat template when asked for,
and a context that holds prompt + response; a run id looked up in a store that exists."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from stapoctl.config.validate import check_context
from stapoctl.errors import UserError


def check_model(conf: DictConfig, spec: str, key: str, *, context_key: Optional[str] = None) -> None:
    """A local model dir (or run / checkpoint): a causal LM with weights, a tokenizer, a chat
    template when data.template=chat, and room for prompt + response in its context."""
    from stapoctl.models.resolve import resolve_model

    check_store_exists(spec, conf, key)
    path = Path(resolve_model(spec, conf))  # one line for a missing path or an unknown run id
    if not path.is_dir():
        return  # an HF hub id: checked when it is downloaded
    config = _read_json(path / "config.json", key)
    if not _is_causal_lm(path, config):
        kind = ", ".join(config.get("architectures") or []) or config.get("model_type") or "unknown"
        raise UserError(
            f"{key}={spec}: not a causal language model ({kind} in config.json): give a causal LM, "
            "e.g. Qwen/Qwen3-8B-Base or a stapoctl checkpoint"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise UserError(f"{key}={spec}: {path} has config.json but no weights (*.safetensors or *.bin)")
    tokenizer = _load_tokenizer(path, key, spec)
    if conf.data.template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{key}={spec}: its tokenizer has no chat template and data.template=chat: set data.template=plain "
            "(base models) or add a chat template to tokenizer_config.json"
        )
    context = config.get("max_position_embeddings")
    if context_key and context:
        check_context(conf, int(context), f"max_position_embeddings in {path / 'config.json'}")


def _read_json(path: Path, key: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}: cannot read {path} ({type(exc).__name__}): is it a model dir?") from None


def _is_causal_lm(path: Path, config: dict) -> bool:
    """The architectures config.json names (or, without any, its model_type) include a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = [str(a) for a in config.get("architectures") or []]
    if architectures:  # e.g. BertModel is not one, although model_type bert has a causal head class
        return any(a in causal or a.endswith("ForCausalLM") for a in architectures)
    return config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _load_tokenizer(path: Path, key: str, spec: str):
    from stapoctl.data.templates import load_tokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).is_file() for n in names):
        raise UserError(
            f"{key}={spec}: no tokenizer in {path} (none of {', '.join(names)}): save it beside the weights "
            "(tokenizer.save_pretrained(dir))"
        )
    try:
        return load_tokenizer(str(path))
    except UserError:
        raise UserError(f"{key}={spec}: the tokenizer files in {path} do not load: re-save the tokenizer there") from None



_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def check_store_exists(spec: str, conf: DictConfig, key: str) -> None:
    """A run id looked up in a sqlite store that does not exist: say so instead of creating it."""
    if not _RUN_ID.match(spec.strip()) or Path(spec).expanduser().exists():
        return
    from stapoctl.tracking.mlflow_run import tracking_uri

    uri = tracking_uri(conf.tracking.uri)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise UserError(
            f"{key}={spec}: no such run, the MLflow store {uri} does not exist; set tracking.uri "
            "(or MLFLOW_TRACKING_URI) to the store the run was logged in"
        )
