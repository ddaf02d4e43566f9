"""Set-up of a run, before its first step: the config checked (and, on resume, the run's own
config restored), the run directory and starting model, the engines, and the data they train on.

The driver's own set-up (tokenizer, prompts, validation sets, MLflow) runs on a thread while Ray
and the engine actors start (`start_engines_and_data`), so the two overlap.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from stapoctl.errors import AlarmStopped


def check_config(conf: DictConfig, *, here: bool = True) -> None:
    """Everything that would otherwise fail minutes in, inside an actor (see `config.validate`).
    `here=False` (a job submitted elsewhere): the hub cache is checked by the job where it runs."""
    from stapoctl.preflight.commands import validate_train

    validate_train(conf, hub=here)


def resolve_policy(conf: DictConfig, console: Console) -> str:
    """The model to start from ("" builds or finds the cached warm-started tiny model)."""
    from stapoctl.models.resolve import resolve_model

    return str(resolve_model(str(conf.model.path or ""), conf, console=console))


def quiet_engine_logs(conf: DictConfig) -> None:
    """DeepSpeed announces its accelerator when imported (for the env snapshot): say it up front.

    A run that asks for no GPU needs DeepSpeed's CPU accelerator whatever the machine has, so
    only a GPU run imports torch to look (torch then loads on a thread while Ray starts)."""
    import os

    from stapoctl.preflight.machine import gpus_asked, local_gpus

    if not (gpus_asked(conf) and local_gpus() > 0):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def resume_config(conf: DictConfig, state: dict) -> DictConfig:
    """The run's own saved config, with the values this command line changed on top.

    `stapoctl train resume=ID` alone must continue the run as it was configured (not switch
    to the defaults); `resume=ID trainer.total_steps=200` extends it.
    """
    from stapoctl.config.compose import compose_config, to_flat_dict

    saved = state.get("config")
    if not saved:
        return conf
    defaults = to_flat_dict(compose_config([f"experiment={conf.experiment}"]))
    current = to_flat_dict(conf)
    merged = OmegaConf.create(saved)
    OmegaConf.set_struct(merged, False)
    for key, value in current.items():
        if key != "resume" and key in defaults and defaults[key] != value:
            OmegaConf.update(merged, key, value, force_add=True)
    if current.get("loss.name") != defaults.get("loss.name") and merged.loss.name != conf.loss.name:
        merged.loss = OmegaConf.to_container(conf.loss, resolve=True)  # another loss: its fields only
    merged.resume = conf.resume
    return merged


def resume_point(conf: DictConfig, console: Console,
                 warn: Callable[[str], None]) -> tuple[DictConfig, Optional[Path], dict]:
    """(config, checkpoint dir, trainer state) to start from: the config itself and no state for a
    new run; for `resume=...` the checkpoint, its state and the run's own config (checked again)."""
    from stapoctl import checkpoint

    resume_dir: Optional[Path] = None
    state: dict = {}
    if conf.resume:
        resume_dir = checkpoint.resolve_resume(str(conf.resume), conf.tracking.uri, warn=warn)
        state = checkpoint.read_trainer_state(resume_dir)
        console.print(f"resuming from {resume_dir} (step {state['step']}, MLflow run {state['mlflow_run_id']})")
        conf = resume_config(conf, state)
        check_config(conf)
    return conf, resume_dir, state


def prepare_run(conf: DictConfig, uri: str, state: dict, resume_dir: Optional[Path], console: Console,
                warn: Callable[[str], None]) -> tuple[Optional[Path], str, str]:
    """(run dir, base model, policy path) after the refusals that need no compute; a resumed run's
    dir is cleared of the partial writes of its interrupted process."""
    from stapoctl import checkpoint
    from stapoctl.preflight.run_dir import run_preflight

    if conf.trainer.mode == "async" and conf.loss.get("rollout_correction") == "off":
        warn("loss.rollout_correction=off: stale async batches are trained without an importance weight "
             "(rollout_corr/* still measures the mismatch)")
    run_dir = Path(state["run_dir"]) if state else None
    run_preflight(conf, uri, run_dir)  # before any compute: output dir, disk space, the MLflow store
    if run_dir is not None:
        checkpoint.remove_partial_writes(run_dir, warn=warn)
    base_model = state["base_model"] if state else _starting_model(resolve_policy(conf, console), console)
    policy_path = str(resume_dir / "model") if resume_dir else base_model
    return run_dir, base_model, policy_path


def _starting_model(model: str, console: Console) -> str:
    """A starting model that is a run's checkpoint is copied out first: that run's retention may
    delete it while this run still reads it (its KL reference, a restarted rollout actor)."""
    from stapoctl.trainer import run_files

    copy = run_files.starting_model(model)
    if copy != model:
        console.print(f"starting model {model} is a checkpoint, which its run's trainer.keep_checkpoints may delete: "
                      f"this run reads its copy {copy}", markup=False)
    return copy


