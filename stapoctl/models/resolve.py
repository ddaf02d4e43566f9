"""Turn what a user typed as a model (`model.path`, `--model`) into something an engine loads.

"" is the embedded tiny model; a model dir is itself; a run or checkpoint dir is its newest
checkpoint's `model/`; a 32-hex MLflow run id is that run's `stapoctl.run_dir` tag, then as
a run dir; anything else is an HF hub id, passed through for the engines to download.
"""

from __future__ import annotations

import re
from pathlib import Path

from stapoctl.errors import UserError

RUN_DIR_TAG = "stapoctl.run_dir"
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
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


def _run_dir_of(run_id: str, cfg) -> Path:
    import mlflow

    from stapoctl.tracking.mlflow_run import tracking_uri

    uri = tracking_uri(getattr(getattr(cfg, "tracking", None), "uri", None))
    try:
        run = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    except Exception as exc:  # MlflowException for an unknown id or an unreachable store
        raise UserError(f"model '{run_id}': no such MLflow run in {uri} ({type(exc).__name__})") from exc
    run_dir = run.data.tags.get(RUN_DIR_TAG)
    if not run_dir:
        raise UserError(f"model '{run_id}': MLflow run has no '{RUN_DIR_TAG}' tag (not a stapoctl training run)")
    return Path(run_dir)


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
    if _RUN_ID.match(spec):
        return _from_dir(_run_dir_of(spec, cfg), spec)
    if path.exists():
        raise UserError(f"model '{spec}' is a file: give the model dir that holds config.json")
    if spec.startswith(("/", ".", "~")) or not _HUB_ID.match(spec):
        raise UserError(f"model '{spec}': no such directory, and not an HF hub id like Qwen/Qwen3-8B-Base")
    return spec
