"""`stapoctl plan`: what every role needs per device and on disk, and whether it fits, before a
job queues. Train, submit, sweep and their dry runs refuse a plan that cannot fit (exit 2, one
line with the knob to turn) unless `plan.enforce=false`."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from stapoctl.config.engines import rollout_eager, rollout_utilization
from stapoctl.config.shapes import max_model_len
from stapoctl.errors import UserError, labelled
from stapoctl.preflight import memory as M
from stapoctl.preflight.model_shape import ArchitectureUnknown, model_shape, parameter_count


class PlanRefused(UserError):
    """A plan that cannot fit, with `plan.enforce` on."""


class ShapeUnknown(UserError):
    """The model's config.json is not here (an uncached hub id, an MLflow run id)."""


@dataclass
class RoleMemory:
    role: str  # learner | reference | rollout | colocated
    device: str  # "GPU" or "CPU"
    per_device_gib: float
    parts: dict[str, float]
    count: int = 1  # devices (GPUs, or processes on the host) of this role
    kv_cache_gib: Optional[float] = None
    kv_tokens: Optional[float] = None
    kv_sequences: Optional[float] = None


@dataclass
class DiskPlan:
    directory: str
    per_checkpoint_gib: float
    per_rank_gib: float
    checkpoints: int
    total_gib: float
    free_gib: Optional[float]
    fits: bool


@dataclass
class Plan:
    model: str
    shape_source: str
    params: int
    device_gib: Optional[float]  # one GPU's memory (None: a CPU run, host memory below)
    device_source: str
    host_gib: float
    roles: list[RoleMemory] = field(default_factory=list)
    disk: Optional[DiskPlan] = None
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def role(self, name: str) -> Optional[RoleMemory]:
        return next((r for r in self.roles if r.role == name), None)

    def as_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits}


def _micro_tokens(conf: DictConfig) -> int:
    """Padded tokens of the largest learner micro-batch: its rows at the longest prompt and
    response, or the token budget (`learner.max_tokens_per_micro_batch`), which a single longer
    row still exceeds in a micro-batch of its own."""
    longest = int(conf.data.max_prompt_length) + int(conf.rollout.max_response_length)
    rows = int(conf.learner.micro_batch_size) * longest
    budget = int(conf.learner.get("max_tokens_per_micro_batch") or 0)
    return min(rows, max(budget, longest)) if budget > 0 else rows


def _device_memory(conf: DictConfig, *, here: bool) -> tuple[Optional[float], str]:
    """One GPU's memory in GiB (2**30 bytes). Where the run executes (`here`: train, its job, the
    doctor) and torch sees CUDA, the card wins over `cluster.gpu_mem_gb`: a local `train` of the
    Table-6 recipes resolves `cluster.name=slurm` and would size colocated vLLM's KV bytes from
    the preset. Elsewhere (a login node, `plan`/`submit` for a cluster) the setting."""
    on_gpu = float(conf.learner.gpus_per_rank or 0) > 0 or float(conf.rollout.gpus_per_worker or 0) > 0
    if not on_gpu:
        return None, "CPU run"
    preset = float(conf.cluster.gpu_mem_gb)
    if here:
        card = _card_gib()
        if card is not None:
            gib, name = card
            other = "" if abs(gib - preset) < 0.05 else f"; cluster.gpu_mem_gb={preset:g} not used"
            return gib, f"{name}, found here{other}"
    return preset, f"cluster.gpu_mem_gb={preset:g}, read as GiB"


def _card_gib() -> Optional[tuple[float, str]]:
    """The smallest visible CUDA device's memory in GiB, and its name; None without CUDA."""
    from stapoctl.preflight.machine import local_gpus

    if not local_gpus():
        return None
    import torch

    mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return mem / M.GIB, str(torch.cuda.get_device_name(0))


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / M.GIB


