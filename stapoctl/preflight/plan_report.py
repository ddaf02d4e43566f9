"""The memory plan as a table (`stapoctl plan`, and under the dry runs of train/submit/sweep) or JSON."""

from __future__ import annotations

import json

from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stapoctl.config.engines import rollout_utilization
from stapoctl.errors import labelled
from stapoctl.preflight.memory import NOT_IN_TOTAL
from stapoctl.preflight.memory_plan import Plan, PlanRefused, build_plan

PART_NAMES = {
    "model_states": "weights + grads + optimizer",
    "activations": "activations",
    "logits_chunk": "log-prob/entropy chunk",
    "deepspeed_buffers": "DeepSpeed buckets",
    "attention_scores": "attention scores (CPU)",
    "runtime": "runtime",
    "reference": "frozen reference",
    "weights": "weights",
    "kv_cache": "KV cache",
    "activation_peak": "profiled peak",
    "cuda_graphs": "CUDA graphs",
    "learner": "learner",
    "learner_step": "learner's step peak (its allocator keeps it reserved)",
    "rollout": "rollout",
    "ipc_push_transient": "IPC push transient (learner's packed buffer + gathered parameter, vLLM's clone of a "
                          "chunk + reloaded layer)",
}
ROLE_NAMES = {"learner": "learner (DeepSpeed)", "reference": "reference", "rollout": "rollout (vLLM)",
              "colocated": "colocated GPU"}


def _gib(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.2f} GiB" if x >= 0.1 else f"{x * 1024:,.1f} MiB"


def _count(params: int) -> str:
    return f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"


def _what(conf: DictConfig, role) -> str:
    if role.role == "learner":
        lr = conf.learner
        ckpt = "on" if lr.gradient_checkpointing else "off"
        other = role.parts.get("activations_if_checkpointing_flipped", 0.0)
        longest = int(conf.data.max_prompt_length) + int(conf.rollout.max_response_length)
        budget = int(lr.get("max_tokens_per_micro_batch") or 0)
        micro = (f"token budget {budget:,} (≤ {lr.micro_batch_size} rows)" if budget
                 else f"micro-batch {lr.micro_batch_size} × {longest:,} tokens")
        return (f"ZeRO-{lr.zero_stage} × {lr.num_ranks} ranks, {conf.model.dtype}, {micro}, "
                f"checkpointing {ckpt} (activations {other:,.1f} GiB if {'off' if ckpt == 'on' else 'on'})")
    if role.role == "rollout":
        r = conf.rollout
        utilization = rollout_utilization(r, conf.learner.placement == "colocated")
        budget = (f"gpu_memory_utilization={utilization:g}" if role.device == "GPU"
                  else f"rollout.kv_cache_gb={r.kv_cache_gb:g}")
        return (f"TP={r.tensor_parallel_size}, {budget}: KV {role.kv_tokens or 0:,.0f} tokens = "
                f"{role.kv_sequences or 0:,.1f} sequences at max length")
    if role.role == "reference":
        return f"loss.kl_coef={conf.loss.kl_coef}: weights only, on each rank"
    return "learner rank + vLLM worker on one GPU (vLLM keeps its share)"


def plan_table(conf: DictConfig, plan: Plan) -> Table:
    dev = (f"one GPU = {plan.device_gib:,.1f} GiB ({plan.device_source})" if plan.device_gib is not None
           else f"CPU run: this machine has {plan.host_gib:,.1f} GiB")
    if plan.device_source.startswith("cluster.gpu_mem_gb"):  # GiB, not the card's marketing GB
        dev += "; an 80 GB H100 shows ≈79.6 GiB: set 79, or plan where the card is"
    table = Table(title=escape(f"Memory plan · {plan.model} · {_count(plan.params)} parameters\n{dev}"),  # paths
                  caption=escape(f"shape from {plan.shape_source}\nestimates: docs/TRAINING.md 'Memory plan'"))
    table.add_column("role")
    table.add_column("part")
    table.add_column("per device", justify="right")
    for role in plan.roles:
        if role.role == "reference":
            continue  # one of the learner's parts
        for k, v in role.parts.items():
            if k == "weight_push_gather" and v > 0:  # between steps: beside the total, not in it
                table.add_row(ROLE_NAMES[role.role], "weight push: one gathered parameter (between steps, "
                              "not in the total)", _gib(v))
            elif k == "weight_push_buffer":  # CUDA IPC's packed buffer: the total is the larger peak
                table.add_row(ROLE_NAMES[role.role], "weight push: CUDA IPC packed buffer (between steps; the "
                              "total is the larger of the step's and the push's peak)", _gib(v))
            elif k not in NOT_IN_TOTAL:
                table.add_row(ROLE_NAMES[role.role], PART_NAMES.get(k, k), _gib(v))
        where = f"{role.count} × {role.device}" if role.device == "GPU" else f"{role.count} process(es)"
        table.add_row(f"[bold]{ROLE_NAMES[role.role]}[/]", f"[bold]total[/] ({where})",
                      f"[bold]{_gib(role.per_device_gib)}[/]", end_section=True)
    return table


def disk_line(plan: Plan) -> str:
    d = plan.disk
    free = f"{d.free_gib:,.1f} GiB free" if d.free_gib is not None else "free space unknown"
    return (f"checkpoints: {d.checkpoints} × {_gib(d.per_checkpoint_gib)} = {_gib(d.total_gib)} "
            f"(largest rank's share {_gib(d.per_rank_gib)}) in {d.directory}: {free}")


def print_memory_plan(conf: DictConfig, console: Console, *, here: bool, plan: Plan | None = None) -> Plan:
    plan = plan or build_plan(conf, here=here)
    console.print(plan_table(conf, plan))
    for role in plan.roles:
        if role.role in ("learner", "rollout", "reference"):
            console.print(f"  {ROLE_NAMES[role.role].strip()}: {_what(conf, role)}", highlight=False, markup=False)
    console.print(disk_line(plan) + ("" if here else " (checked again where the job runs)"), highlight=False,
                  markup=False)
    for problem in plan.problems:
        console.print(labelled("does not fit:", problem), highlight=False, soft_wrap=True)
    if plan.fits:
        console.print("[green]plan fits[/]")
    return plan


def plan_command(conf: DictConfig, console: Console, *, as_json: bool) -> None:
    """`stapoctl plan`: the table (or JSON); PlanRefused (exit 2, one line) when it cannot fit."""
    here = conf.cluster.name == "local" and not conf.cluster.address
    plan = build_plan(conf, here=here)
    if as_json:
        console.out(json.dumps(plan.as_dict(), indent=2), highlight=False)
    else:
        print_memory_plan(conf, console, here=here, plan=plan)
    if not plan.fits:
        raise PlanRefused(f"plan: {plan.problems[0]}; plan.enforce=false runs it anyway")


def dry_run(conf: DictConfig, console: Console) -> None:
    """`train --cfg job`: the resolved config, the placement, the memory plan; refused like a run."""
    from stapoctl.launch.plan import print_plan
    from stapoctl.preflight.memory_plan import enforce_plan

    print_plan(conf, console)
    here = conf.cluster.name == "local" and not conf.cluster.address
    print_memory_plan(conf, console, here=here)
    enforce_plan(conf, here=here)
