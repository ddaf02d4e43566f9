"""Turn what a user typed as a model (`model.path`, `--model`) into something an engine loads.

"" is the embedded tiny model; a model dir is itself; a run or checkpoint dir is its newest
complete checkpoint's `model/` (`checkpoint.find_checkpoint`: verified against its manifest as
`resume=` does, a damaged newer one skipped with a warning); an MLflow run id (full, or a short
one as `stapoctl runs` prints it) is that run's `stapoctl.run_dir` tag, then as a run dir;
anything else is an HF hub id, passed through for the engines to download.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from stapoctl.checkpoint import CheckpointDamaged, find_checkpoint
from stapoctl.errors import UserError
from stapoctl.tracking.run_ids import looks_like_run_id, run_dir_of

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WARNED: set[str] = set()  # a spec is resolved more than once per command (preflight, then the run)


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def _warn(console, message: str) -> None:
    if message in _WARNED:
        return
    _WARNED.add(message)
    if console is not None:
        console.print(f"warning: {message}", markup=False, highlight=False)
    else:
        print(f"warning: {message}", file=sys.stderr)


def _from_dir(path: Path, spec: str, console=None) -> str:
    if _is_model_dir(path):
        return str(path)
    try:
        step = find_checkpoint(path, checksums=True, warn=lambda m: _warn(console, m))
    except CheckpointDamaged as exc:
        raise UserError(f"model '{spec}': that checkpoint is damaged ({exc}); give its run dir to take the "
                        "newest complete checkpoint") from None
    if step is None or not (step / "model").is_dir():
        raise UserError(
            f"model '{spec}': {path} has no config.json and no checkpoints/step_*/model/ that verifies; "
            "give a model dir, a run/checkpoint dir or an MLflow run id"
        )
    return str(step / "model")


def resolve_model(spec: str, cfg, console=None) -> str:
    """A local model dir or an HF hub id; builds (or finds cached) the tiny model for ""."""
    spec = (spec or "").strip()
    if not spec:
        from stapoctl.config.schema import DataConfig, ModelConfig
        from stapoctl.models.tiny import ensure_base_model

        model_cfg = getattr(cfg, "model", None) or ModelConfig()
        data_cfg = getattr(cfg, "data", None) or DataConfig()
        return str(ensure_base_model(model_cfg, data_cfg, console=console))
    path = Path(spec).expanduser()
    if path.is_dir():
        return _from_dir(path.resolve(), spec, console)
    if looks_like_run_id(spec):
        uri = getattr(getattr(cfg, "tracking", None), "uri", None)
        return _from_dir(run_dir_of(spec, uri, what="model"), spec, console)
    if path.exists():
        raise UserError(f"model '{spec}' is a file: give the model dir that holds config.json")
    if spec.startswith(("/", ".", "~")) or not _HUB_ID.match(spec):
        raise UserError(f"model '{spec}': no such directory, and not an HF hub id like Qwen/Qwen3-8B-Base")
    return spec


def chat_tokenizer_path(conf) -> str:
    """The tokenizer whose chat template frames the prompts: model.path's, or the tiny model's."""
    if conf.model.path:
        return resolve_model(conf.model.path, conf)
    from stapoctl.models.tiny import ensure_tokenizer

    return str(ensure_tokenizer(conf.model, conf.data))