def build_plan(conf: DictConfig, *, here: bool = True) -> Plan:
    """Every role's memory, the checkpoints' disk, and the problems that make it not fit. `here`:
    the run executes on this machine (its disk, host memory and visible GPU are the run's)."""
    shape, source = model_shape(conf)
    if shape is None:
        raise ShapeUnknown(f"plan: cannot size model.path={conf.model.path}: its config.json is not here ({source}); "
                        "download the model (or only its config.json) or give a local model dir")
    try:
        params = parameter_count(shape)
    except ArchitectureUnknown as exc:
        raise ShapeUnknown(f"plan: cannot size model.path={conf.model.path}: {exc}; give a model whose "
                           "config.json names a model_type this transformers knows") from None
    device_gib, device_source = _device_memory(conf, here=here)
    plan = Plan(model=str(conf.model.path or "tiny"), shape_source=source, params=params,
                device_gib=device_gib, device_source=device_source, host_gib=host_memory_gib())
    learner = _learner(conf, shape)
    plan.roles.append(learner)
    if float(conf.loss.get("kl_coef") or 0) > 0:
        ref = M.reference_gib(shape, conf.model.dtype)
        plan.roles.append(RoleMemory("reference", learner.device, ref, {"weights": ref}, learner.count))
        learner.parts["reference"] = ref
        learner.per_device_gib += ref
    rollout = _rollout(conf, shape, device_gib)
    plan.roles.append(rollout)
    if conf.learner.placement == "colocated" and learner.device == "GPU":
        plan.roles.append(_colocated(conf, shape, learner, rollout))
    plan.disk = disk_plan(conf, shape)
    plan.problems = _problems(conf, plan, shape, here=here)
    return plan


def _learner(conf: DictConfig, shape: dict) -> RoleMemory:
    lr = conf.learner
    on_gpu = float(lr.gpus_per_rank or 0) > 0
    micro, response = _micro_tokens(conf), int(conf.rollout.max_response_length)
    # a ZeRO-3 forward keeps the logits of each row's response + 1 positions (learner/forward.py)
    kept = micro * (response + 1) // (int(conf.data.max_prompt_length) + response)
    parts = M.learner_memory(shape, zero_stage=int(lr.zero_stage), num_ranks=int(lr.num_ranks),
                             dtype=conf.model.dtype, micro_tokens=micro, logit_tokens=min(micro, kept),
                             gradient_checkpointing=bool(lr.gradient_checkpointing),
                             logits_chunk=int(lr.logits_chunk_size), offload_optimizer=bool(lr.offload_optimizer),
                             on_gpu=on_gpu, entropy_grad=float(conf.loss.get("entropy_coef") or 0) != 0,
                             seq_len=int(conf.data.max_prompt_length) + int(conf.rollout.max_response_length))
    total = parts.pop("total")
    if on_gpu and _transport(conf) == "ipc":
        total = _ipc_push(parts, shape, conf.model.dtype, total)
    return RoleMemory("learner", "GPU" if on_gpu else "CPU", total, parts, int(lr.num_ranks))


def _transport(conf: DictConfig) -> str:
    from stapoctl.config.validate import asks_gpus
    from stapoctl.sync.transports import choose_method

    try:
        return choose_method(str(conf.rollout.weight_sync), on_gpu=asks_gpus(conf), placement=str(conf.learner.placement))
    except Exception:  # refused elsewhere (validate), with its own line
        return ""


def _ipc_push(parts: dict, shape: dict, dtype: str, total: float) -> float:
    """CUDA IPC's push holds vLLM's packed buffer (1 GiB, or the largest tensor: sync/trainer_engines.py)
    besides the gathered parameter, between steps when no activation is held: the rank's peak is the
    larger of the step's and the push's."""
    largest = M._largest_layer(shape) * M.dtype_bytes(dtype)
    parts["weight_push_buffer"] = max(float(2**30), float(largest)) / M.GIB
    push = sum(parts.get(k, 0.0) for k in ("model_states", "deepspeed_buffers", "runtime", "weight_push_gather",
                                           "weight_push_buffer"))
    return max(total, push)


def _colocated(conf: DictConfig, shape: dict, learner: RoleMemory, rollout: RoleMemory) -> RoleMemory:
    """One shared GPU: the learner rank beside vLLM's budget. Under CUDA IPC the push adds its
    transient to the learner's step peak, which the rank's caching allocator keeps reserved."""
    if "weight_push_buffer" not in learner.parts:
        parts = {"learner": learner.per_device_gib, "rollout": rollout.per_device_gib}
        return RoleMemory("colocated", "GPU", sum(parts.values()), parts, learner.count)
    step = sum(v for k, v in learner.parts.items() if k not in M.NOT_IN_TOTAL)
    parts = {"learner_step": step, "rollout": rollout.per_device_gib,
             "ipc_push_transient": ipc_push_transient(learner.parts, shape, conf.model.dtype,
                                                      int(conf.rollout.tensor_parallel_size))}
    # >= learner + rollout: the learner's push-only peak is below its step peak + buffer + gather
    return RoleMemory("colocated", "GPU", sum(parts.values()), parts, learner.count)


