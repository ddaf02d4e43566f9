"""What a run reads after its start, kept where checkpoint retention cannot delete it.

`trainer.keep_checkpoints` deletes old step dirs, so nothing a later save, a restarted actor or a
resume reads may live only in one of them:
- the tokenizer (with its chat template) that every save writes into `model/`: copied once into
  `<run_dir>/tokenizer/` when the run starts (a resumed run that lacks it: from the checkpoint it
  resumes from, before any save of this process can rotate that one out);
- a starting model that is itself a checkpoint (`model.path=` another run): it is the initial
  policy, the KL term's frozen reference and what a restarted rollout actor loads, and the other
  run's retention may delete it, so it is copied once to `$STAPOCTL_HOME/models/checkpoint-<hash>/`;
- the checkpoint a resumed process started from: its rollout actors are built from its `model/`
  (Ray restarts one from it after a crash), so `checkpoint.prune` keeps it while that process runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from stapoctl import checkpoint, paths
from stapoctl.errors import RunFailed

TOKENIZER = "tokenizer"


def tokenizer_dir(run_dir: Path, source: str) -> Path:
    """`<run_dir>/tokenizer/` (made once, from `source`: a model dir or hub id): what saves copy."""
    dest = Path(run_dir) / TOKENIZER
    if (dest / "tokenizer_config.json").is_file():
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{TOKENIZER}.", dir=dest.parent))
        try:
            _copy_tokenizer(str(source), tmp)
            shutil.rmtree(dest, ignore_errors=True)  # only the run's own driver writes it: a copy cut short
            os.rename(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        raise RunFailed(f"the run's tokenizer copy could not be written to {dest} ({exc.strerror or exc}): "
                        "free space or make the run dir writable, then run the same command again") from exc
    return dest


def _copy_tokenizer(source: str, dest: Path) -> None:
    """As the learner's save writes it into a checkpoint's model/ (`StateIO._write_checkpoint`)."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(source).save_pretrained(str(dest))


def checkpoint_of(model: str) -> Optional[Path]:
    """The step dir a model dir belongs to (`…/checkpoints/step_N/model`), else None."""
    path = Path(model)
    step = path.parent
    if path.name != "model" or step.parent.name != "checkpoints" or not checkpoint._STEP_RE.match(step.name):
        return None
    return step if path.is_dir() else None


def starting_model(model: str, home: Optional[Path] = None) -> str:
    """`model` itself, or, when it is a run's checkpoint, its copy outside every run's retention
    (made once per checkpoint content: the manifest's sha256 of its model files names it)."""
    step = checkpoint_of(model)
    if step is None:
        return model
    dest = Path(home or paths.home()) / "models" / f"checkpoint-{_content_id(step)}"
    if (dest / "config.json").is_file():
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        shutil.copytree(Path(model), tmp / "model")
        try:
            os.rename(tmp / "model", dest)  # whole or not at all
        except OSError:
            if not (dest / "config.json").is_file():  # else another run copied it meanwhile
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def _content_id(step: Path) -> str:
    """12 hex digits of the checkpoint's model files (their manifest entries, else their sizes)."""
    h = hashlib.sha256()
    try:
        files = json.loads((step / checkpoint.MANIFEST).read_text())["files"]
        entries = {k: v for k, v in files.items() if k.startswith("model/")}
    except (OSError, ValueError, KeyError):
        entries = {p.relative_to(step).as_posix(): p.stat().st_size for p in (step / "model").rglob("*") if p.is_file()}
    h.update(json.dumps(entries, sort_keys=True).encode())
    return h.hexdigest()[:12]
