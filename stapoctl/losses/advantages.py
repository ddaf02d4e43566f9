"""Group-relative advantages (SPEC "Advantages"; 000 Eq. 2)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stapoctl.config.losses import ADV_ESTIMATORS, STD_MODES
from .registry import LOSSES, closest, split_kwargs


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Dense 0..G-1 index of arbitrary integer group ids (order of first sorted unique)."""
    uniq, inverse = torch.unique(torch.as_tensor(group_ids).reshape(-1), return_inverse=True)
    return inverse, int(uniq.numel())


def group_standardize(
    values: Tensor, group_ids: Tensor, *, std_mode: str = "population", eps: float = 1e-6,
    divide_by_std: bool = True, valid: Tensor | None = None,
) -> Tensor:
    """(x - mean_g) / (std_g + eps) per group, in float64; exactly 0 for groups of equal values.

    ``valid`` ([N] bool) excludes rows from the statistics (their output is 0). Singletons have
    std 0 in both std modes, so they also get 0: a group with all-equal rewards has A = 0.
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"std_mode={std_mode!r} is not one of {', '.join(STD_MODES)}")
    x = torch.as_tensor(values).reshape(-1).to(torch.float64)
    idx, n_groups = group_index(torch.as_tensor(group_ids, device=x.device))
    ok = torch.ones_like(x, dtype=torch.bool) if valid is None else valid.reshape(-1).to(torch.bool)
    xv = torch.where(ok, x, 0.0)
    w = ok.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, idx, w)
    total = torch.zeros_like(count).index_add_(0, idx, xv)
    mean = total / count.clamp(min=1.0)
    dev = torch.where(ok, x - mean[idx], 0.0)
    sq = torch.zeros_like(count).index_add_(0, idx, dev * dev)
    denom = count if std_mode == "population" else (count - 1.0)
    std = torch.where(denom > 0, sq / denom.clamp(min=1.0), 0.0).sqrt()
    big = torch.finfo(torch.float64).max
    gmax = torch.full_like(count, -big).scatter_reduce_(0, idx, torch.where(ok, x, -big), "amax")
    gmin = torch.full_like(count, big).scatter_reduce_(0, idx, torch.where(ok, x, big), "amin")
    all_equal = gmax <= gmin
    out = dev / (std[idx] + eps) if divide_by_std else dev
    out = torch.where(all_equal[idx] | ~ok, 0.0, out)
    return out


def compute_advantages(name: Any, rewards: Tensor, group_ids: Tensor, /, **cfg: Any) -> Tensor:
    """Per-response advantages [N] (fp32) from scored rewards [N] and prompt ids [N].

    ``name`` is the run's loss config instance (its ``adv_estimator``, ``std_mode``, ``adv_eps``
    apply; the driver's, built once by ``config.loss_settings.build_loss_config``; no ``cfg``), a
    loss name (then ``cfg`` takes its config's fields: ``**dataclasses.asdict(cfg)``) or an
    estimator name (``grpo``, ``dr_grpo``).
    """
    if not isinstance(name, str):
        if cfg:
            raise ValueError(f"compute_advantages: {sorted(cfg)} beside a config object: set them in the config")
        estimator, std_mode, eps = name.adv_estimator, name.std_mode, name.adv_eps
    elif name in LOSSES:
        conf, _, _ = split_kwargs(LOSSES[name], cfg, extra_keys=frozenset())
        estimator, std_mode, eps = conf.adv_estimator, conf.std_mode, conf.adv_eps
    elif name in ADV_ESTIMATORS:
        allowed = {"std_mode", "adv_eps", "adv_estimator", "name"}
        for key in cfg:
            if key not in allowed:
                raise ValueError(f"unknown key {key!r} for advantage estimator {name!r} (closest valid: {closest(key, allowed)!r})")
        estimator = cfg.get("adv_estimator", name)
        std_mode, eps = cfg.get("std_mode", "population"), float(cfg.get("adv_eps", 1e-6))
    else:
        raise ValueError(
            f"unknown loss or advantage estimator {name!r} (closest: {closest(name, set(LOSSES) | set(ADV_ESTIMATORS))!r})"
        )
    rewards = torch.as_tensor(rewards)
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be [N], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    adv = group_standardize(
        rewards, group_ids, std_mode=std_mode, eps=eps, divide_by_std=(estimator == "grpo")
    )
    return adv.to(torch.float32)
