"""Site presets for SLURM (`cluster/slurm/<name>.yaml`): partition, account, qos, nodes, GPUs and
CPUs per node, memory, time, constraint and setup lines, kept in one file per site so a command
line only says `cluster=slurm cluster.preset=NAME`. Values given on the command line win.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import fields
from pathlib import Path
from typing import Iterable

from omegaconf import DictConfig, OmegaConf

from stapoctl import paths
from stapoctl.config import overrides as ov
from stapoctl.config.schema import ClusterConfig
from stapoctl.errors import UserError


def presets_dir() -> Path:
    """cluster/slurm/ of the checkout; STAPOCTL_SLURM_PRESETS points at a site's own folder."""
    return Path(os.environ.get("STAPOCTL_SLURM_PRESETS") or paths.project_root() / "cluster" / "slurm")


def available() -> list[str]:
    root = presets_dir()
    return sorted(p.stem for p in root.glob("*.yaml")) if root.is_dir() else []


def load(name: str) -> dict:
    path = presets_dir() / f"{name}.yaml"
    if not path.is_file():
        near = difflib.get_close_matches(name, available(), n=1, cutoff=0.5)
        hint = f" did you mean '{near[0]}'?" if near else ""
        raise UserError(
            f"cluster.preset='{name}': no such preset ({path} does not exist);{hint} "
            f"presets: {', '.join(available()) or 'none'}"
        )
    try:
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except Exception as exc:  # YAML syntax: say which file
        raise UserError(f"cluster.preset='{name}': {path} is not valid YAML ({str(exc).splitlines()[0]})") from exc
    if not isinstance(values, dict):
        raise UserError(f"cluster.preset='{name}': {path} must be a mapping of cluster fields")
    allowed = {f.name for f in fields(ClusterConfig)} - {"name", "preset"}
    for key in values:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise UserError(f"cluster.preset='{name}': unknown field '{key}' in {path}{hint}")
    return values


def _given(overrides: Iterable[str]) -> set[str]:
    return ov.keys(overrides)


def apply(conf: DictConfig, overrides: Iterable[str]) -> DictConfig:
    """conf with `cluster.preset`'s values filled in, except keys set on the command line."""
    name = conf.cluster.get("preset")
    if not name:
        return conf
    given = _given(overrides)
    values = {k: v for k, v in load(str(name)).items() if f"cluster.{k}" not in given}
    out = conf.copy()
    OmegaConf.set_struct(out, False)
    try:
        out.cluster = OmegaConf.merge(out.cluster, values)
    except Exception as exc:  # a type mismatch (nodes: two)
        raise UserError(f"cluster.preset='{name}': {str(exc).splitlines()[0]}") from exc
    OmegaConf.set_struct(out, True)
    return out
