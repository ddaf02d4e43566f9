"""Compose a run's config from an experiment file plus Hydra command-line overrides.

We call Hydra's compose API rather than `@hydra.main` so the CLI (Typer) owns argument
parsing and errors stay one line. `experiment=NAME` picks the primary config file in
`experiments/`; every other override is plain Hydra (`loss=grpo`, `loss.tau_p=2e-3`,
`+rollout.resources.X=1`). Hydra's append form `+key=value` (and `++`) would add any key silently, so
a typo in it trained with the default: here a `+` key must name a field of the schema (or of the
selected loss) or a new key of a map field, and `+` on a declared field is a plain override.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import fields, is_dataclass
from typing import Any, Iterable

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from stapoctl import paths
from stapoctl.errors import UserError
from stapoctl.config import overrides as ov
from stapoctl.config import schema as S
from stapoctl.config.shapes import QWEN3_SHAPES, preset_name


class ConfigError(UserError):
    """A user-facing, one-line configuration error (the CLI prints it without a traceback)."""


# model=qwen3_8b etc.: one preset per model of the shapes table (config/shapes.py)
HF_MODELS = {preset_name(hub_id): hub_id for hub_id in QWEN3_SHAPES}

_registered = False
_stored_losses: dict[str, type] = {}  # loss name → the config class its ConfigStore node was made from


def _map_fields(node: Any = S.StapoctlConfig, prefix: str = "") -> tuple[str, ...]:
    """Dotted names of the schema's map fields (`Dict[...]`): their keys are the user's to add."""
    out: list[str] = []
    for f in fields(node):
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if not prefix and f.name in S.GROUP_SCHEMAS:
            default = S.GROUP_SCHEMAS[f.name]()
        if isinstance(default, dict):
            out.append(prefix + f.name)
        elif is_dataclass(default):
            out.extend(_map_fields(default, f"{prefix}{f.name}."))
    return tuple(out)


DICT_FIELDS = _map_fields()  # rollout.resources, learner.resources, tracking.tags


def register_configs() -> None:
    """Put every typed node into Hydra's ConfigStore: once, and a loss registered (or re-registered
    by a reload) since the last call (`loss.modules`: a method of the researcher's own)."""
    global _registered
    from stapoctl.config.losses import LOSS_CONFIGS  # torch-free: not the loss library itself

    cs = ConfigStore.instance()
    for name, config_cls in LOSS_CONFIGS.items():
        if _stored_losses.get(name) is not config_cls:
            cs.store(group="loss", name=name, node=config_cls())
            _stored_losses[name] = config_cls
    if _registered:
        return
    cs.store(name="stapoctl", node=S.StapoctlConfig)
    cs.store(group="model", name="tiny", node=S.ModelConfig())
    for name, hf_id in HF_MODELS.items():
        cs.store(group="model", name=name, node=S.ModelConfig(name=name, path=hf_id, dtype="bfloat16"))
    cs.store(group="data", name="toy", node=S.DataConfig())
    cs.store(
        group="data",
        name="dapo_math_17k",
        node=S.DataConfig(name="dapo-math-17k", train_batch_size=256, max_prompt_length=1024),
    )
    for group, node in (
        ("rollout", S.RolloutConfig),
        ("learner", S.LearnerConfig),
        ("reward", S.RewardConfig),
        ("eval", S.EvalConfig),
        ("tracking", S.TrackingConfig),
        ("trainer", S.TrainerConfig),
        ("plan", S.PlanConfig),
    ):
        cs.store(group=group, name="default", node=node())
    for name in ("local", "ray", "slurm"):
        cs.store(group="cluster", name=name, node=S.ClusterConfig(name=name))
    _registered = True


def available_experiments() -> list[str]:
    root = paths.experiments_dir()
    return sorted(p.stem for p in root.glob("*.yaml")) if root.is_dir() else []


def group_options(group: str) -> list[str]:
    register_configs()
    return sorted(
        name.removesuffix(".yaml") for name in ConfigStore.instance().list(group)
    )


def _closest(word: str, candidates: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.5)
    return found[0] if found else None


def _valid_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys a user may override (from the dataclass schema, so it works before compose)."""
    out: list[str] = []
    for f in fields(node):
        if f.name == "defaults":
            continue
        key = f"{prefix}{f.name}"
        out.append(key)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if not prefix and f.name in S.GROUP_SCHEMAS:
            default = S.GROUP_SCHEMAS[f.name]()
        if is_dataclass(default):
            out.extend(_valid_keys(default, key + "."))
    return out


def _rewrite(overrides: list[str]) -> tuple[str, list[str]]:
    """Pull out `experiment=`; turn `model=<HF id or path>` into `model.path=...`."""
    experiment = "tiny"
    rest: list[str] = []
    model_options = set(HF_MODELS) | {"tiny"}
    for item in overrides:
        o = ov.parse(item)  # bad syntax: one line here, before Hydra's three
        key, value, plain = o.key, o.value, o.kind == ov.SET and o.package is None
        if plain and key == "experiment":
            experiment = value
        elif plain and key == "model" and value not in model_options:
            rest.append(f"model.path={value}")
            rest.append(f"model.name={value.rstrip('/').split('/')[-1]}")
            rest.append("model.dtype=bfloat16" if "/" in value and not value.startswith((".", "/")) else "model.dtype=float32")
        elif o.kind == ov.ADD and key in _declared_keys():
            rest.append(item.lstrip()[1:])  # Hydra refuses to append an existing key: set it
        else:
            rest.append(item)
    return experiment, rest


def _declared_keys() -> set[str]:
    """Dotted keys declared by the schema or by any registered loss's config."""
    from stapoctl.config.losses import LOSS_CONFIGS

    keys = {k for k in _valid_keys(S.StapoctlConfig) if "." in k}
    return keys | {f"loss.{k}" for cls in LOSS_CONFIGS.values() for k in _valid_keys(cls)}


def _unknown_key(bad: str, valid: Iterable[str], loss_cls: type | None) -> ConfigError:
    """'unknown config key' with the nearest valid one; a field of other losses says which have it."""
    from stapoctl.config.losses import LOSS_CONFIGS

    if bad.startswith("loss.") and loss_cls is not None:
        owners = [n for n, c in LOSS_CONFIGS.items() if bad[5:] in {f.name for f in fields(c)}]
        if owners:
            name = next(f.default for f in fields(loss_cls) if f.name == "name")
            return ConfigError(f"unknown config key '{bad}': loss={name} has no such field "
                               f"(it is a field of loss={'|'.join(owners)})")
    near = _closest(bad, sorted(set(valid)))
    hint = f"; did you mean '{near}'?" if near else ""
    return ConfigError(f"unknown config key '{bad}'{hint}")


def _refuse_unknown_appends(cfg: DictConfig, overrides: list[str]) -> None:
    """`+key=value` / `++key=value` naming no field: Hydra added it and nothing reads it (a
    `+trainer.total_stepz=5` trained the default 60 steps), so it is refused like a typo. Allowed:
    the fields of the schema and of the selected loss, and new keys of a map field (DICT_FIELDS)."""
    from stapoctl.config.losses import LOSS_CONFIGS

    appended = [o.key for o in ov.parse_all(overrides) if o.kind in (ov.ADD, ov.FORCE_ADD)]
    if not appended:
        return
    loss_cls = LOSS_CONFIGS.get(str(cfg.loss.get("name", "")))
    valid = _valid_keys(S.StapoctlConfig) + (["loss." + k for k in _valid_keys(loss_cls)] if loss_cls else [])
    for key in appended:
        if key not in valid and not any(key.startswith(m + ".") for m in DICT_FIELDS):
            raise _unknown_key(key, valid, loss_cls)


def _loss_schema(experiment: str, overrides: list[str], bad_key: str) -> type:
    """The config class of the loss this run selects (compose again without the bad key)."""
    from stapoctl.config.losses import LOSS_CONFIGS

    rest = ov.drop(overrides, [bad_key])
    try:
        with initialize_config_dir(config_dir=str(paths.experiments_dir()), version_base="1.3"):
            name = compose(config_name=experiment, overrides=rest).loss.name
    except Exception:
        name = "stapo"
    finally:
        GlobalHydra.instance().clear()
    return LOSS_CONFIGS.get(name, LOSS_CONFIGS["stapo"])


def _explain(exc: Exception, experiment: str, overrides: list[str]) -> ConfigError:
    """Hydra's messages are multi-line and name internals; say which key and what to write."""
    msg = str(exc)
    m = re.search(r"Key '([^']+)' not in '(\w+)'", msg) or re.search(
        r"Could not override '([^']+)'", msg
    )
    if "Could not find 'experiment" in msg or "Cannot find primary config" in msg:
        near = _closest(experiment, available_experiments())
        hint = f"; did you mean '{near}'?" if near else ""
        return ConfigError(
            f"experiment '{experiment}' not found in {paths.experiments_dir()}{hint} "
            f"(available: {', '.join(available_experiments())})"
        )
    m_group = re.search(r"Could not find '(\w+)/([^']+)'", msg)
    if m_group:
        group, option = m_group.groups()
        options = group_options(group)
        near = _closest(option, options)
        hint = f" did you mean '{group}={near}'?" if near else ""
        own = "; a method of your own module: name it on the command line, loss.modules=[my_pkg.my_losses]" \
            if group == "loss" else ""
        return ConfigError(f"unknown option '{group}={option}':{hint} (options: {', '.join(options)}){own}")
    bad = None
    for item in overrides:
        key = ov.key_of(item)
        if m and (m.group(1) == key or key.endswith("." + m.group(1)) or m.group(1) in key):
            bad = key
            break
    if bad is not None:
        valid = _valid_keys(S.StapoctlConfig) + [
            "loss." + k for k in _valid_keys(_loss_schema(experiment, overrides, bad))
        ]
        parent = bad.rpartition(".")[0]
        if parent in DICT_FIELDS:  # a map of user keys (e.g. custom Ray resources): new keys need '+'
            value = next(o.value for o in ov.parse_all(overrides) if o.key == bad)
            return ConfigError(f"'{bad}' adds a key to the map {parent}: write +{bad}={value}")
        return _unknown_key(bad, valid, _loss_schema(experiment, overrides, bad))
    cause = exc.__cause__ or exc.__context__
    m_del = re.search(r"Error merging override (~\S+)", msg)
    if m_del and "does not support deletion" in str(cause):
        key = ov.key_of(m_del.group(1))
        return ConfigError(f"'{m_del.group(1)}': {key} is a field of the schema and cannot be deleted (~ deletes "
                           f"a key of a map such as tracking.tags, or a defaults-list entry): set it, {key}=VALUE")
    detail = str(cause).strip().splitlines()[0] if cause and str(cause).strip() else ""
    first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
    return ConfigError(f"bad configuration: {first}" + (f" ({detail})" if detail else ""))


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The resolved, typed config for `stapoctl train|eval|sweep` with these overrides."""
    from stapoctl.config.loss_modules import import_modules, requested

    import_modules(requested(overrides or []))  # before compose: `loss=NAME` of such a module is an option
    register_configs()
    experiment, rest = _rewrite(list(overrides or []))
    if experiment not in available_experiments():
        raise _explain(Exception("Cannot find primary config"), experiment, rest)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(paths.experiments_dir()), version_base="1.3"):
            cfg = compose(config_name=experiment, overrides=rest)
    except Exception as exc:  # Hydra/OmegaConf raise several types; all are user input errors
        raise _explain(exc, experiment, rest) from exc
    missing = sorted(OmegaConf.missing_keys(cfg))  # `~loss` drops the group's option: Hydra allows it
    if missing:
        raise ConfigError(f"'{missing[0]}' has no value (a ~ delete removed it): choose one, e.g. "
                          f"{missing[0]}={(group_options(missing[0]) or ['VALUE'])[0]}")
    OmegaConf.set_struct(cfg, False)
    cfg.experiment = experiment
    OmegaConf.set_struct(cfg, True)
    _refuse_unknown_appends(cfg, rest)
    _renamed_keys(cfg)
    _local_model_dtype(cfg, list(overrides or []))
    validate(cfg)
    return cfg


def _local_model_dtype(cfg: DictConfig, overrides: list[str]) -> None:
    """`model=./dir` or `model=/path` trains in float32 on CPU, as the embedded model does, but in
    bfloat16 when the run asks for GPUs, as a hub id does (fp32 there is twice the memory and no bf16
    kernels). An explicit `model.dtype=` wins."""
    from stapoctl.config.validate import asks_gpus

    given = {o.key: o.value for o in ov.parse_all(overrides) if o.kind == ov.SET and o.package is None}
    local = str(given.get("model", "")).startswith((".", "/"))
    if local and "model.dtype" not in given and asks_gpus(cfg):
        cfg.model.dtype = "bfloat16"


def _renamed_keys(cfg: DictConfig) -> None:
    """Keys that moved keep working for one more release, with a one-line notice on stderr."""
    cap = cfg.trainer.get("is_cap")
    if cap is not None and "rollout_is_cap" in cfg.loss:
        import sys

        cfg.loss.rollout_is_cap = cap
        cfg.trainer.is_cap = None
        print(f"stapoctl: trainer.is_cap is now loss.rollout_is_cap (using loss.rollout_is_cap={cap})",
              file=sys.stderr)


def validate(cfg: DictConfig) -> None:
    """Declared field ranges and cross-field rules (`config.validate`), one line per problem."""
    from stapoctl.config.validate import validate_config

    validate_config(cfg)


def to_flat_dict(cfg: DictConfig) -> dict[str, Any]:
    """Dotted key → value, the form MLflow params take."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out