def ipc_push_transient(learner_parts: dict, shape: dict, dtype: str, tp: int) -> float:
    """GiB a CUDA IPC push allocates on a colocated GPU: the learner's packed buffer, allocated anew
    each push (vllm packed_tensor.py packed_ipc_producer), and its ZeRO-3 gathered parameter; vLLM's
    clone of every tensor of one chunk (<= the buffer: packed_ipc_consumer) and the layer its
    layerwise reload materialises (the largest module, sharded over TP)."""
    buffer = learner_parts["weight_push_buffer"]
    layer = M._largest_layer(shape) * M.dtype_bytes(dtype) / max(1, tp) / M.GIB
    return 2 * buffer + learner_parts.get("weight_push_gather", 0.0) + layer


def _rollout(conf: DictConfig, shape: dict, device_gib: Optional[float]) -> RoleMemory:
    r = conf.rollout
    on_gpu = float(r.gpus_per_worker or 0) > 0
    tp = int(r.tensor_parallel_size)
    parts = M.rollout_memory(shape, dtype=conf.model.dtype, tp=tp, device_gib=device_gib if on_gpu else None,
                             utilization=rollout_utilization(r, colocated=conf.learner.placement == "colocated"),
                             kv_cache_gb=float(r.kv_cache_gb), max_model_len=max_model_len(conf, shape),
                             enforce_eager=rollout_eager(r, on_gpu))
    kv = {k: parts.pop(k) for k in ("kv_tokens", "kv_sequences")}
    total = parts.pop("total")
    return RoleMemory("rollout", "GPU" if on_gpu else "CPU", total, parts, int(r.num_workers) * (tp if on_gpu else 1),
                      kv_cache_gib=parts["kv_cache"], **kv)


def checkpoint_bytes_per_param(dtype: str, zero_stage: int) -> int:
    """What learner/state_io.py writes per parameter: the HF model dir and DeepSpeed's module
    states in the model's dtype, and the optimizer: fp32 master (kept separately in mixed
    precision, and as a partition's copy under ZeRO >= 1) + Adam's two fp32 moments."""
    d = M.dtype_bytes(dtype)
    master = 4 if (d == 2 or zero_stage >= 1) else 0
    return d + d + master + 8


def disk_plan(conf: DictConfig, shape: dict) -> DiskPlan:
    from stapoctl.preflight.run_dir import output_root

    params = parameter_count(shape)
    stage, ranks = int(conf.learner.zero_stage), int(conf.learner.num_ranks)
    per_ckpt = params * checkpoint_bytes_per_param(conf.model.dtype, stage) / M.GIB
    optimizer = params * (checkpoint_bytes_per_param(conf.model.dtype, stage) - 2 * M.dtype_bytes(conf.model.dtype))
    per_rank = (optimizer / (ranks if stage >= 1 else 1) + 2 * params * M.dtype_bytes(conf.model.dtype)) / M.GIB
    t = conf.trainer
    saves = int(t.total_steps) // int(t.save_freq) if int(t.save_freq) > 0 else 0
    keep = int(t.get("keep_checkpoints") or 0)
    # a newer checkpoint is complete and verified before the oldest kept one goes; a resumed run
    # also keeps the checkpoint it started from while it runs (its rollout actors reload it)
    count = min(saves, keep + 1) + (1 if conf.get("resume") else 0) if keep > 0 else saves
    directory, _ = output_root(conf)
    free = _free_gib(directory)
    total = per_ckpt * count
    fits = free is None or total <= free
    return DiskPlan(str(directory), per_ckpt, per_rank, count, total, free, fits)


def _free_gib(directory: Path) -> Optional[float]:
    """Free space of the disk a directory is (or will be) on; None where no parent exists."""
    for p in (directory, *directory.parents):
        if p.exists():
            return shutil.disk_usage(p).free / M.GIB
    return None


def _gib(x: float) -> str:
    return f"{x:.1f} GiB" if x >= 0.95 else f"{x * 1024:.0f} MiB"


def _learner_need(conf: DictConfig, shape: dict, changes: tuple[str, ...]) -> float:
    from omegaconf import OmegaConf

    trial = OmegaConf.merge(conf, OmegaConf.from_dotlist(list(changes)))
    ref = M.reference_gib(shape, conf.model.dtype) if float(conf.loss.get("kl_coef") or 0) > 0 else 0.0
    return _learner(trial, shape).per_device_gib + ref


