"""The run's typed loss config, built once, and the one way a method registered at run time joins
the table of loss configs.

`build_loss_config(conf.loss)` turns the `loss` group into the registered dataclass (its ranges,
choices and cross-field rules checked by its `__post_init__`). The driver builds it once per run
(`trainer.step_runner.StepRunner`) and hands that object to the advantages, the drift, the token
diagnostics and the inert knobs; each learner rank builds its own once at set-up and at every reset,
after it has (re)imported `loss.modules`, from the `loss` dict the driver ships (an instance of a
researcher's class would be unpickled before the rank had put that module on its `sys.path`, and
of the class from before a reload).

`LOSS_CONFIGS` (`config.losses`) declares the built-ins; `stapoctl.losses.register_loss` adds a
method registered at run time through `add_loss_config`, so `config/` owns every write to its table.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping, Optional

from stapoctl.config.losses import LOSS_CONFIGS
from stapoctl.errors import UserError


def loss_config_class(name: str) -> Optional[type]:
    """The config class of loss `name` (None for a loss this process does not know)."""
    return LOSS_CONFIGS.get(str(name))


def registered_class(name: str) -> type:
    """The config class of loss `name`; a name no loss registered is one line naming the field."""
    config_cls = loss_config_class(name)
    if config_cls is None:
        raise UserError(f"loss.name={name}: not a registered loss (see `stapoctl losses`; your own methods "
                        "go in loss.modules)")
    return config_cls


def add_loss_config(name: str, config_cls: type) -> None:
    """Make `loss=NAME` an option for composing (`config.compose.register_configs` stores it); a
    name added again (a reloaded `loss.modules` module) gets the new class."""
    first = fields(config_cls)[0]
    if first.name != "name" or first.default != name:
        raise TypeError(f"{config_cls.__name__}: first field must be name: str = {name!r}")
    if LOSS_CONFIGS.get(name) is not config_cls:
        LOSS_CONFIGS[name] = config_cls


def _as_dict(loss: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(loss):
        return dict(OmegaConf.to_container(loss, resolve=True))
    return dict(loss)


def build_loss_config(loss: Mapping[str, Any] | Any) -> Any:
    """The registered dataclass instance of a `loss` group (a DictConfig or a dict of its fields).

    A name no loss registered, or a key its config lacks, is one line naming the field; a value out
    of range raises the config's own ValueError (`config.validate` words it for a user's config)."""
    values = _as_dict(loss)
    name = str(values.get("name", ""))
    config_cls = registered_class(name)
    names = {f.name for f in fields(config_cls)}
    unknown = sorted(k for k in values if k not in names)
    if unknown:
        raise UserError(f"loss.{unknown[0]}: loss={name} has no such field: remove it")
    return config_cls(**values)
