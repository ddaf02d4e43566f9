"""`resume=`: a readable checkpoint (dir or MLflow run id) of this same experiment."""

from __future__ import annotations

from omegaconf import DictConfig

from stapoctl.config.validate import DEFAULT_EXPERIMENT, DEFAULT_TRACKING_EXPERIMENT
from stapoctl.errors import UserError
from stapoctl.preflight.model import check_store_exists


def check_resume(conf: DictConfig) -> None:
    """`resume=` names a checkpoint (dir or MLflow run id) of this same experiment."""
    from stapoctl import checkpoint

    check_store_exists(str(conf.resume), conf, "resume")
    step_dir = checkpoint.resolve_resume(str(conf.resume), conf.tracking.uri)  # one line if nothing is there
    try:
        state = checkpoint.read_trainer_state(step_dir)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"resume={conf.resume}: {step_dir} has no readable trainer state ({type(exc).__name__}): "
                        "point resume= at a stapoctl checkpoint") from None
    saved = state.get("config") or {}
    # experiment / tracking.experiment at their defaults mean "continue the run as it was"
    for key, current, default, then in (
        ("experiment", conf.experiment, DEFAULT_EXPERIMENT, saved.get("experiment")),
        ("tracking.experiment", conf.tracking.experiment, DEFAULT_TRACKING_EXPERIMENT,
         (saved.get("tracking") or {}).get("experiment")),
    ):
        if then and current != default and current != then:
            raise UserError(
                f"resume={conf.resume} is a run of {key}={then}, not {key}={current}: drop {key}= to continue "
                "that run, or drop resume= to start a new one"
            )
