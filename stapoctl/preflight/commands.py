"""What `stapoctl train` and `stapoctl eval` need from the disk and this machine, checked before
any MLflow run, run dir or Ray exists: the config itself (`config.validate`), then `resume=`,
the machine, the datasets and the model. Each failure is one line (`UserError`, exit 2).

A hub id is checked against the local HF cache, and refused only when it is missing there and
the hub is offline (`preflight.hub`); a remote Ray/SLURM cluster is checked where it is reached
(`launch.placement.make_placement`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from omegaconf import DictConfig

from stapoctl.config.validate import validate_config
from stapoctl.errors import UserError
from stapoctl.preflight.dataset import check_dataset, train_dataset
from stapoctl.preflight.hub import check_hub_model
from stapoctl.preflight.machine import check_machine
from stapoctl.preflight.memory_plan import enforce_plan
from stapoctl.preflight.model import check_model
from stapoctl.preflight.resume import check_resume


def validate_train(conf: DictConfig, *, hub: bool = True, console=None) -> None:
    """Everything `stapoctl train` needs, checked before an MLflow run, a run dir or Ray exists."""
    validate_config(conf)
    if conf.resume:
        check_resume(conf)
    check_machine(conf)
    check_dataset(conf, train_dataset(conf), hub=hub)
    if int(conf.eval.every_n_steps or 0) > 0:  # periodic validation reads the benchmarks too
        from stapoctl.data.benches import expand_benches

        try:
            benches = expand_benches(list(conf.eval.benches))
        except UserError as exc:
            raise UserError(f"eval.benches: {str(exc).removeprefix('--bench ')}") from None
        for bench in benches:
            check_dataset(conf, bench, flag="eval.benches", hub=hub)
    if conf.model.path and not conf.resume:
        check_model(conf, str(conf.model.path), "model.path", context_key="rollout.max_response_length")
    elif conf.model.path and float(conf.loss.get("kl_coef") or 0) > 0:
        # a resumed run starts from its checkpoint, but its KL reference is still the base model
        check_model(conf, str(conf.model.path), "model.path (the frozen reference of loss.kl_coef > 0)")
    if hub:  # submitted: the job checks the hub cache where it runs (its node's cache and network)
        if conf.model.path and (not conf.resume or float(conf.loss.get("kl_coef") or 0) > 0):
            check_hub_model(str(conf.model.path), "model.path")
        if conf.reward.get("model_verifier"):
            check_hub_model(str(conf.reward.model_verifier), "reward.model_verifier")
    enforce_plan(conf, here=hub, console=console)


def validate_eval(conf: DictConfig, model: str, benches: Sequence[str], k: Optional[int] = None) -> None:
    """`stapoctl eval`: the model, every benchmark file and the rollout workers' placement."""
    from stapoctl.data.benches import samples_per_problem

    check_machine(conf, learner=False)
    for bench in benches:
        samples_per_problem(bench, k)
        check_dataset(conf, bench, flag="--bench")
    if model:
        key = "--model" if model != str(conf.model.path or "") else "model.path"
        check_model(conf, model, key)
        check_hub_model(model, key)
    if conf.reward.get("model_verifier"):  # the judge scores evaluation answers too
        check_hub_model(str(conf.reward.model_verifier), "reward.model_verifier")
