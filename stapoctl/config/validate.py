"""Every check that refuses a run before anything starts, each failing as one line naming the
field and the fix (`UserError`; the CLI prints it and exits 2).

`validate_config` — the config alone: the range or choices each schema and loss field declares
  (`config.fields`), then the cross-field rules. Run by `compose_config`, so `--cfg job`, train,
  eval and data prep all refuse the same things.
`validate_train` / `validate_eval` — what the disk and this machine must provide: the model
  (a causal LM with a tokenizer, a chat template when data.template=chat, a context that holds
  prompt + response), the dataset files, `resume=`, GPUs and a placement that fits. `train`
  calls it before any MLflow run, run dir or Ray exists; `eval` before its output dir or Ray.

Only what can be known locally is checked: a hub id or a remote Ray/SLURM cluster is checked
where it is reached (download, `launch.placement.make_placement`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from stapoctl.config.fields import default_of, problems
from stapoctl.errors import UserError

DEFAULT_EXPERIMENT = "tiny"
DEFAULT_TRACKING_EXPERIMENT = "stapoctl"


def _fmt(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _field_error(key: str, cls: type, name: str, value: Any, why: str) -> UserError:
    hint = ""
    if why.startswith("must lie"):
        default = default_of(cls, name)
        if default is not None:
            hint = f": e.g. {key}={_fmt(default)} (the default)"
    return UserError(f"{key}={_fmt(value)} {why}{hint}")


# -- the config alone ------------------------------------------------------------------------------
def validate_config(conf: DictConfig) -> None:
    """Declared ranges and choices of every field, then the cross-field rules."""
    from stapoctl.config.compose import GROUP_SCHEMAS

    for group, cls in GROUP_SCHEMAS.items():
        for name, value, why in problems(cls, conf[group]):
            raise _field_error(f"{group}.{name}", cls, name, value, why)
    _check_loss(conf.loss)
    _check_cross_fields(conf)


def _check_loss(loss: DictConfig) -> None:
    from stapoctl.config.losses import LOSS_CONFIGS

    config_cls = LOSS_CONFIGS.get(str(loss.name))
    if config_cls is None:  # Hydra already refuses an unknown loss=NAME; a hand-made config may not
        raise UserError(f"loss.name={loss.name}: not a registered loss (see `stapoctl losses`)")
    for name, value, why in problems(config_cls, loss):
        raise _field_error(f"loss.{name}", config_cls, name, value, why)
    values = OmegaConf.to_container(loss, resolve=True)
    try:
        config_cls(**values)  # the loss's own cross-field rules (clip floor <= ceiling, ...)
    except (ValueError, TypeError) as exc:
        names = "|".join(re.escape(k) for k in values)
        message = re.sub(rf"^{re.escape(str(loss.name))}: ", "", str(exc).splitlines()[0])
        message = re.sub(rf"(?<![\w.])({names})=", r"loss.\1=", message)
        raise UserError(f"loss={loss.name}: {message}") from None


def learner_ranks(learner: Any) -> int:
    """Data-parallel learner ranks (`learner.num_ranks`; before it existed, one per GPU)."""
    ranks = learner.get("num_ranks", None)
    if ranks is None:
        ranks = max(1, int(learner.get("num_gpus", 0) or 0))
    return max(1, int(ranks))


def _check_cross_fields(conf: DictConfig) -> None:
    d, r, lrn = conf.data, conf.rollout, conf.learner
    if d.train_batch_size % lrn.ppo_mini_batch_size:
        raise UserError(
            f"data.train_batch_size={d.train_batch_size} is not a multiple of "
            f"learner.ppo_mini_batch_size={lrn.ppo_mini_batch_size}: make the mini-batch divide the batch"
        )
    mini_rows, ranks = lrn.ppo_mini_batch_size * r.n, learner_ranks(lrn)
    if mini_rows > lrn.micro_batch_size * ranks and mini_rows % (lrn.micro_batch_size * ranks):
        raise UserError(
            f"learner.ppo_mini_batch_size={lrn.ppo_mini_batch_size} × rollout.n={r.n} = {mini_rows} sequences "
            f"do not split into micro-batches of learner.micro_batch_size={lrn.micro_batch_size} × {ranks} "
            "rank(s): make the micro-batch divide the mini-batch"
        )
    if lrn.get("offload_optimizer") and int(lrn.zero_stage) < 1:
        raise UserError("learner.offload_optimizer=true needs learner.zero_stage >= 1 (ZeRO-Offload)")
    t = conf.trainer
    if t.get("mode") == "async" and r.get("old_logprob_source") == "rollout":
        raise UserError("trainer.mode=async needs rollout.old_logprob_source=recompute (or auto): the decoupled "
                        "objective's proximal policy is the learner's own, vLLM's log-probs are the stale one's")
    if str(r.weight_sync) in ("nccl", "ipc") and not _asks_gpus(conf):
        raise UserError(f"rollout.weight_sync={r.weight_sync} needs GPUs; on CPU use auto or object_store")
    if not conf.model.path:  # the embedded model: its context is in the config
        _check_context(conf, int(conf.model.tiny.max_position_embeddings), "model.tiny.max_position_embeddings")


def _check_context(conf: DictConfig, context: int, where: str) -> None:
    want = int(conf.data.max_prompt_length) + int(conf.rollout.max_response_length)
    if want > context:
        raise UserError(
            f"rollout.max_response_length={conf.rollout.max_response_length} + data.max_prompt_length="
            f"{conf.data.max_prompt_length} = {want} tokens exceed the model's context of {context} ({where}): "
            "lower rollout.max_response_length"
        )


def _asks_gpus(conf: DictConfig) -> bool:
    return (float(conf.rollout.gpus_per_worker or 0) > 0 or float(conf.learner.get("gpus_per_rank", 0) or 0) > 0
            or float(conf.learner.get("num_gpus", 0) or 0) > 0)


# -- what the disk and the machine must provide -------------------------------------------------------
def validate_train(conf: DictConfig) -> None:
    """Everything `stapoctl train` needs, checked before an MLflow run, a run dir or Ray exists."""
    validate_config(conf)
    if conf.resume:
        check_resume(conf)
    check_machine(conf)
    check_dataset(conf, _train_dataset(conf))
    if int(conf.eval.every_n_steps or 0) > 0:  # periodic validation reads the benchmarks too
        from stapoctl.eval.benches import expand_benches

        try:
            benches = expand_benches(list(conf.eval.benches))
        except UserError as exc:
            raise UserError(f"eval.benches: {str(exc).removeprefix('--bench ')}") from None
        for bench in benches:
            check_dataset(conf, bench, flag="eval.benches")
    if conf.model.path and not conf.resume:
        check_model(conf, str(conf.model.path), "model.path", context_key="rollout.max_response_length")


def validate_eval(conf: DictConfig, model: str, benches: Sequence[str], k: Optional[int] = None) -> None:
    """`stapoctl eval`: the model, every benchmark file and the rollout workers' placement."""
    from stapoctl.eval.benches import samples_per_problem

    check_machine(conf, learner=False)
    for bench in benches:
        samples_per_problem(bench, k)
        check_dataset(conf, bench, flag="--bench")
    if model:
        check_model(conf, model, "--model" if model != str(conf.model.path or "") else "model.path")


