"""Architecture fields of the Qwen3 models the presets name, so a plan can size a hub model that
is not downloaded yet (a local config.json or the HF cache's always wins: preflight/shapes.py).

Copied from the published config.json of each repository on the Hugging Face hub
(https://huggingface.co/Qwen/<name>/blob/main/config.json; the -Base and post-trained repos of a
size share these fields). Used by `stapoctl plan`, the model presets (config/compose.py) and
benchmarks/gpu_learner.py / gpu_kit.py.
"""

from __future__ import annotations

_COMMON = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=32768,
               rope_theta=1_000_000.0, rms_norm_eps=1e-6, model_type="qwen3")

QWEN3_SHAPES: dict[str, dict] = {
    "Qwen/Qwen3-0.6B-Base": dict(_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B-Base": dict(_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, tie_word_embeddings=True),
    "Qwen/Qwen3-4B-Base": dict(_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                               num_attention_heads=32, tie_word_embeddings=True),
    "Qwen/Qwen3-8B-Base": dict(_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, tie_word_embeddings=False),
    "Qwen/Qwen3-14B-Base": dict(_COMMON, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                num_attention_heads=40, tie_word_embeddings=False),
}


def decoder_params(shape: dict) -> int:
    """Parameters of a Qwen3-style decoder from its config.json fields (attention with q/k norms,
    SwiGLU MLP, RMSNorms; the LM head counted unless tied to the embeddings)."""
    h, inter, layers = int(shape["hidden_size"]), int(shape["intermediate_size"]), int(shape["num_hidden_layers"])
    heads, kv = int(shape["num_attention_heads"]), int(shape.get("num_key_value_heads") or shape["num_attention_heads"])
    hd = int(shape.get("head_dim") or h // heads)
    vocab = int(shape["vocab_size"])
    per_layer = h * hd * (2 * heads + 2 * kv) + 3 * h * inter + 2 * h + 2 * hd
    head = 0 if shape.get("tie_word_embeddings", True) else vocab * h
    return vocab * h + layers * per_layer + h + head


def known_shape(model_id: str) -> dict | None:
    """The table's fields for a hub id, with or without the -Base suffix (same architecture)."""
    key = str(model_id).rstrip("/")
    if key in QWEN3_SHAPES:
        return dict(QWEN3_SHAPES[key])
    if f"{key}-Base" in QWEN3_SHAPES:
        return dict(QWEN3_SHAPES[f"{key}-Base"])
    return None


def preset_name(model_id: str) -> str:
    """`Qwen/Qwen3-8B-Base` -> `qwen3_8b` (the model group's option name)."""
    return model_id.split("/")[-1].removesuffix("-Base").lower().replace("qwen3-", "qwen3_")


def max_model_len(conf, shape: dict | None) -> int:
    """vLLM's window: the prompt + the longest response training or validation asks for, within
    the model's max_position_embeddings (shape: its config.json fields, None when unknown)."""
    want = int(conf.data.max_prompt_length) + max(int(conf.rollout.max_response_length),
                                                  int(conf.eval.max_response_length))
    return min(want, int((shape or {}).get("max_position_embeddings") or want))
