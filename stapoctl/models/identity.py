"""What running vLLM engines took from the model dir they were started on, apart from its weights:
the architecture (`config.json`) and the tokenizer. Two dirs that agree here — a base model and
its run's checkpoints, or the checkpoints of a sweep's trials — can share running engines; the
next run's weights are pushed into them (`trainer/session.py`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# written differently by a save than by the build of the same model, and not read by vLLM's engine
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache")
_TOKENIZER_NOISE = ("name_or_path", "is_local", "local_files_only")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json",
                    "added_tokens.json", "chat_template.jinja", "generation_config.json")


def _json_without(path: Path, noise: tuple[str, ...]) -> str:
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in noise}
    return json.dumps(data, sort_keys=True)


def model_identity(model_path: str) -> str:
    """A digest of the architecture and tokenizer of a local model dir; the path itself for
    anything else (a hub id not downloaded yet: only the same id matches)."""
    root = Path(model_path)
    if not (root / "config.json").is_file():
        return str(model_path)
    digest = hashlib.sha256()
    try:
        digest.update(_json_without(root / "config.json", _CONFIG_NOISE).encode())
        if (root / "tokenizer_config.json").is_file():
            digest.update(_json_without(root / "tokenizer_config.json", _TOKENIZER_NOISE).encode())
        for name in _TOKENIZER_FILES:
            if (root / name).is_file():
                digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    except (OSError, ValueError):
        return str(model_path)  # unreadable: never equal to another dir's
    return digest.hexdigest()[:16]
