"""`stapoctl doctor [overrides] [--no-wait] [--json]`: the checks here (cluster=local, the
default), as a Ray job (cluster=ray cluster.address=http://HOST:8265) or as a SLURM job
(cluster=slurm); one table, exit 0 only when every applicable row passes."""

from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig
from rich.console import Console

from stapoctl.doctor.rows import Row, exit_code


def doctor_command(conf: DictConfig, overrides: Sequence[str], console: Console, *, as_json: bool = False,
                   wait: bool = True) -> int:
    from stapoctl.doctor import remote
    from stapoctl.doctor.runner import print_rows, run_here

    def show(rows: list[Row], host: str, elapsed_s: float) -> None:
        print_rows(rows, console, as_json=as_json, host=host, elapsed_s=elapsed_s)

    # the job's progress lines go to stderr when stdout carries the JSON
    code = remote.dispatch(conf, overrides, Console(stderr=True) if as_json else console, show, wait=wait)
    if code is not None:
        return code
    return exit_code(run_here(conf, console, as_json=as_json))
