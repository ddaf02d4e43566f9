"""`stapoctl train`: the synchronous on-policy loop of STAPO (000 Table 6) on real engines.

One step, data flowing one way:
    prompts → vLLM rollouts (RolloutBatch) → rewards → advantages → learner (recompute old
    log-probs, PPO mini-batch updates with the configured loss) → weight sync → metrics.
Every stage is one Ray call; the engines live for the whole run.

This module runs the stages of a run in order: `setup` (config, run dir, engines and data),
`run_record` (the MLflow record and summary), `loop` (steps, validation, checkpoints) driving
`step_runner` (one step).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

from omegaconf import DictConfig
from rich.console import Console

from stapoctl.errors import labelled
from stapoctl.trainer import run_files, run_record, setup
from stapoctl.trainer.faults import engine_faults
from stapoctl.trainer.loop import Loop
from stapoctl.trainer.step_runner import StepRunner


def train(conf: DictConfig, console: Optional[Console] = None, session: Any = None) -> dict:
    """Run (or resume) a training run; returns a summary (run id, run dir, first/final metrics).

    `session`: an `EngineSession` whose engines this run reuses (and leaves running).
    Raises `RunStopped` after a signal (checkpoint written, MLflow run KILLED) and `RunFailed`
    when an engine dies (MLflow run FAILED with the reason); see README "Failures and resuming".
    """
    from stapoctl.trainer.signals import GracefulStop

    from stapoctl.trainer.session import EngineSession

    console = console or Console()
    setup.check_config(conf)
    setup.quiet_engine_logs(conf)
    own = session is None
    with GracefulStop(console) as stop, (EngineSession(console) if own else contextlib.nullcontext(session)) as session:
        return _train(conf, console, session, stop, own)


def _train(conf: DictConfig, console: Console, session: Any, stop, own: bool) -> dict:
    from stapoctl.tracking import mlflow_run

    warn = lambda msg: console.print(msg, style="yellow", markup=False, highlight=False)  # noqa: E731  (paths: text)
    uri = mlflow_run.tracking_uri(conf.tracking.uri)
    console.print(labelled("MLflow store:", f"{uri}  (experiment '{conf.tracking.experiment}')", "bold"))

    conf, resume_dir, state = setup.resume_point(conf, console, warn)
    if state and int(state["step"]) >= int(conf.trainer.total_steps):
        return run_record.nothing_to_do(conf, state, uri, console)
    run_dir, base_model, policy_path = setup.prepare_run(conf, uri, state, resume_dir, console, warn)
    data = setup.start_engines_and_data(conf, policy_path, console, uri, session, stop, base_model)
    sampler = setup.prompt_sampler(conf, data, state)

    with run_record.open_record(conf, uri, state, run_dir, console) as record:
        run_id, run_dir = record.run_id, record.run_dir
        rec = record.buffer
        base = run_record.record_start(conf, record, state, resume_dir, base_model)
        console.print(f"MLflow run {run_id} · run dir {run_dir}", markup=False)
        tokenizer = run_files.tokenizer_dir(run_dir, policy_path)  # before any save can rotate policy_path out
        with engine_faults(None, run_id, run_dir, uri), setup.running_engines(  # a failed checkpoint load: one line
                conf, policy_path, resume_dir, console, session, own, base_model) as (engines, scorer):
            stop.install()  # ray.init replaced our SIGTERM handler
            engines.rollout_restarts = int(state.get("rollout_restarts", 0))
            run_record.tag_engines(rec, conf, engines)
            loop = Loop(conf, StepRunner(conf, engines, scorer, data, start_step=int(state.get("step", 0))), sampler,
                        run_id, run_dir, base_model, str(tokenizer), stop=stop, resumed_from=resume_dir)
            try:
                with record.ending(), engine_faults(engines, run_id, run_dir, uri, lambda: loop.step):
                    summary = loop.run(int(state.get("step", 0)), console)
            finally:
                stop.cleaning_up = True  # a further signal must not cut the engines' shutdown short
    return run_record.finish_summary(summary, run_id, run_dir, uri, base, rec, console)