def _train_dataset(conf: DictConfig) -> str:
    from stapoctl.data.sources import canonical_name

    try:
        name = canonical_name(str(conf.data.name))
    except UserError as exc:
        raise UserError(f"data.name={conf.data.name}: {exc}") from None
    return "toy-train" if name == "toy" else name


# placement and devices
def gpus_asked(conf: DictConfig, *, learner: bool = True) -> list[tuple[str, Any]]:
    """The (key, value) pairs of the config that ask for GPUs."""
    gpu_fields = [("rollout.gpus_per_worker", conf.rollout.gpus_per_worker)]
    if learner:
        gpu_fields.append(("learner.gpus_per_rank", conf.learner.get("gpus_per_rank", 0)))
    if conf.reward.model_verifier:
        gpu_fields.append(("reward.model_verifier_gpus", conf.reward.model_verifier_gpus))
    return [(k, v) for k, v in gpu_fields if float(v or 0) > 0]


def check_machine(conf: DictConfig, *, learner: bool = True) -> None:
    """GPUs asked for on a machine without one; a local placement that can never fit."""
    c = conf.cluster
    if c.name != "local" or c.address:
        return  # a Ray cluster or SLURM job: checked where the resources are (make_placement)
    asked = gpus_asked(conf, learner=learner)
    # counting GPUs imports torch (~1 s, then off `stapoctl train`'s path to Ray): without a GPU
    # asked for, the count changes no check
    gpus = local_gpus() if asked else 0
    if asked and gpus == 0:
        names = " ".join(f"{k}=0" for k, _ in asked)
        raise UserError(
            f"{asked[0][0]}={_fmt(asked[0][1])} asks for GPUs, but this machine has none (torch.cuda."
            f"is_available() is False): set {names} to run on CPU, or run where GPUs are (cluster=slurm)"
        )
    from stapoctl.launch.placement import check_fits, role_plans

    cpus = float(c.num_cpus or os.cpu_count() or 1)
    have = {"CPU": cpus, "GPU": float(c.num_gpus if c.num_gpus is not None else gpus)}
    plans = [p for p in role_plans(conf.rollout, conf.learner) if learner or p.role == "rollout"]
    check_fits(plans, have, where="this machine")
    if conf.reward.model_verifier:
        need = sum(p.bundle.get("CPU", 0) * p.count for p in plans) + float(conf.reward.model_verifier_cpus)
        if need > cpus:
            raise UserError(
                f"the run needs {need:g} CPU with the verifier model (reward.model_verifier_cpus="
                f"{_fmt(conf.reward.model_verifier_cpus)}) and this machine has {cpus:g}: lower "
                "reward.model_verifier_cpus (e.g. 0.5) or set cluster.num_cpus"
            )


