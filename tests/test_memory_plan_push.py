"""The colocated memory plan against what a CUDA IPC push allocates, and which GPU size it plans
with (issue #49 R5): the push's transient is a named line of the shared GPU and part of the fit;
`cluster.gpu_mem_gb` is GiB; where the run executes and sees a card, the card wins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rich.console import Console

from stapoctl.config.compose import compose_config
from stapoctl.config.shapes import QWEN3_SHAPES
from stapoctl.preflight.memory_plan import PlanRefused, build_plan, enforce_plan

GIB = 2**30
COLOCATED_1_7B = ["experiment=stapo_qwen3_1.7b", "learner.placement=colocated"]  # ZeRO-2 × 4, TP 1, CUDA IPC
H100_BYTES = 85_520_809_984  # what torch reports for an 80 GB H100 (81,559 MiB)


def _rendered(conf, plan) -> str:
    from stapoctl.preflight.plan_report import plan_table

    console = Console(record=True, width=400)
    console.print(plan_table(conf, plan))
    return console.export_text()


def test_the_colocated_ipc_plan_counts_the_push_transient():
    """Qwen3-1.7B: the packed buffer is vLLM's 1 GiB (the 0.58 GiB embedding is smaller), once on the
    learner (allocated anew each push) and once as vLLM's clone of a chunk, plus the layer vLLM's
    layerwise reload materialises (the embedding at TP 1); ZeRO-2 gathers nothing."""
    conf = compose_config(COLOCATED_1_7B)
    plan = build_plan(conf, here=False)
    shared, learner, rollout = plan.role("colocated"), plan.role("learner"), plan.role("rollout")
    s = QWEN3_SHAPES["Qwen/Qwen3-1.7B-Base"]
    embedding = s["vocab_size"] * s["hidden_size"] * 2 / GIB
    assert shared.parts["ipc_push_transient"] == pytest.approx(2 * 1.0 + embedding)
    step = learner.per_device_gib  # ZeRO-2's step peak is above the push-only peak here
    assert shared.parts["learner_step"] == pytest.approx(step)
    assert shared.per_device_gib == pytest.approx(step + rollout.per_device_gib + 2 + embedding)
    assert "IPC push transient" in _rendered(conf, plan)
    # ZeRO-3 adds its gathered parameter and TP 2 halves the reloaded layer
    z3 = build_plan(compose_config([*COLOCATED_1_7B, "learner.zero_stage=3", "learner.max_tokens_per_micro_batch=0",
                                    "rollout.tensor_parallel_size=2", "rollout.gpus_per_worker=2",
                                    "rollout.num_workers=2"]), here=False)
    assert z3.role("colocated").parts["ipc_push_transient"] == pytest.approx(2 + embedding + embedding / 2)


def test_no_transient_without_the_ipc_transport():
    gloo = build_plan(compose_config([*COLOCATED_1_7B, "rollout.weight_sync=gloo"]), here=False)
    assert set(gloo.role("colocated").parts) == {"learner", "rollout"}
    assert build_plan(compose_config(["experiment=stapo_qwen3_1.7b"]), here=False).role("colocated") is None


def test_a_layout_that_fit_within_two_gib_of_the_card_is_refused_in_one_line():
    """Learner + vLLM's budget leave 1 GiB of the GPU: it used to fit; the push needs 2.6 GiB more."""
    first = build_plan(compose_config(COLOCATED_1_7B), here=False)
    learner, utilization = first.role("learner").per_device_gib, 0.6  # the recipe's gpu_memory_utilization
    assert first.role("rollout").per_device_gib == pytest.approx(utilization * 80.0)
    gpu = round((learner + 1.0) / (1 - utilization), 2)  # learner + 0.6 × gpu = gpu − 1 GiB
    conf = compose_config([*COLOCATED_1_7B, f"cluster.gpu_mem_gb={gpu}"])
    plan = build_plan(conf, here=False)
    old_total = plan.role("learner").per_device_gib + plan.role("rollout").per_device_gib
    assert 0 < gpu - old_total < 2.0
    assert len(plan.problems) == 1, plan.problems
    line = plan.problems[0]
    assert "\n" not in line and "CUDA IPC push's transient (2.6 GiB)" in line and f"one GPU of {gpu:.1f} GiB" in line
    assert "lower rollout.gpu_memory_utilization" in line and "learner.placement=disaggregated" in line
    with pytest.raises(PlanRefused, match=r"^plan: colocated learner \+ rollout \+ the CUDA IPC push's transient"):
        enforce_plan(conf, here=False)
    # the same layout without the push's transient (gloo) still fits: the transient is what refuses it
    assert build_plan(compose_config([*COLOCATED_1_7B, f"cluster.gpu_mem_gb={gpu}", "rollout.weight_sync=gloo"]),
                      here=False).fits
    # and the fix it names fits
    assert build_plan(compose_config([*COLOCATED_1_7B, f"cluster.gpu_mem_gb={gpu}",
                                      "rollout.gpu_memory_utilization=0.55"]), here=False).fits


