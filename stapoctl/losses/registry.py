"""The loss registry: a method is one function registered under a name with its config.

A loss function has the signature ``fn(batch: PolicyBatch, cfg) -> (loss, metrics)`` where
``batch`` (see ``batch.py``) holds the call's tensors, its extra inputs and the mini-batch
context, and ``cfg`` is an instance of the registered ``config_cls``.

Extra per-call inputs (keyword arguments of ``compute_policy_loss`` / ``prepare_minibatch``):

- ``group_ids``: [B] int, prompt id of each row (wapo, ppl_shaping).
- ``global_step``: int, training step (position_shaping's start/stop window).
- ``sum_p2``: [B, T] float, sum_k pi_k^2 from ``token_stats(..., return_sum_p2=True)``
  (exact LM-head gradient-norm proxies; without it the (1 - pi)^2 lower bound is used).
- ``hidden_norm``: [B, T] float, ||h_t||_2 of the final hidden state (default 1).
- ``max_response_length``: int, WAPO's T_max and seq-mean-token-sum-norm's constant (default: T).
- ``ref_log_prob``: [B, T] float, the frozen reference policy's log-probs (any loss with
  ``kl_coef > 0``; see ``kl.py``, ``regularizers.py``).
- ``behavior_log_prob``: [B, T] float, log-probs of the distribution that *sampled* the tokens
  (the rollout engine's, possibly with older weights than ``old_log_prob``'s). Every method's
  per-token surrogate is then multiplied by the config's ``rollout_correction`` weight built
  from π_old/π_behav with cap ``rollout_is_cap`` (``rollout_correction.py``; ``auto`` = token
  TIS, the decoupled PPO of Hilton et al. 2022, "Batch size-invariance for policy
  optimization"). Masks (STAPO's π < τ_p, H < h*) keep using the current policy's π and H.
- ``is_cap``: float, the old name of the ``rollout_is_cap`` config field (a one-time warning);
  it applies when ``rollout_is_cap`` is absent or at its default 2.0.
- ``old_log_prob``: only for ``prepare_minibatch`` (ppl_shaping needs it there).

Mini-batch context (returned by ``prepare_minibatch``, passed back into every micro-batch
call): ``entropy_threshold`` (S2T h* of the stapo/* metrics), ``entropy_q=<q>`` (the entropy
quantiles token rules use: STAPO's h* is ``entropy_q=0.8``, 20-Entropy's threshold too),
``prob_q=<sign>:<q>`` (π quantiles among one advantage sign's tokens), ``mean_entropy`` (the mini-batch's
mean H, a rule's gate), ``shadow/<name>/...`` and ``rollout_corr/abs_dlogp...`` (measured only,
``shadow.py``), ``loss_denominator`` (the normaliser of the aggregation mode), ``reg_denominator``
(that of the KL and entropy terms, over every response token; only when β or c > 0), and
row-aligned tensors whose keys start with ``row_`` (``row_weight`` for wapo, ``row_ppl_weight`` for
ppl_shaping) that must be sliced with the micro-batch rows (``slice_context``).
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional

from stapoctl.config.fields import default_of
from stapoctl.config.loss_settings import add_loss_config

EXTRA_KEYS = frozenset(
    {"group_ids", "global_step", "sum_p2", "hidden_norm", "max_response_length", "ref_log_prob",
     "behavior_log_prob", "is_cap"}
)
CONTEXT_KEYS = frozenset(
    {"entropy_threshold", "loss_denominator", "reg_denominator", "row_weight", "row_ppl_weight"}
)
# one key per quantile a token rule reads (rules.QUANTILE_KEY, rules.PROB_QUANTILE_KEY), and the
# measured-only mini-batch values of shadow.py (shadow/<name>/..., rollout_corr/abs_dlogp...)
CONTEXT_PREFIXES = ("entropy_q=", "prob_q=", "mean_entropy", "shadow/", "rollout_corr/abs_dlogp")


def is_context_key(key: str) -> bool:
    return key in CONTEXT_KEYS or key.startswith(CONTEXT_PREFIXES)
_WARNED: set[str] = set()


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable[..., Any]
    config_cls: type
    doc: str


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, config_cls: type, doc: Optional[str] = None) -> Callable:
    """Decorator: register ``fn`` as loss ``name``; configs then select it with loss=NAME. A module
    registering a name again replaces its own method (a reload: `loss.modules` on a reset learner
    rank, an edited method); another module's name is refused. The config layer checks the class
    and owns its table: a built-in's is declared there already, a run-time method's is added there
    (`config.loss_settings.add_loss_config`), so `loss=NAME` composes."""

    def deco(fn: Callable) -> Callable:
        before = LOSSES[name].fn.__module__ if name in LOSSES else fn.__module__
        if before != fn.__module__:
            raise ValueError(f"loss {name!r} is registered by {before} and again by {fn.__module__}: "
                             "rename one of them")
        add_loss_config(name, config_cls)  # checks the first field; writes nothing for a declared built-in
        LOSSES[name] = LossSpec(name=name, fn=fn, config_cls=config_cls, doc=(doc or fn.__doc__ or "").strip())
        return fn

    return deco


def closest(key: str, valid: list[str] | set[str] | frozenset[str]) -> str:
    options = sorted(valid)
    match = difflib.get_close_matches(key, options, n=1, cutoff=0.0)
    return match[0] if match else (options[0] if options else "")


def get_spec(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r} (closest: {closest(name, LOSSES.keys())!r})")
    return LOSSES[name]


def config_field_names(config_cls: type) -> list[str]:
    return [f.name for f in fields(config_cls)]


def split_kwargs(spec: LossSpec, kwargs: dict[str, Any], extra_keys: frozenset[str] = EXTRA_KEYS):
    """Split caller kwargs into (config instance, extras, context); one-line error on a typo."""
    names = set(config_field_names(spec.config_cls))
    valid = names | extra_keys | CONTEXT_KEYS
    for key in kwargs:
        if key not in valid and not is_context_key(key):
            raise ValueError(
                f"unknown key {key!r} for loss {spec.name!r} (closest valid: {closest(key, valid)!r})"
            )
    cfg_kwargs = {k: v for k, v in kwargs.items() if k in names}
    if cfg_kwargs.get("name", spec.name) != spec.name:
        raise ValueError(f"config name {cfg_kwargs['name']!r} does not match loss {spec.name!r}")
    cfg_kwargs["name"] = spec.name
    _is_cap_alias(spec.config_cls, kwargs, cfg_kwargs)
    cfg = spec.config_cls(**cfg_kwargs)
    extras = {k: v for k, v in kwargs.items() if k in extra_keys}
    context = {k: v for k, v in kwargs.items() if is_context_key(k)}
    return cfg, extras, context


def resolve(name_or_cfg: Any, kwargs: dict[str, Any], extra_keys: frozenset[str] = EXTRA_KEYS):
    """(spec, config instance, extras, context) of a call. A config instance (built once by the
    caller: `config.loss_settings.build_loss_config`) is used as it is, and ``kwargs`` then hold only
    extra inputs and context; a loss name builds the config from ``kwargs``' fields (`split_kwargs`)."""
    if isinstance(name_or_cfg, str):
        spec = get_spec(name_or_cfg)
        return (spec, *split_kwargs(spec, kwargs, extra_keys))
    cfg = name_or_cfg
    spec = get_spec(getattr(cfg, "name", ""))
    if not isinstance(cfg, spec.config_cls):
        raise TypeError(f"a {type(cfg).__name__} is not loss {spec.name!r}'s config ({spec.config_cls.__name__})")
    valid = extra_keys | CONTEXT_KEYS
    for key in kwargs:
        if key not in valid and not is_context_key(key):
            raise ValueError(f"unknown key {key!r} for loss {spec.name!r} beside its config object (config fields "
                             f"go in the object; closest valid: {closest(key, valid)!r})")
    if kwargs.get("is_cap") is not None and hasattr(cfg, "rollout_is_cap"):
        cap = {"rollout_is_cap": cfg.rollout_is_cap}
        _is_cap_alias(spec.config_cls, kwargs, cap)
        if cap["rollout_is_cap"] != cfg.rollout_is_cap:
            cfg = replace(cfg, **cap)
    extras = {k: v for k, v in kwargs.items() if k in extra_keys}
    context = {k: v for k, v in kwargs.items() if is_context_key(k)}
    return spec, cfg, extras, context


def _is_cap_alias(config_cls: type, kwargs: dict[str, Any], cfg_kwargs: dict[str, Any]) -> None:
    """``is_cap`` (old name) fills ``rollout_is_cap`` unless that was set to a value of its own:
    ``asdict(cfg)`` always carries the field, so its default counts as not given."""
    if kwargs.get("is_cap") is None or "rollout_is_cap" not in {f.name for f in fields(config_cls)}:
        return
    if "is_cap" not in _WARNED:
        _WARNED.add("is_cap")
        warnings.warn("is_cap is renamed rollout_is_cap (a loss config field); a non-default rollout_is_cap wins",
                      FutureWarning, stacklevel=4)
    default = default_of(config_cls, "rollout_is_cap")
    if cfg_kwargs.get("rollout_is_cap", default) == default:
        cfg_kwargs["rollout_is_cap"] = float(kwargs["is_cap"])
