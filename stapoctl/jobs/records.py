"""The local record of jobs this user submitted (`$STAPOCTL_HOME/jobs/<local id>/record.json`).

Neither the Ray job server nor SLURM remembers which runs a job trains or where submitit keeps
its logs; `stapoctl jobs` reads these records to answer with backend, job id, run name and logs
without the user copying ids around. A SLURM job's folder (its sbatch script, logs, pickles and
run dirs) is the record's own directory.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from stapoctl import paths
from stapoctl.errors import UserError

RECORD = "record.json"


def jobs_root() -> Path:
    return paths.home() / "jobs"


def new_local_id(backend: str) -> str:
    """Sortable by submission time, unique without asking anyone."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{backend}-{secrets.token_hex(2)}"


@dataclass
class JobRecord:
    backend: str  # ray | slurm
    job_id: str  # Ray submission id, or the SLURM job id (array: the array's id)
    name: str  # the run name (arrays: the sweep's name)
    local_id: str
    submitted_at: float = field(default_factory=time.time)
    kind: str = "train"  # train | array
    address: Optional[str] = None  # Ray: the job server
    folder: Optional[str] = None  # SLURM: submitit's folder
    tasks: list[str] = field(default_factory=list)  # SLURM arrays: "<array id>_<i>"
    trials: list[list[str]] = field(default_factory=list)  # arrays: each task's extra overrides
    overrides: list[str] = field(default_factory=list)
    parent_run_id: Optional[str] = None
    tracking_uri: Optional[str] = None

    @property
    def directory(self) -> Path:
        return jobs_root() / self.local_id

    def save(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / RECORD
        paths.write_atomic(path, json.dumps(asdict(self), indent=2) + "\n")
        return path


def load_all() -> list[JobRecord]:
    """Every record, newest first; unreadable ones are skipped (a half-written dir, an old format)."""
    out = []
    root = jobs_root()
    for path in sorted(root.glob(f"*/{RECORD}"), reverse=True) if root.is_dir() else []:
        try:
            out.append(JobRecord(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return out


def find(job_id: str) -> Optional[JobRecord]:
    """The record of a job id, an array task id (`12_1`) or a local id."""
    for rec in load_all():
        if job_id in (rec.job_id, rec.local_id) or job_id in rec.tasks:
            return rec
    return None


def require(job_id: str) -> JobRecord:
    rec = find(job_id)
    if rec is None:
        known = ", ".join(r.job_id for r in load_all()[:5]) or "none yet"
        raise UserError(
            f"job '{job_id}' is not among the jobs submitted from here ({jobs_root()}; latest: {known}); "
            "for a Ray job submitted elsewhere pass --address http://HOST:8265"
        )
    return rec
