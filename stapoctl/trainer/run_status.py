"""A training run's MLflow record from open to end: it ends FINISHED, KILLED (a signal, with
`stapoctl.stop_reason`) or FAILED (with `stapoctl.error`, one line), never left RUNNING by a
process that lived to say otherwise. Only a process killed outright (SIGKILL, OOM, power) leaves
it RUNNING; `stapoctl train resume=…` sets it RUNNING again and ends it properly.

Everything is sent through the run's `MetricBuffer` (journal on disk + sender thread), so the
end status too survives a tracking server that is down at that moment. The run dir is locked
(flock) while a process trains in it: two drivers resuming one run would overwrite each other's
checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from stapoctl.errors import AlarmStopped, RunFailed, RunStopped, UserError
from stapoctl.tracking import keys

LOCK = ".stapoctl.lock"
# While a run trains, a failing MLflow request must fail fast: the sender thread retries itself.
_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
             "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


@dataclass
class RunRecord:
    run_id: str
    run_dir: Path
    uri: str
    buffer: Any  # MetricBuffer
    console: Any = None
    flush_timeout_s: float = 120.0
    status: Optional[str] = None
    tags: dict = field(default_factory=dict)

    def finish(self, exc: Optional[BaseException]) -> None:
        """Decide and queue the final status (once), then give the sender a short while."""
        if self.status is not None:
            return
        self.status, self.tags = final_status(exc)
        self.buffer.set_tags(self.tags)
        self.buffer.end(self.status)
        self.buffer.flush(min(10.0, self.flush_timeout_s))

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """Around the loop, inside the engines' context: the status is recorded before the (slower)
        engine shutdown, so a SIGKILL that follows a SIGTERM (SLURM's KillWait) finds it set."""
        try:
            yield
        except BaseException as exc:
            self.finish(exc)
            raise
        self.finish(None)


def final_status(exc: Optional[BaseException]) -> tuple[str, dict[str, str]]:
    if exc is None:
        return "FINISHED", {}
    if isinstance(exc, AlarmStopped):
        return "KILLED", {"stapoctl.stop_reason": str(exc), keys.ALARM_STOPPED: ",".join(exc.alarms)}
    if isinstance(exc, RunStopped):
        return "KILLED", {"stapoctl.stop_reason": str(exc)}
    if isinstance(exc, KeyboardInterrupt):
        return "KILLED", {"stapoctl.stop_reason": "KeyboardInterrupt"}
    if isinstance(exc, SystemExit):
        return "KILLED", {"stapoctl.stop_reason": f"SystemExit({exc.code})"}
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (RunFailed, UserError)):
        text = f"{type(exc).__name__}: {text}"
    return "FAILED", {"stapoctl.error": text[:4000]}


@contextlib.contextmanager
def http_fail_fast() -> Iterator[None]:
    """MLflow's default retries add up to minutes per request; bound them unless the user set them.
    urllib3's per-retry warnings are muted meanwhile: the journal says once that the server is gone."""
    import logging

    saved = {k: os.environ.get(k) for k in _HTTP_ENV}
    for k, v in _HTTP_ENV.items():
        os.environ.setdefault(k, v)
    pool_log = logging.getLogger("urllib3.connectionpool")
    level = pool_log.level
    pool_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pool_log.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Exclusive while this process trains in `run_dir` (released by the kernel if it dies)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise UserError(f"{run_dir} is in use by another stapoctl process (pid {holder}): wait for it to end, "
                            "or stop it first (a second driver would overwrite its checkpoints)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def run_dir_holder(run_dir: Path) -> Optional[str]:
    """The pid of the process training in `run_dir` now (its lock is held), else None."""
    path = Path(run_dir) / LOCK
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
    finally:
        os.close(fd)


def open_run(*, uri: Optional[str], experiment: str, run_name: Optional[str] = None, run_id: Optional[str] = None,
             parent_run_id: Optional[str] = None, tags: Optional[Mapping[str, str]] = None) -> str:
    """Create the MLflow run (or set an existing one RUNNING again); no fluent active run, so
    nothing here depends on this process ending it."""
    from mlflow import MlflowClient
    from mlflow.entities import RunTag
    from mlflow.tracking.context import registry as context_registry

    from stapoctl.tracking import mlflow_run

    resolved_uri = mlflow_run.setup(uri, experiment)
    client = MlflowClient(tracking_uri=resolved_uri)
    if run_id:
        client.update_run(run_id, status="RUNNING")
        if tags:
            client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        return run_id
    all_tags = dict(tags or {})
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    if run_name:
        all_tags["mlflow.runName"] = run_name
    exp = client.get_experiment_by_name(experiment)
    run = client.create_run(exp.experiment_id, tags=context_registry.resolve_tags(all_tags), run_name=run_name)
    return run.info.run_id


@contextlib.contextmanager
def tracked_run(*, uri: str, experiment: str, run_dir_for, console: Any, run_name: Optional[str] = None,
                run_id: Optional[str] = None, parent_run_id: Optional[str] = None,
                tags: Optional[Mapping[str, str]] = None, flush_timeout_s: float = 120.0) -> Iterator[RunRecord]:
    """Open the run, lock its dir, route its logging through a journal; end it whatever happens.

    `run_dir_for(run_id)` → the run's dir (known only once a new run has an id).
    """
    from stapoctl.tracking.metric_buffer import MetricBuffer, activated

    with http_fail_fast():
        run_id = open_run(uri=uri, experiment=experiment, run_name=run_name, run_id=run_id,
                          parent_run_id=parent_run_id, tags=tags)
        run_dir = Path(run_dir_for(run_id))
        try:
            lock = run_dir_lock(run_dir)
            lock.__enter__()
        except BaseException as exc:
            _end_now(uri, run_id, exc)
            raise
        try:
            say = ((lambda msg: console.print(msg, style="yellow", markup=False, highlight=False))
                   if console is not None else None)
            buffer = MetricBuffer(run_dir, run_id, uri, say=say)
            record = RunRecord(run_id, run_dir, uri, buffer, console, flush_timeout_s)
            try:
                with activated(buffer):
                    yield record
            except BaseException as exc:
                record.finish(exc)
                raise
            else:
                record.finish(None)
            finally:
                note = buffer.close_note(buffer.close(flush_timeout_s), flush_timeout_s)
                if note and console is not None:
                    console.print(note, style="yellow", highlight=False, markup=False, soft_wrap=True)
        finally:
            lock.__exit__(None, None, None)


def _end_now(uri: str, run_id: str, exc: BaseException) -> None:
    """A run that fails before its journal exists is ended directly."""
    from mlflow import MlflowClient

    status, tags = final_status(exc)
    try:
        client = MlflowClient(tracking_uri=uri)
        for k, v in tags.items():
            client.set_tag(run_id, k, v)
        client.set_terminated(run_id, status)
    except Exception:
        pass
