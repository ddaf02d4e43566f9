"""Checks of the config alone: the range or choices each schema and loss field declares
(`config.fields`), then the cross-field rules, each failing as one line naming the field and the
fix (`UserError`; the CLI prints it and exits 2). Run by `compose_config`, so `--cfg job`, train,
eval and data prep all refuse the same things.

What the disk and this machine must provide (model, datasets, `resume=`, GPUs, placement) is
checked by `stapoctl.preflight`, a layer above the engines it consults.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from stapoctl.config.engines import GPU_TRANSPORTS
from stapoctl.config.fields import default_of, problems
from stapoctl.config.schema import GROUP_SCHEMAS, AlarmLimits
from stapoctl.errors import UserError

DEFAULT_EXPERIMENT = "tiny"
DEFAULT_TRACKING_EXPERIMENT = "stapoctl"


def fmt_value(value: Any) -> str:
    """A value as the user writes it on the command line (null, true/false)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _field_error(key: str, cls: type, name: str, value: Any, why: str) -> UserError:
    hint = ""
    if why.startswith("must lie"):
        default = default_of(cls, name)
        if default is not None:
            hint = f": e.g. {key}={fmt_value(default)} (the default)"
    return UserError(f"{key}={fmt_value(value)} {why}{hint}")


# -- the config alone ------------------------------------------------------------------------------
def validate_config(conf: DictConfig) -> None:
    """Declared ranges and choices of every field, then the cross-field rules."""
    for group, cls in GROUP_SCHEMAS.items():
        for name, value, why in problems(cls, conf[group]):
            raise _field_error(f"{group}.{name}", cls, name, value, why)
    for name, value, why in problems(AlarmLimits, conf.trainer.get("alarm_limits") or {}):
        raise _field_error(f"trainer.alarm_limits.{name}", AlarmLimits, name, value, why)
    _check_engine_names(conf)
    _check_loss(conf.loss)
    _check_cross_fields(conf)


# the one engine of each role: nothing reads these fields beyond the record of the run (a run asking for
# another would train on these and say otherwise in its params)
ENGINE_NAMES = {"rollout.engine": "vllm", "learner.backend": "deepspeed"}


def _check_engine_names(conf: DictConfig) -> None:
    for key, only in ENGINE_NAMES.items():
        value = OmegaConf.select(conf, key)
        if value is not None and str(value) != only:
            raise UserError(f"{key}={value}: {only} is the only one stapoctl runs: leave {key} out")


def _check_loss(loss: DictConfig) -> None:
    from stapoctl.config.loss_modules import import_modules
    from stapoctl.config.loss_settings import registered_class

    import_modules(loss.get("modules") or ())  # an experiment's or a resumed run's own methods, registered first
    config_cls = registered_class(str(loss.name))  # Hydra refuses an unknown loss=NAME; a hand-made config may not
    for name, value, why in problems(config_cls, loss):
        raise _field_error(f"loss.{name}", config_cls, name, value, why)
    values = OmegaConf.to_container(loss, resolve=True)
    try:
        config_cls(**values)  # the loss's own cross-field rules (clip floor <= ceiling, ...)
    except (ValueError, TypeError) as exc:
        names = "|".join(re.escape(k) for k in values)
        message = re.sub(rf"^{re.escape(str(loss.name))}: ", "", str(exc).splitlines()[0])
        # a field, or an element of a list field: token_rules[0].prob= -> loss.token_rules[0].prob=,
        # shadow[1][0].adv= -> loss.shadow[1][0].adv=
        message = re.sub(rf"(?<![\w.])((?:{names})(?:(?:\[\d+\])+(?:\.\w+)?)?)=", r"loss.\1=", message)
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
    conflict = token_budget_conflict(lrn, conf.loss) or packing_conflict(lrn)
    if conflict:
        raise UserError(conflict)
    budget = int(lrn.get("max_tokens_per_micro_batch") or 0)  # on: micro_batch_size only caps the rows
    if not budget and mini_rows > lrn.micro_batch_size * ranks and mini_rows % (lrn.micro_batch_size * ranks):
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
    if str(r.weight_sync) in GPU_TRANSPORTS and not asks_gpus(conf):
        raise UserError(f"rollout.weight_sync={r.weight_sync} needs GPUs; on CPU use auto or object_store")
    _check_transport_layout(str(r.weight_sync), str(lrn.get("placement") or "disaggregated"))
    buffer = int(conf.reward.get("overlong_buffer") or 0)
    if buffer and buffer >= int(r.max_response_length):
        raise UserError(f"reward.overlong_buffer={buffer} must be below rollout.max_response_length="
                        f"{r.max_response_length} (the penalty ramps over the last buffer tokens of the budget): "
                        "lower reward.overlong_buffer or raise rollout.max_response_length")
    _check_engine_timeouts_and_network(conf)
    if not conf.model.path:  # the embedded model: its context is in the config
        check_context(conf, int(conf.model.tiny.max_position_embeddings), "model.tiny.max_position_embeddings")