def _learner_fixes(conf: DictConfig, shape: dict, limit: float) -> str:
    """The first single changes (else pairs) of the knobs that decide the learner's memory that fit."""
    from itertools import combinations

    lr = conf.learner
    tries = [f"learner.zero_stage={s}" for s in range(int(lr.zero_stage) + 1, 4)]
    tries += [f"learner.num_ranks={int(lr.num_ranks) * k}" for k in (2, 4, 8)]
    if not lr.gradient_checkpointing:
        tries.append("learner.gradient_checkpointing=true")
    if int(lr.micro_batch_size) > 1:
        tries.append("learner.micro_batch_size=1")
    if not lr.offload_optimizer:
        tries.append("learner.offload_optimizer=true")
    for size in (1, 2):
        fits = []
        for changes in combinations(tries, size):
            keys = [c.split("=")[0] for c in changes]
            if len(set(keys)) < len(keys) or ("learner.offload_optimizer" in keys and int(lr.zero_stage) == 0
                                              and not any(k == "learner.zero_stage" for k in keys)):
                continue
            need = _learner_need(conf, shape, changes)
            if need <= limit:
                fits.append(f"{' '.join(changes)} ({_gib(need)})")
            if len(fits) == 2:
                return "fits with " + " or ".join(fits)
        if fits:
            return "fits with " + fits[0]
    return "no change of one or two knobs fits: a larger GPU, a smaller model, or tensor/sequence parallelism"


def _problems(conf: DictConfig, plan: Plan, shape: dict, *, here: bool) -> list[str]:
    out: list[str] = []
    learner, rollout = plan.role("learner"), plan.role("rollout")
    gpu = plan.device_gib
    if learner.device == "GPU" and gpu is not None and learner.per_device_gib > gpu:
        out.append(f"the learner needs {_gib(learner.per_device_gib)} per GPU and a GPU has {_gib(gpu)} "
                   f"({plan.device_source}): {_learner_fixes(conf, shape, gpu)}")
    if rollout.device == "GPU" and (rollout.kv_sequences or 0) < 1:
        out.append(f"the rollout's KV cache holds {rollout.kv_tokens or 0:,.0f} tokens, less than one sequence of "
                   f"{max_model_len(conf, shape):,} (vLLM would not start): raise rollout.gpu_memory_utilization "
                   f"(now {rollout_utilization(conf.rollout, conf.learner.placement == 'colocated'):g}) or "
                   "rollout.tensor_parallel_size, or shorten "
                   "rollout/eval.max_response_length")
    colocated = plan.role("colocated")
    if colocated is not None and gpu is not None and colocated.per_device_gib > gpu:
        push = colocated.parts.get("ipc_push_transient")
        what = f" + the CUDA IPC push's transient ({_gib(push)})" if push else ""
        out.append(f"colocated learner + rollout{what} need {_gib(colocated.per_device_gib)} on one GPU of "
                   f"{_gib(gpu)} ({plan.device_source}): lower rollout.gpu_memory_utilization, raise "
                   "learner.zero_stage / learner.num_ranks, or use learner.placement=disaggregated")
    out += _host_problems(conf, plan, here=here)
    d = plan.disk
    if here and d is not None and not d.fits:
        out.append(f"{d.checkpoints} checkpoints of {_gib(d.per_checkpoint_gib)} need {_gib(d.total_gib)} and "
                   f"{d.directory}'s disk has {_gib(d.free_gib or 0)} free: set trainer.keep_checkpoints=K, a larger "
                   "trainer.save_freq, or trainer.output_dir on a bigger disk")
    return out


def _host_problems(conf: DictConfig, plan: Plan, *, here: bool) -> list[str]:
    """CPU roles on this machine: their sum against its memory (a remote cluster's nodes differ)."""
    if not here or conf.cluster.name != "local" or conf.cluster.address:
        return []
    need = sum(r.per_device_gib * r.count for r in plan.roles if r.device == "CPU" and r.role != "reference")
    if need <= plan.host_gib:
        return []
    return [f"the CPU roles need {_gib(need)} and this machine has {_gib(plan.host_gib)}: fewer "
            "rollout.num_workers / learner.num_ranks, a smaller rollout.kv_cache_gb, or a smaller model"]


def enforce_plan(conf: DictConfig, *, here: bool = True, console=None) -> Optional[Plan]:
    """Refuse (PlanRefused, one line) what cannot fit; `plan.enforce=false` warns instead."""
    try:
        plan = build_plan(conf, here=here)
    except ShapeUnknown as exc:  # a hub model to download, or sized where the job runs
        if console is not None:
            from rich.markup import escape

            console.print(f"[dim]{escape(str(exc))} — memory not checked[/]", highlight=False)
        return None
    if plan.fits:
        return plan
    message = "plan: " + plan.problems[0] + (f" (and {len(plan.problems) - 1} more: `stapoctl plan`)"
                                               if len(plan.problems) > 1 else "")
    if bool(conf.get("plan", {}).get("enforce", True)):
        raise PlanRefused(message + "; plan.enforce=false runs it anyway")
    if console is not None:
        console.print(labelled("warning:", f"{message} (plan.enforce=false: going on)", "yellow"), highlight=False)
    return plan