def local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


# model and tokenizer
def check_model(conf: DictConfig, spec: str, key: str, *, context_key: Optional[str] = None) -> None:
    """A local model dir (or run / checkpoint): a causal LM with weights, a tokenizer, a chat
    template when data.template=chat, and room for prompt + response in its context."""
    from stapoctl.models.resolve import resolve_model

    _check_store_exists(spec, conf, key)
    path = Path(resolve_model(spec, conf))  # one line for a missing path or an unknown run id
    if not path.is_dir():
        return  # an HF hub id: checked when it is downloaded
    config = _read_json(path / "config.json", key)
    if not _is_causal_lm(path, config):
        kind = ", ".join(config.get("architectures") or []) or config.get("model_type") or "unknown"
        raise UserError(
            f"{key}={spec}: not a causal language model ({kind} in config.json): give a causal LM, "
            "e.g. Qwen/Qwen3-8B-Base or a stapoctl checkpoint"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise UserError(f"{key}={spec}: {path} has config.json but no weights (*.safetensors or *.bin)")
    tokenizer = _load_tokenizer(path, key, spec)
    if conf.data.template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{key}={spec}: its tokenizer has no chat template and data.template=chat: set data.template=plain "
            "(base models) or add a chat template to tokenizer_config.json"
        )
    context = config.get("max_position_embeddings")
    if context_key and context:
        _check_context(conf, int(context), f"max_position_embeddings in {path / 'config.json'}")


def _read_json(path: Path, key: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}: cannot read {path} ({type(exc).__name__}): is it a model dir?") from None


