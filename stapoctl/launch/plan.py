"""`stapoctl train --cfg job`: show the resolved config and where each actor would go,
without starting Ray, vLLM or DeepSpeed, so a cluster job can be checked before it queues."""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table


@dataclass
class Placement:
    role: str
    count: int
    cpus: float
    gpus: float
    note: str


def placement_plan(conf: DictConfig) -> list[Placement]:
    """Actors and their Ray resources, as the driver will request them."""
    r, lr = conf.rollout, conf.learner
    gpus_per_worker = r.gpus_per_worker or 0
    if gpus_per_worker and r.tensor_parallel_size > 1:
        gpus_per_worker = max(gpus_per_worker, r.tensor_parallel_size)
    rollout_note = (
        f"vLLM TP={r.tensor_parallel_size}, n={r.n}, T={r.temperature}, top-p={r.top_p}, "
        f"max_tokens={r.max_response_length}"
    )
    learner_ranks = max(1, lr.num_gpus)
    learner_note = (
        f"DeepSpeed ZeRO-{lr.zero_stage}, {'GPU' if lr.num_gpus else 'CPU (gloo)'}, "
        f"lr={lr.lr}, mini-batch={lr.ppo_mini_batch_size} prompts, micro={lr.micro_batch_size}"
    )
    plan = [
        Placement("rollout (vLLM)", r.num_workers, r.cpus_per_worker, gpus_per_worker, rollout_note),
        Placement(
            "learner (DeepSpeed)",
            learner_ranks,
            lr.cpus,
            1.0 if lr.num_gpus else 0.0,
            learner_note + (f", placement={lr.placement}" if lr.num_gpus else ""),
        ),
    ]
    return plan


def print_plan(conf: DictConfig, console: Console) -> None:
    console.rule(f"[bold]experiment {conf.experiment}[/] — resolved config")
    console.print(Syntax(OmegaConf.to_yaml(conf, resolve=True), "yaml", word_wrap=True))
    plan = placement_plan(conf)
    table = Table(title=f"Placement plan (cluster={conf.cluster.name})")
    for col in ("role", "actors", "CPUs each", "GPUs each", "what"):
        table.add_column(col)
    for p in plan:
        table.add_row(p.role, str(p.count), f"{p.cpus:g}", f"{p.gpus:g}", p.note)
    need_cpu = sum(p.count * p.cpus for p in plan)
    need_gpu = sum(p.count * p.gpus for p in plan)
    if conf.learner.placement == "colocated" and conf.learner.num_gpus:
        need_gpu = max(
            sum(p.count * p.gpus for p in plan if p.role.startswith("rollout")), conf.learner.num_gpus
        )
    table.caption = f"total: {need_cpu:g} CPUs, {need_gpu:g} GPUs"
    console.print(table)
    if conf.cluster.name == "local":
        have = conf.cluster.num_cpus or os.cpu_count() or 1
        if need_cpu > have:
            console.print(
                f"[yellow]warning:[/] the plan asks for {need_cpu:g} CPUs and this machine has {have}; "
                "lower rollout.cpus_per_worker / learner.cpus"
            )
    console.print("[dim]dry run: nothing was started[/]")
