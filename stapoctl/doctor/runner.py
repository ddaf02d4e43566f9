"""Every check of `stapoctl doctor`, in order, where this process runs: the fast ones first
(config, versions, CUDA, NCCL, GPUs, model, data, MLflow, disk, SLURM), then the slow ones under
a status line (the all-reduce's two processes, the engines' start and the weight-sync canary).
A check that raises becomes its own FAIL row; the others still run."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Callable, Iterator, Optional

from omegaconf import DictConfig
from rich.console import Console

from stapoctl.doctor.rows import Row, from_error, summary, table, to_json
from stapoctl.errors import labelled


def guarded(check: str, fn: Callable[[], object], fix: str) -> list[Row]:
    """fn()'s row(s), or one FAIL row for what it raised."""
    try:
        out = fn()
    except Exception as exc:
        return [from_error(check, exc, fix)]
    return list(out) if isinstance(out, (list, tuple)) else [out]  # type: ignore[list-item]


@contextlib.contextmanager
def status_line(console: Optional[Console]) -> Iterator[Callable[[str], None]]:
    """A rich status line (spinner) whose text the slow checks update; silent without a console."""
    if console is None:
        yield lambda msg: None
        return
    with console.status("") as status:
        yield lambda msg: status.update(labelled("doctor:", msg, "bold"))


def run_checks(conf: DictConfig, status_console: Optional[Console] = None) -> list[Row]:
    from stapoctl.doctor import comm, engine, services, versions

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows: list[Row] = []
    rows += guarded("config", lambda: services.check_config(conf), "fix the setting the message names")
    rows += guarded("versions", versions.check_versions, "pip install -e '.[cpu]' (or '.[gpu]')")
    rows += guarded("CUDA", versions.cuda_rows, "install the CUDA build of torch that the vllm wheel pins")
    rows += guarded("GPUs", lambda: comm.check_gpus(conf), "set cluster.gpus_per_node / the GPU counts of the run")
    model_row, model_path = services.check_model(conf)
    rows.append(model_row)
    rows += guarded("datasets", lambda: services.check_datasets(conf), services.DATA_FIX)
    rows += guarded("MLflow", lambda: services.check_mlflow(conf), services.MLFLOW_FIX)
    rows += guarded("disk", lambda: services.check_disk(conf), services.DISK_FIX)
    rows += guarded("SLURM", lambda: services.check_slurm(conf), "check sinfo / sacctmgr on this node")
    with status_line(status_console) as say:
        say("all-reduce between 2 ranks (spawning 2 processes)…")
        rows += guarded("all-reduce gloo", lambda: comm.allreduce_rows(conf), comm.GLOO_FIX)
        rows += engine.engine_rows(conf, model_path, say)
    return rows


def print_rows(rows: list[Row], console: Console, *, as_json: bool, host: str, elapsed_s: float) -> None:
    """The table and a summary line, or (as_json) the rows as one JSON document on stdout."""
    from stapoctl.doctor.rows import exit_code

    if as_json:
        console.out(to_json(rows, host=host, elapsed_s=round(elapsed_s, 1), exit_code=exit_code(rows)),
                    highlight=False)
        return
    console.print(table(rows, title=f"stapoctl doctor · {host} · {elapsed_s:.0f} s"))
    colour = "green" if exit_code(rows) == 0 else "red"
    console.print(f"[{colour}]{summary(rows)}[/]", highlight=False)


def run_here(conf: DictConfig, console: Console, *, as_json: bool) -> list[Row]:
    """The checks in this process, printed; the rows."""
    t0 = time.perf_counter()
    status_console = Console(stderr=True) if as_json else console
    rows = run_checks(conf, status_console)
    print_rows(rows, console, as_json=as_json, host=socket.gethostname(), elapsed_s=time.perf_counter() - t0)
    return rows
