"""`stapoctl doctor`'s job body where the checks run on a cluster: `DoctorJob` for SLURM (a
submitit callable beside the trainer's `TrainJob`, its rows the job's result) and, for a Ray job,
`python -m stapoctl.doctor.job <overrides>`, which prints the table and one line of JSON rows
(`rows.JSON_MARKER`) that the submitting side reads back from the job's log."""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import asdict
from typing import Sequence

from rich.console import Console

from stapoctl.doctor.rows import JSON_MARKER, exit_code, to_json


def run_body(overrides: Sequence[str]) -> tuple[list, float]:
    """Compose the config as the submitting side did, run every check here; (rows, seconds)."""
    from stapoctl.config.compose import compose_config
    from stapoctl.doctor.runner import print_rows, run_checks
    from stapoctl.jobs import presets

    t0 = time.perf_counter()
    conf = presets.apply(compose_config(list(overrides)), list(overrides))
    console = Console(width=160)
    console.print(f"[bold]stapoctl doctor[/] on {socket.gethostname()}", highlight=False)
    rows = run_checks(conf)
    elapsed = time.perf_counter() - t0
    print_rows(rows, console, as_json=False, host=socket.gethostname(), elapsed_s=elapsed)
    print(JSON_MARKER + to_json(rows, host=socket.gethostname(), elapsed_s=round(elapsed, 1)), flush=True)
    return rows, elapsed


def job_overrides(overrides: Sequence[str]) -> list[str]:
    """A multi-node SLURM job's Ray is up across its nodes before the body starts: join it, as
    `TrainJob` does (else `launch_engines` starts a one-node Ray and the checks see node 1 only)."""
    from stapoctl.jobs import sbatch

    address = os.environ.get(sbatch.RAY_ADDRESS_ENV)
    return [*overrides, f"cluster.address={address}"] if address else list(overrides)


class DoctorJob:
    """A SLURM job that runs the doctor's checks on its node; returns the rows as dicts."""

    def __init__(self, overrides: Sequence[str]):
        self.overrides = list(overrides)

    def __call__(self) -> dict:
        rows, elapsed = run_body(job_overrides(self.overrides))
        return {"rows": [asdict(r) for r in rows], "host": socket.gethostname(), "elapsed_s": round(elapsed, 1)}


def main(argv: Sequence[str]) -> int:
    rows, _ = run_body(argv)
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
