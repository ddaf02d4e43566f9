"""Turn what a user typed as a model (`model.path`, `--model`) into something an engine loads.

"" is the embedded tiny model; a model dir is itself; a run or checkpoint dir is its newest
checkpoint's `model/`; an MLflow run id (full, or a short one as `stapoctl runs` prints it)
is that run's `stapoctl.run_dir` tag, then as a run dir; anything else is an HF hub id,
passed through for the engines to download.
"""

from __future__ import annotations

import re
from pathlib import Path

from stapoctl.errors import UserError
from stapoctl.tracking.run_ids import looks_like_run_id, run_dir_of

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_STEP = re.compile(r"^step_(\d+)$")


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def latest_checkpoint(path: Path) -> Path | None:
    """The newest `step_*` dir under a run dir, its checkpoints/ dir, or a step dir itself."""
    if (path / "model").is_dir() and _STEP.match(path.name):
        return path
    ckpts = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    marker = ckpts / "latest"
    if marker.is_file():
        named = Path(marker.read_text().strip())
        step = named if named.is_absolute() else ckpts / named
        if (step / "model").is_dir():
            return step
    steps = [p for p in ckpts.glob("step_*") if _STEP.match(p.name) and (p / "model").is_dir()]
    return max(steps, key=lambda p: int(_STEP.match(p.name).group(1))) if steps else None


def _from_dir(path: Path, spec: str) -> str:
    if _is_model_dir(path):
        return str(path)
    step = latest_checkpoint(path)
    if step is None:
        raise UserError(
            f"model '{spec}': {path} has no config.json and no checkpoints/step_*/model/; "
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
        return _from_dir(path.resolve(), spec)
    if looks_like_run_id(spec):
        uri = getattr(getattr(cfg, "tracking", None), "uri", None)
        return _from_dir(run_dir_of(spec, uri, what="model"), spec)
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
