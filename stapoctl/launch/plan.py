"""`stapoctl train --cfg job`: show the resolved config and where each actor would go,
without starting Ray, vLLM or DeepSpeed, so a cluster job can be checked before it queues."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

from stapoctl.errors import UserError, labelled
from stapoctl.launch.placement import check_fits, role_plans, total_need


LABELS = {"rollout": "rollout (vLLM)", "learner": "learner (DeepSpeed)", "colocated": "learner + rollout (colocated)"}


def _notes(conf: DictConfig) -> dict[str, str]:
    r, lr = conf.rollout, conf.learner
    on_gpu = float(lr.gpus_per_rank or 0) > 0
    learner = (f"DeepSpeed ZeRO-{lr.zero_stage}, {'GPU (nccl)' if on_gpu else 'CPU (gloo)'}, lr={lr.lr}, "
               f"mini-batch={lr.ppo_mini_batch_size} prompts, micro={lr.micro_batch_size}")
    if float(conf.loss.get("kl_coef") or 0) > 0:
        learner += "; " + reference_note(conf)
    return {
        "rollout": f"vLLM TP={r.tensor_parallel_size}, n={r.n}, T={r.temperature}, top-p={r.top_p}, "
                   f"max_tokens={r.max_response_length}",
        "learner": learner,
        "colocated": "learner rank + vLLM worker sharing one GPU (learner.placement=colocated)",
    }


def reference_note(conf: DictConfig) -> str:
    """Where the KL term's frozen reference lives (learner/reference.py); its size is a row of the
    memory plan `--cfg job` prints below (preflight/plan_report.py)."""
    return (f"+ frozen reference policy (loss.kl_coef={conf.loss.kl_coef}) on each rank: its weights in "
            f"{conf.model.dtype}, no gradients or optimizer states")


def print_plan(conf: DictConfig, console: Console) -> None:
    console.rule(f"[bold]experiment {escape(str(conf.experiment))}[/] — resolved config")
    console.print(Syntax(OmegaConf.to_yaml(conf, resolve=True), "yaml", word_wrap=True))
    plans = role_plans(conf.rollout, conf.learner)
    notes = _notes(conf)
    table = Table(title=f"Placement plan (cluster={conf.cluster.name}; one Ray placement group per role)")
    for col in ("role", "actors", "bundle each", "strategy", "what"):
        table.add_column(col)
    for p in plans:
        bundle = ", ".join(f"{v:g} {k}" for k, v in p.bundle.items())
        table.add_row(LABELS[p.role], str(p.count), bundle, p.strategy, escape(notes[p.role]))  # config values
    need = total_need(plans)
    table.caption = "total: " + ", ".join(f"{v:g} {k}" for k, v in need.items())
    console.print(table)
    if conf.cluster.name == "local" and not conf.cluster.address:
        have = {"CPU": float(conf.cluster.num_cpus or len(os.sched_getaffinity(0)) or 1)}
        try:
            check_fits([p for p in plans], {**need, **have}, where="this machine")
        except UserError as exc:
            console.print(labelled("warning:", exc, "yellow"), highlight=False, soft_wrap=True)
    console.print("[dim]dry run: nothing was started[/]")