def start_engines_and_data(conf: DictConfig, policy_path: str, console: Console, uri: str, session: Any,
                           stop, base_model: Optional[str] = None) -> TrainData:
    """Ray and the engine actors start (`session.prepare`) while a thread does the driver's set-up.
    `base_model`: the run's initial policy, the KL term's frozen reference (a resumed run starts
    from another checkpoint)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stapoctl-setup") as pool:
        # the driver's own set-up (2-3 s here) on a thread while this one starts Ray and the engine
        # actors, mostly waiting on Ray's processes: it overlaps Ray's start instead of competing
        # with the actors' vLLM and DeepSpeed imports for the cores (vLLM actor up in 5 s, was 6-7)
        setup = pool.submit(_driver_setup, conf, policy_path, console, uri)
        session.prepare(conf, policy_path, base_model)
        stop.install()  # ray.init replaced our SIGTERM handler
        return setup.result()


def prompt_sampler(conf: DictConfig, data: TrainData, state: dict):
    """The seeded prompt sampler; a resumed run's continues where its checkpoint left it, and the
    driver's RNGs are restored with it."""
    from stapoctl import checkpoint
    from stapoctl.trainer.sampler import PromptSampler

    sampler = PromptSampler(len(data.prompt_ids), int(conf.data.train_batch_size),
                            seed=int(conf.data.seed), shuffle=bool(conf.data.shuffle))
    if state:
        sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state.get("rng", {}))
    return sampler


@dataclass
class TrainData:
    """Everything the loop reads per step, tokenised once."""

    tokenizer: Any
    prompt_ids: list
    answers: list[str]
    questions: list[str]
    val_sets: dict  # bench → (eval Problems, k)
    kinds: list | None = None  # each prompt's answer kind (data prep's `answer_kind`); None: each gold's form


def prepare_data(conf: DictConfig, tokenizer_path: str, console: Console) -> TrainData:
    from stapoctl.data.prompts import TRAIN_DATA, load_rows, tokenize_prompts
    from stapoctl.data.templates import load_tokenizer
    from stapoctl.trainer.engine_settings import max_model_len

    tokenizer = load_tokenizer(str(tokenizer_path))
    rows = load_rows(TRAIN_DATA.get(conf.data.name, conf.data.name), conf, tokenizer_path)
    ids, rows = tokenize_prompts(rows, tokenizer, int(conf.data.max_prompt_length), "training", console)
    val_sets = validation_sets(conf, tokenizer, tokenizer_path, max_model_len(conf, tokenizer_path))
    return TrainData(tokenizer, ids, [str(r["answer"]) for r in rows],
                     [str(r.get("problem", r["prompt"])) for r in rows], val_sets,
                     [r.get("answer_kind") for r in rows])


def _driver_setup(conf: DictConfig, policy_path: str, console: Console, uri: str) -> TrainData:
    """Tokenizer, prompts and validation sets, the MLflow and torch imports and the store opened
    (a new sqlite store creates its tables here): everything the driver needs before its run
    starts, loaded while Ray and the actors start (nothing before `ray.init` imports torch)."""
    from stapoctl.launch.import_gc import paused_gc

    with paused_gc("mlflow"):
        import mlflow  # noqa: F401  (the driver's heaviest import)
    with paused_gc("torch"):
        import torch  # noqa: F401  (the step loop's; else its first use pays it before step 1)
    if uri.startswith("sqlite:"):  # a server is only asked when the run opens, under its fail-fast limits
        try:
            from stapoctl.tracking.store_init import client

            client(uri).get_experiment_by_name(str(conf.tracking.experiment))
        except Exception:  # opening the run reports a store that does not answer, with its fix
            pass
    return prepare_data(conf, policy_path, console)


def validation_sets(conf: DictConfig, tokenizer, tokenizer_path: str, model_len: int) -> dict:
    """bench → (problems, k) for periodic validation; empty when eval.every_n_steps is 0."""
    if int(conf.eval.every_n_steps or 0) <= 0:
        return {}
    from stapoctl.data.benches import expand_benches, samples_per_problem
    from stapoctl.data.prompts import load_rows
    from stapoctl.eval.runner import prepare_problems

    out = {}
    for bench in expand_benches(list(conf.eval.benches)):
        rows = load_rows(bench, conf, tokenizer_path)
        out[bench] = (prepare_problems(rows, tokenizer, model_len), samples_per_problem(bench, conf.eval.k))
    return out


@contextlib.contextmanager
def running_engines(conf: DictConfig, policy_path: str, resume_dir: Optional[Path], console: Console,
                    session: Any, own: bool, base_model: Optional[str] = None):
    """Engines + verifier pool for one run from `session`: kept warm across runs (a sweep's
    trials) or, when the run owns it, shut down after the run by the caller (vLLM, then Ray)."""
    try:
        engines, scorer = session.acquire(conf, policy_path, base_model)
        # what the engines say mid-run (a rollout actor restarted by Ray) goes to this run's console,
        # not to the one of the run (or sweep) that started them
        engines.say = lambda msg: console.print(msg, style="yellow", markup=False, highlight=False)
        if resume_dir:
            engines.learners.load(str(resume_dir))
        info = engines.info
        if info.get("reused"):
            console.print(f"engines reused (learner reset + weight sync in {info['reset_s']:.1f} s)")
        else:
            console.print(f"engines up in {info['engines_s']:.0f} s (vLLM {info['vllm_init_s']:.0f} s, learner "
                          f"{info['learner_setup_s']:.0f} s, in parallel); weight sync: {info['sync_method']}"
                          + ("; learner MKL: AVX-512 kernels on AMD (cluster.mkl_amd_shim)"
                             if info.get("mkl", {}).get("amd_shim") else ""))
        yield engines, scorer
    except AlarmStopped:  # a clean stop (its step ended, checkpointed): the next trial reuses the engines
        raise
    except BaseException:
        if not own:
            session.discard()  # a failed run may leave its engines mid-step
        raise