# one network interface by name (NCCL's `^lo,docker0` / prefix patterns are not: gloo takes none of them)
PLAIN_IFNAME = re.compile(r"[A-Za-z0-9_.:@-]+")


def _check_engine_timeouts_and_network(conf: DictConfig) -> None:
    r, lrn = conf.rollout, conf.learner
    ifname = conf.cluster.get("socket_ifname")
    if ifname and not PLAIN_IFNAME.fullmatch(str(ifname)):
        raise UserError(f"cluster.socket_ifname={ifname}: name one network interface (e.g. ib0, eth1); it sets both "
                        "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, and gloo takes no NCCL pattern (^…, lists): "
                        "export NCCL_SOCKET_IFNAME yourself for those")
    pg = lrn.get("process_group_timeout_s")
    if pg and float(pg) < float(r.weight_sync_timeout_s):
        raise UserError(f"learner.process_group_timeout_s={pg:g} is below rollout.weight_sync_timeout_s="
                        f"{r.weight_sync_timeout_s:g}: a push would time the ranks' collectives out before the driver "
                        "names the stalled actor; raise it (or leave it null: twice the sync timeout)")


def _check_transport_layout(method: str, placement: str) -> None:
    """CUDA IPC opens the learner's tensors on the vLLM worker's own GPU (vLLM looks its handle up by
    that GPU's UUID), so it needs the GPUs shared; NCCL refuses two ranks of one group on one GPU."""
    if method == "ipc" and placement != "colocated":
        raise UserError("rollout.weight_sync=ipc needs learner.placement=colocated (vLLM opens CUDA IPC handles of "
                        "tensors on its own GPU): use rollout.weight_sync=nccl (or auto) for disaggregated GPUs")
    if method == "nccl" and placement == "colocated":
        raise UserError("rollout.weight_sync=nccl cannot link a learner rank and a vLLM worker on one GPU (NCCL "
                        "refuses duplicate GPUs in a group): use rollout.weight_sync=ipc (or auto) when colocated")


def token_budget_conflict(learner: Any, loss: Any) -> Optional[str]:
    """Why `learner.max_tokens_per_micro_batch` cannot be used with these settings (one line), or
    None; the learner asks too, for a config that did not come through here."""
    budget = int(learner.get("max_tokens_per_micro_batch", 0) or 0)
    if not budget:
        return None
    if int(learner.get("zero_stage", 0) or 0) == 3:
        return (f"learner.max_tokens_per_micro_batch={budget} needs learner.zero_stage <= 2: under ZeRO-3 the "
                "learner forwards every micro-batch at the whole batch's widths, so a token budget saves nothing: "
                "set it to 0")
    if loss is not None and loss.get("per_microbatch_norm", False):
        return (f"learner.max_tokens_per_micro_batch={budget} with loss.per_microbatch_norm=true: that loss "
                "normalises each micro-batch by its own count, so a cut by length changes the update: "
                "set one of them off")
    return None


def packing_conflict(learner: Any) -> Optional[str]:
    """Why `learner.remove_padding` cannot be used with these settings (one line), or None."""
    if not learner.get("remove_padding"):
        return None
    if int(learner.get("zero_stage", 0) or 0) == 3:
        return ("learner.remove_padding=true needs learner.zero_stage <= 2: under ZeRO-3 the learner forwards "
                "through DeepSpeed's partitioned module at the batch's padded widths: set one of them off")
    return None


def check_context(conf: DictConfig, context: int, where: str) -> None:
    want = int(conf.data.max_prompt_length) + int(conf.rollout.max_response_length)
    if want > context:
        raise UserError(
            f"rollout.max_response_length={conf.rollout.max_response_length} + data.max_prompt_length="
            f"{conf.data.max_prompt_length} = {want} tokens exceed the model's context of {context} ({where}): "
            "lower rollout.max_response_length"
        )


def asks_gpus(conf: DictConfig) -> bool:
    return (float(conf.rollout.gpus_per_worker or 0) > 0 or float(conf.learner.get("gpus_per_rank", 0) or 0) > 0
            or float(conf.learner.get("num_gpus", 0) or 0) > 0)
