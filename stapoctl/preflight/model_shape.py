"""The architecture fields (config.json) of a run's model, found without loading or downloading it:
the tiny model's config, a local model / checkpoint dir, the HF cache, else the shapes table of
the Qwen3 models the presets name (config/shapes.py); and the parameters those fields make
(`parameter_count`: Qwen3's formula, any other architecture built on the meta device)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from stapoctl.config.shapes import decoder_params, known_shape
from stapoctl.errors import UserError


def tiny_shape(tiny) -> dict:
    return {"hidden_size": tiny.hidden_size, "intermediate_size": tiny.intermediate_size,
            "num_hidden_layers": tiny.num_layers, "num_attention_heads": tiny.num_heads,
            "num_key_value_heads": tiny.num_kv_heads, "head_dim": tiny.head_dim, "vocab_size": tiny.vocab_size,
            "max_position_embeddings": tiny.max_position_embeddings, "tie_word_embeddings": True}


def _local_config(path: Path) -> Optional[Path]:
    from stapoctl.checkpoint import CheckpointDamaged, find_checkpoint

    for candidate in (path / "config.json", path / "model" / "config.json"):
        if candidate.is_file():
            return candidate
    try:  # sizes only: the plan reads config.json, not the weights (the run verifies them)
        step = find_checkpoint(path, checksums=False)
    except CheckpointDamaged:
        return None
    return step / "model" / "config.json" if step is not None else None


def _cached_config(hub_id: str) -> Optional[Path]:
    try:
        from huggingface_hub import try_to_load_from_cache

        from stapoctl.preflight.hub import hub_cache

        found = try_to_load_from_cache(hub_id, "config.json", cache_dir=str(hub_cache()))
    except Exception:  # a malformed id or cache: the table below answers, or nothing
        return None
    return Path(found) if isinstance(found, str) else None


def model_shape(conf: DictConfig) -> tuple[Optional[dict], str]:
    """(config.json fields or None, where they came from)."""
    spec = str(conf.model.path or "").strip()
    if not spec:
        return tiny_shape(conf.model.tiny), "model.tiny"
    path = Path(spec).expanduser()
    if path.is_dir():
        found = _local_config(path)
        if found is not None:
            return _with_text_config(json.loads(found.read_text())), str(found)
        return None, f"{path} (no config.json)"
    cached = _cached_config(spec)
    if cached is not None:
        return _with_text_config(json.loads(cached.read_text())), f"HF cache {cached}"
    table = known_shape(spec)
    if table is not None:
        return table, "stapoctl's shapes table (config/shapes.py)"
    return None, f"{spec} (not cached, not in config/shapes.py)"


def _with_text_config(cfg: dict) -> dict:
    """Multimodal configs keep the decoder's fields under text_config."""
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


class ArchitectureUnknown(UserError):
    """transformers cannot build the model a config.json describes (no such model_type here)."""


def parameter_count(shape: dict) -> int:
    """Parameters of the model these config.json fields describe, exactly: a Qwen3 (the tiny
    model's fields name no model_type) by `config/shapes.py`'s formula, without torch; any other
    architecture (Llama's and Qwen2's biases and missing q/k norms, MoE experts) built by
    transformers on the meta device (no memory, ~1 s) and counted there."""
    if str(shape.get("model_type") or "qwen3") == "qwen3" and not shape.get("attention_bias"):
        return decoder_params(shape)
    return _meta_count(json.dumps(shape, sort_keys=True, default=str))


@functools.lru_cache(maxsize=16)
def _meta_count(fields: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = json.loads(fields)
    kind = shape.pop("model_type", None)
    try:
        cfg = AutoConfig.for_model(kind, **shape)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # an unknown model_type, a config transformers' causal LMs cannot take
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:200]
        raise ArchitectureUnknown(f"transformers {_version()} cannot build model_type={kind!r} as a causal LM "
                                  f"({why})") from None
    return int(model.num_parameters())


def _version() -> str:
    import transformers

    return transformers.__version__