def _is_causal_lm(path: Path, config: dict) -> bool:
    """The architectures config.json names (or, without any, its model_type) include a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = [str(a) for a in config.get("architectures") or []]
    if architectures:  # e.g. BertModel is not one, although model_type bert has a causal head class
        return any(a in causal or a.endswith("ForCausalLM") for a in architectures)
    return config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _load_tokenizer(path: Path, key: str, spec: str):
    from stapoctl.data.templates import load_tokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).is_file() for n in names):
        raise UserError(
            f"{key}={spec}: no tokenizer in {path} (none of {', '.join(names)}): save it beside the weights "
            "(tokenizer.save_pretrained(dir))"
        )
    try:
        return load_tokenizer(str(path))
    except UserError:
        raise UserError(f"{key}={spec}: the tokenizer files in {path} do not load: re-save the tokenizer there") from None


# datasets
def check_dataset(conf: DictConfig, name: str, flag: str = "data.name") -> None:
    """The local file a dataset is read from: present, UTF-8, not empty, with problem and answer."""
    from stapoctl.data import sources as S
    from stapoctl.data.prep import find_origin

    name = S.canonical_name(name)
    if S.SOURCES[name].kind == "toy":
        return
    source = conf.data.source if S.canonical_name(str(conf.data.name)) == name else None
    if source and not Path(str(source)).expanduser().is_file():
        raise UserError(f"data.source={source}: no such file (give a .jsonl or .parquet path, or drop data.source)")
    origin = find_origin(name, conf.data, source, include_prepped=True)
    if origin.label.startswith("hub:"):
        return  # downloaded (and checked) by `datasets` when loaded
    key = "data.source" if source else f"{flag} {name} ({origin.label})"
    _peek_rows(Path(origin.label), name, key)


def _peek_rows(path: Path, name: str, key: str, rows: int = 50) -> None:
    from stapoctl.data import sources as S

    if path.suffix.lower() not in (".jsonl", ".json", ".parquet"):
        raise UserError(f"{key}: {path} is a '{path.suffix}' file: give a .jsonl or .parquet file")
    if path.suffix.lower() in (".jsonl", ".json"):
        try:
            with open(path, encoding="utf-8") as fh:
                fh.read()
        except UnicodeDecodeError as exc:
            raise UserError(
                f"{key}: {path} is not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}): "
                "re-save it as UTF-8"
            ) from None
    first_problem = None
    try:
        for seen, (index, raw) in enumerate(S.read_file(path), start=1):
            try:
                S.normalize(S.SOURCES[name], raw, index - 1)
                return  # one usable row: the loader reports (and skips) any malformed ones
            except S.MalformedRow as exc:
                if first_problem is None:
                    columns = f" (columns: {', '.join(sorted(raw))})" if isinstance(raw, dict) else ""
                    first_problem = f"line {index}: {exc}{columns}"
            if seen >= rows:
                break
    except UserError:
        raise
    except Exception as exc:  # a parquet file that is not one, a truncated file, ...
        raise UserError(f"{key}: cannot read {path} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") from None
    if first_problem is None:
        raise UserError(f"{key}: {path} has no rows: give a file with one JSON object per line")
    raise UserError(
        f"{key}: no usable row in the first {rows} of {path}; {first_problem}: each row needs "
        "'problem' (or 'question' / chat 'prompt') and 'answer'"
    )


_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def _check_store_exists(spec: str, conf: DictConfig, key: str) -> None:
    """A run id looked up in a sqlite store that does not exist: say so instead of creating it."""
    if not _RUN_ID.match(spec.strip()) or Path(spec).expanduser().exists():
        return
    from stapoctl.tracking.mlflow_run import tracking_uri

    uri = tracking_uri(conf.tracking.uri)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise UserError(
            f"{key}={spec}: no such run, the MLflow store {uri} does not exist; set tracking.uri "
            "(or MLFLOW_TRACKING_URI) to the store the run was logged in"
        )


# resume
def check_resume(conf: DictConfig) -> None:
    """`resume=` names a checkpoint (dir or MLflow run id) of this same experiment."""
    from stapoctl.trainer import checkpoint

    _check_store_exists(str(conf.resume), conf, "resume")
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
