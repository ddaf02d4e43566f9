"""`stapoctl train --cfg job`: show the resolved config and where each actor would go,
without starting Ray, vLLM or DeepSpeed, so a cluster job can be checked before it queues."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from stapoctl.config.shapes import decoder_params
from stapoctl.errors import UserError
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


def _model_shape(conf: DictConfig):
    """config.json's fields of the run's model: the tiny model's from its config, a local dir's
    from its file; None for a hub id (known once downloaded)."""
    import json
    from pathlib import Path

    if not conf.model.path:
        t = conf.model.tiny
        return {"hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_layers, "num_attention_heads": t.num_heads,
                "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim, "vocab_size": t.vocab_size}
    path = Path(str(conf.model.path)).expanduser() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def reference_note(conf: DictConfig) -> str:
    """Where the KL term's frozen reference lives and what it costs (see learner/reference.py)."""
    shape = _model_shape(conf)
    nbytes = 2 if str(conf.model.dtype) in ("bfloat16", "bf16") else 4
    size = "the model's weights"
    if shape:
        gib = decoder_params(shape) * nbytes / 2**30
        size = f"{gib:.3g} GiB" if gib >= 1 else f"{gib * 1024:.3g} MiB"
    return (f"+ frozen reference policy (loss.kl_coef={conf.loss.kl_coef}) on each rank: {size} "
            f"({conf.model.dtype}), no gradients or optimizer states")


def print_plan(conf: DictConfig, console: Console) -> None:
    console.rule(f"[bold]experiment {conf.experiment}[/] — resolved config")
    console.print(Syntax(OmegaConf.to_yaml(conf, resolve=True), "yaml", word_wrap=True))
    plans = role_plans(conf.rollout, conf.learner)
    notes = _notes(conf)
    table = Table(title=f"Placement plan (cluster={conf.cluster.name}; one Ray placement group per role)")
    for col in ("role", "actors", "bundle each", "strategy", "what"):
        table.add_column(col)
    for p in plans:
        bundle = ", ".join(f"{v:g} {k}" for k, v in p.bundle.items())
        table.add_row(LABELS[p.role], str(p.count), bundle, p.strategy, notes[p.role])
    need = total_need(plans)
    table.caption = "total: " + ", ".join(f"{v:g} {k}" for k, v in need.items())
    console.print(table)
    if conf.cluster.name == "local" and not conf.cluster.address:
        have = {"CPU": float(conf.cluster.num_cpus or os.cpu_count() or 1)}
        try:
            check_fits([p for p in plans], {**need, **have}, where="this machine")
        except UserError as exc:
            console.print(f"[yellow]warning:[/] {exc}")
    console.print("[dim]dry run: nothing was started[/]")
