"""A run that cannot go on ends with one line: what failed, why, and how to resume.

An engine actor's death (`launch.actor_errors.describe_actor_death`), a checkpoint the disk could
not take (`save_failure`) or an exception raised inside an actor's method during a save, a weight
sync, an update or the rollouts (`engine_faults`) reach the user as one `RunFailed` line; the
remote stack goes to `<run_dir>/errors.log` and to the MLflow run (`errors/…txt`), where it can be
read in full, never to the terminal (Ray's message is the whole remote traceback: ~90 lines).
"""

from __future__ import annotations

import contextlib
import shlex
import time
from pathlib import Path
from typing import Any, Optional

from stapoctl.errors import EngineFault, RunFailed, RunStopped, UserError

ERRORS_LOG = "errors.log"

# an actor method → what the run was doing when it raised (any other *weight* / *transfer* method:
# the weight sync; anything else is named as it is)
_DOING = {
    "save": "writing the step-{step} checkpoint", "load": "loading the checkpoint to resume from",
    "train_step": "the step-{step} update", "compute_log_probs": "the step-{step} update",
    "rollout": "the step-{step} rollouts", "score_logprobs": "the step-{step} rollouts",
    "score_batch": "the step-{step} rollouts", "generate": "generating (rollouts or validation) at step {step}",
}


def _doing(method: str, step: int) -> str:
    if method in _DOING:
        return _DOING[method].format(step=step)
    if "weight" in method or "transfer" in method:
        return f"the weight sync after step {step}"
    return f"{method}() at step {step}"


def resume_hint(run_dir: Path, run_id: str, uri: Any = None, fix: str = "fix that") -> str:
    """'step_N is intact: FIX and resume with `…`' (or start again: no checkpoint yet)."""
    from stapoctl.checkpoint import latest_step_dir

    last = latest_step_dir(run_dir)
    resume = f"stapoctl train resume={run_id}" + (f" {shlex.quote(f'tracking.uri={uri}')}" if uri else "")
    return (f"{last.name} is intact: {fix} and resume with `{resume}`" if last else
            f"no checkpoint was written before it: {fix} and start the run again")


def save_failure(exc: OSError, run_dir: Path, step: int, run_id: str, uri: Any = None) -> str:
    """One line for a checkpoint that could not be written: where and why (for a full disk or
    quota: the space left and a checkpoint's size), the checkpoint still intact, how to resume."""
    import shutil

    from stapoctl.checkpoint import DISK_FULL, latest_step_dir, step_size

    root = Path(run_dir) / "checkpoints"
    last = latest_step_dir(run_dir)
    then = resume_hint(run_dir, run_id, uri, "free space" if exc.errno in DISK_FULL else "fix that")
    if exc.errno not in DISK_FULL:
        return (f"the step-{step} checkpoint could not be written to {root} ({exc.strerror or exc}): "
                f"the run is FAILED; {then}")
    try:
        free = f"{_size(shutil.disk_usage(root).free)} free there"
    except OSError:
        free = "free space unknown"
    took = f", {last.name} took {_size(step_size(last))}" if last else ""
    return (f"disk full: the step-{step} checkpoint could not be written to {root} ({exc.strerror}; {free}{took}): "
            f"the run is FAILED; {then}")


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@contextlib.contextmanager
def engine_faults(engines, run_id: str, run_dir: Path, uri: Any = None, step_of=lambda: 0):
    """Around the loop: a dead learner rank, or an exception raised inside any engine actor, ends
    the run with one `RunFailed` line (which rank or actor, what it was doing, why, how to resume).
    `step_of()`: the step in progress, for the line; `engines` None: before they are up."""
    try:
        yield
    except EngineFault as exc:
        raise RunFailed(f"{exc}: the run is FAILED; {resume_hint(run_dir, run_id, uri)}") from exc
    except (RunFailed, RunStopped, UserError):
        raise
    except Exception as exc:
        line = _learner_death(engines, exc, run_id, run_dir, uri) or _remote_failure(
            engines, exc, run_id, run_dir, uri, int(step_of() or 0))
        if line is None:
            raise
        raise RunFailed(line) from exc


def _learner_death(engines, exc: BaseException, run_id: str, run_dir: Path, uri: Any) -> Optional[str]:
    rank = engines.learner_rank_of(exc) if engines is not None else None
    if rank is None:
        return None
    from stapoctl.checkpoint import latest_step_dir
    from stapoctl.launch.actor_errors import describe_actor_death

    last = latest_step_dir(run_dir)
    where = f"from {last.name}" if last else "from the start (no checkpoint yet)"
    return (f"learner rank {rank} died ({describe_actor_death(exc)}): the run is FAILED; resume "
            f"{where} with `stapoctl train resume={run_id}`")


def _remote_failure(engines, exc: BaseException, run_id: str, run_dir: Path, uri: Any, step: int) -> Optional[str]:
    from stapoctl.launch.actor_errors import remote_error

    err = remote_error(exc)
    if err is None:
        return None
    doing = _doing(err.method, step)
    kept = keep_stack(run_dir, step, f"{_actor_name(engines, err.actor_id)}, {err.method}()", err.stack)
    return (f"{doing} failed in {_actor_name(engines, err.actor_id)} ({err.cause}; its stack: {kept}): "
            f"the run is FAILED; {resume_hint(run_dir, run_id, uri)}")


def _actor_name(engines, actor_id: str) -> str:
    for role, handles in (("learner rank", getattr(engines, "learners", [])),
                          ("rollout actor", getattr(engines, "workers", []))):
        for i, h in enumerate(handles):
            if actor_id and getattr(h, "_actor_id", None) is not None and h._actor_id.hex() == actor_id:
                return f"{role} {i}"
    return "an engine actor"


def keep_stack(run_dir: Path, step: int, what: str, stack: str) -> str:
    """The remote stack appended to `<run_dir>/errors.log` and sent to the MLflow run; where it is."""
    from stapoctl.tracking.metric_buffer import active

    path = Path(run_dir) / ERRORS_LOG
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    text = f"=== {stamp} step {step}: {what} raised\n{stack.rstrip()}\n"
    try:
        with open(path, "a") as f:
            f.write(text)
        where = str(path)
    except OSError:  # e.g. the disk that failed the save: MLflow still has it
        where = ""
    buffer = active()
    artifact = f"errors/step_{step:06d}.txt"
    if buffer is not None:
        buffer.log_text(text, artifact)
        where = f"{where} and MLflow {artifact}" if where else f"MLflow {artifact}"
    return where or "not kept (the run dir cannot be written)"
