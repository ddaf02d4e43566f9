"""Models: the embedded tiny Qwen3 (built locally, warm-started on the toy task) and the
resolution of model specs (HF id, model dir, checkpoint/run dir, MLflow run id)."""

from stapoctl.models.resolve import resolve_model
from stapoctl.models.tiny import base_eval, build_random, ensure_base_model, ensure_tokenizer

__all__ = ["base_eval", "build_random", "ensure_base_model", "ensure_tokenizer", "resolve_model"]
