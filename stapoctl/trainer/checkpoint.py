"""Checkpoints: written into a hidden temp dir, then renamed, so a crash never leaves a
half-written `step_NNNNNN/` and `latest` always names a complete one.

Layout (a contract with `stapoctl eval` and `models.resolve`):
    <run_dir>/checkpoints/step_000020/model/              HF dir, loadable by vLLM and transformers
    <run_dir>/checkpoints/step_000020/state/              DeepSpeed: weights, optimizer, scheduler
    <run_dir>/checkpoints/step_000020/trainer_state.json  step, sampler position, RNG, run id
    <run_dir>/checkpoints/latest                          text: the newest step dir's name
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from stapoctl.errors import UserError
from stapoctl.tracking.run_ids import looks_like_run_id, run_dir_of

TRAINER_STATE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def save(run_dir: Path, step: int, write_payload: Callable[[Path], None], trainer_state: dict) -> Path:
    """`write_payload(tmp_dir)` fills model/ and state/; we add trainer_state.json and publish."""
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=ckpt_root))
    try:
        write_payload(tmp)
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
        if final.exists():  # the same step saved again (a resumed run re-reaching it)
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _write_atomic(ckpt_root / "latest", final.name + "\n")
    return final


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def latest_step_dir(run_dir: Path) -> Optional[Path]:
    """The step dir `latest` names, else the highest complete step dir, else None."""
    root = Path(run_dir) / "checkpoints"
    latest = root / "latest"
    if latest.is_file():
        candidate = root / latest.read_text().strip()
        if (candidate / TRAINER_STATE).is_file():
            return candidate
    steps = sorted(
        (p for p in root.glob("step_*") if _STEP_RE.match(p.name) and (p / TRAINER_STATE).is_file()),
        key=lambda p: int(_STEP_RE.match(p.name).group(1)),  # type: ignore[union-attr]
    )
    return steps[-1] if steps else None


def read_trainer_state(step_dir: Path) -> dict:
    return json.loads((Path(step_dir) / TRAINER_STATE).read_text())


def resolve_resume(spec: str, tracking_uri: Optional[str] = None) -> Path:
    """`resume=` → the checkpoint step dir to continue from.

    Accepts a step dir, a run dir (its latest checkpoint), or an MLflow run id, full or short (its
    tag `stapoctl.run_dir`, then the latest checkpoint there).
    """
    value = str(spec).strip()
    path = Path(value).expanduser()
    if path.is_dir():
        if (path / TRAINER_STATE).is_file():
            return path.resolve()
        found = latest_step_dir(path) or (latest_step_dir(path.parent) if path.name == "checkpoints" else None)
        if found is None:
            raise UserError(f"resume={value}: no checkpoint under {path} (expected checkpoints/step_NNNNNN/)")
        return found.resolve()
    if looks_like_run_id(value):
        run_dir = run_dir_of(value, tracking_uri, what="resume")
        found = latest_step_dir(run_dir)
        if found is None:
            raise UserError(f"resume={value}: MLflow run's dir {run_dir} has no checkpoint yet")
        return found.resolve()
    raise UserError(
        f"resume={value}: not a directory and not a 32-hex MLflow run id (or a prefix of ≥ 7 digits, as "
        "`stapoctl runs` prints it); pass a run dir, a checkpoints/step_NNNNNN dir or the run id"
    )


def rng_state() -> dict[str, Any]:
    """The driver's RNG states, JSON-safe (the rollout seeds themselves derive from the step)."""
    import random

    import torch

    py = random.getstate()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import torch

    if "python" in state:
        v, internal, gauss = state["python"]
        random.setstate((v, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