@pytest.fixture()
def h100(monkeypatch):
    """torch sees one 80 GB H100 (torch's CUDA init and DeepSpeed's accelerator are left alone)."""
    import torch

    from stapoctl.preflight import machine

    sizes = {0: H100_BYTES}
    monkeypatch.setattr(machine, "local_gpus", lambda: len(sizes))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(sizes))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=sizes[i]))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    return sizes


def test_a_run_here_sizes_from_the_card_it_sees(h100):
    """A local `stapoctl train experiment=stapo_qwen3_8b` resolves cluster.name=slurm (the Table-6
    base's default) with gpu_mem_gb=80; where it runs the card (79.6 GiB) is planned with, and the
    plan says so. Planning for a cluster from elsewhere (here=False) keeps the setting."""
    conf = compose_config(["experiment=stapo_qwen3_8b", "learner.placement=colocated"])
    assert conf.cluster.name == "slurm" and not conf.cluster.address and conf.cluster.gpu_mem_gb == 80
    here = build_plan(conf)  # as train's check_config and the colocated engine spec build it
    assert here.device_gib == pytest.approx(H100_BYTES / GIB) and here.device_gib < 79.7
    assert here.device_source == "NVIDIA H100 80GB HBM3, found here; cluster.gpu_mem_gb=80 not used"
    elsewhere = build_plan(conf, here=False)
    assert elsewhere.device_gib == 80.0 and elsewhere.device_source == "cluster.gpu_mem_gb=80, read as GiB"
    assert "an 80 GB H100 shows ≈79.6 GiB: set 79" in _rendered(conf, elsewhere)
    # colocated vLLM's KV bytes come from this plan: the card's, not the preset's larger figure
    assert conf.rollout.gpu_memory_utilization == 0.6
    assert here.role("rollout").kv_cache_gib == pytest.approx(elsewhere.role("rollout").kv_cache_gib
                                                              - 0.6 * (80.0 - H100_BYTES / GIB))
    # a card equal to the setting is not flagged; the smallest of several cards is planned with
    same = build_plan(compose_config(["experiment=stapo_qwen3_8b", f"cluster.gpu_mem_gb={H100_BYTES / GIB}"]))
    assert same.device_source == "NVIDIA H100 80GB HBM3, found here"
    h100[1] = 40 * GIB
    assert build_plan(conf).device_gib == 40.0


def test_a_local_config_on_the_card_and_cpu_runs_unchanged(h100, monkeypatch):
    from stapoctl.preflight import machine

    local = compose_config(["rollout.gpus_per_worker=1", "learner.gpus_per_rank=1", "cluster.gpu_mem_gb=24"])
    assert local.cluster.name == "local" and build_plan(local).device_gib == pytest.approx(H100_BYTES / GIB)
    assert build_plan(compose_config([])).device_gib is None  # a CPU run asks no GPU: no card read
    monkeypatch.setattr(machine, "local_gpus", lambda: 0)  # no CUDA here: the setting, as before
    assert build_plan(local).device_gib == 24.0

