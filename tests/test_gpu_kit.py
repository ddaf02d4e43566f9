"""The GPU kit (`stapoctl bench gpu_kit`) where there is no GPU: its no-CUDA answer, and the pieces
of it that run the same on a CPU: the weight loading through the worker extension, the IPC
update's bookkeeping, the broadcast (gloo instead of NCCL), the plan comparison, the time budget
and the results file. Nothing here is a GPU measurement."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _gpu_link as K  # noqa: E402
import gpu_kit  # noqa: E402


def tiny_qwen3(seed: int, dtype=torch.bfloat16):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).to(dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_without_cuda_the_kit_says_so_in_one_line_and_exits_like_gpu_learner():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kit.py")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert [line for line in out.stdout.splitlines() if line.strip()] == [gpu_kit.NO_CUDA]
    assert "Traceback" not in out.stderr


def test_stapoctl_bench_finds_the_kit_and_bench_all_leaves_it_out():
    import _suite

    assert (ROOT / "benchmarks" / "gpu_kit.py").is_file()  # `stapoctl bench` runs benchmarks/<name>.py
    assert "gpu_kit" not in _suite.scripts()


@pytest.mark.parametrize("payload", ["tensors", "object_store views", "rpc bytes"])
def test_weights_load_bit_equal_through_the_worker_extension(payload):
    """The receiving end of the kit: `WeightSyncExtension.stapo_load_weights` (+ `unpack`) into a
    plain model, fed what the learner sends: (name, tensor) as opened from IPC handles, or the
    CPU path's packings of the same tensors."""
    from stapoctl.sync.worker_extension import pack_for_rpc, raw_views

    sender, receiver = tiny_qwen3(0), tiny_qwen3(1)
    names = K.pick_names(sender)
    assert K.fingerprint(receiver, names) != K.fingerprint(sender, names)
    items = list(sender.named_parameters())
    items = {"tensors": items, "object_store views": raw_views(items), "rpc bytes": pack_for_rpc(items)}[payload]
    worker = K.PlainModelWorker(receiver)
    assert worker.stapo_load_weights(items) == len(list(sender.parameters()))
    assert worker.missing() == []
    assert K.fingerprint(receiver, names) == K.fingerprint(sender, names)
    assert all(torch.equal(a, b) for a, b in zip(sender.parameters(), receiver.parameters()))
    assert worker.stapo_weight_checksum() == K.PlainModelWorker(sender).stapo_weight_checksum()


def test_the_receiving_worker_refuses_a_name_or_shape_its_model_lacks():
    worker = K.PlainModelWorker(tiny_qwen3(0))
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        worker.stapo_load_weights([("nope", torch.zeros(2))])
    with pytest.raises(ValueError, match="shape"):
        worker.stapo_load_weights([("model.norm.weight", torch.zeros(3))])


def test_ipc_update_keeps_names_dtypes_shapes_and_rewrites_the_device():
    """share_weights/open_weights with stand-ins for torch's reduce/rebuild (no CUDA here): the
    update's fields, one handle per tensor keyed by GPU UUID, argument 6 = the receiver's device."""
    store = {}

    def reduce(t):
        store[len(store)] = t
        return None, (len(store) - 1, 0, 0, 0, 0, 0, 0)  # args[6]: the sender's device index

    def rebuild(key, *rest):
        assert rest[5] == 3  # rewritten to the receiver's device index
        return store[key]

    named = [("a", torch.ones(2, 3, dtype=torch.bfloat16)), ("b", torch.arange(4.0)[::2])]  # b not contiguous
    update, refs = K.share_weights(named, "GPU-x", reduce=reduce)
    assert update["names"] == ["a", "b"] and update["dtype_names"] == ["bfloat16", "float32"]
    assert update["shapes"] == [[2, 3], [2]] and [list(h) for h in update["ipc_handles"]] == [["GPU-x"]] * 2
    assert all(r.is_contiguous() for r in refs)
    opened = K.open_weights(update, "GPU-x", 3, rebuild=rebuild)
    assert [n for n, _ in opened] == ["a", "b"] and torch.equal(opened[1][1], torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match="no IPC handle for GPU GPU-y"):
        K.open_weights(update, "GPU-y", 0, rebuild=rebuild)


def test_broadcast_reaches_every_rank_bit_equal_on_cpu_gloo():
    shapes = [("w", [64, 32]), ("b", [32])]
    out = K.spawn_broadcast(2, shapes, dtype="float32", repeats=1, backend="gloo", device_kind="cpu", timeout=120)
    assert out["world"] == 2 and out["bit_equal"] is True and len(out["rounds_s"]) == 2


def test_param_shapes_follow_the_shapes_table():
    import gpu_learner

    from stapoctl.config.shapes import QWEN3_SHAPES

    assert set(gpu_learner.SHAPES.values()) == set(QWEN3_SHAPES) and gpu_learner.SHAPES["qwen3-0.6b"] in gpu_kit.SHAPES
    shapes = K.param_shapes("Qwen/Qwen3-0.6B-Base")
    assert sum(gpu_kit._numel(s) for _, s in shapes) == 596_049_920  # tied embeddings counted once
    assert shapes[0] == ("model.embed_tokens.weight", [151_936, 1024])


def test_plan_is_null_with_the_reason_when_the_estimate_is_missing_or_fails(monkeypatch):
    lcfg = gpu_kit.learner_config(prompts=8)
    assert (lcfg["zero_stage"], lcfg["num_ranks"], lcfg["gpus_per_rank"]) == (2, 1, 1)
    tokens = gpu_kit.micro_tokens(lcfg, 128, 1024)
    assert tokens == lcfg["micro_batch_size"] * 1152
    monkeypatch.setitem(sys.modules, gpu_kit.PLAN_MODULE, None)  # import fails, as before it exists
    plan, note = gpu_kit.learner_plan("Qwen/Qwen3-0.6B-Base", lcfg, tokens)
    assert plan is None and "learner_memory is not there" in note
    entry = gpu_kit.against_plan({"peak_allocated_gib": 9.0, "peak_reserved_gib": 10.0}, plan, note)
    assert entry["plan"] is None and entry["ratio_allocated"] is None
    assert json.loads(json.dumps(entry))["plan"] is None

    def broken(shape, **kw):
        raise ValueError("no such field")

    monkeypatch.setitem(sys.modules, gpu_kit.PLAN_MODULE, types.SimpleNamespace(learner_memory=broken))
    assert gpu_kit.learner_plan("Qwen/Qwen3-0.6B-Base", lcfg, tokens) == (
        None, "learner_memory raised ValueError: no such field")


def test_measured_over_plan_with_the_plans_inputs(monkeypatch):
    seen = {}

    def learner_memory(shape, **kw):
        seen.update(shape=shape, **kw)
        return {"weights": 1.0, "optimizer": 2.0, "total": 4.0}

    monkeypatch.setitem(sys.modules, gpu_kit.PLAN_MODULE, types.SimpleNamespace(learner_memory=learner_memory))
    lcfg = gpu_kit.learner_config(prompts=8)
    plan, note = gpu_kit.learner_plan("Qwen/Qwen3-1.7B-Base", lcfg, 9216)
    assert note == "" and plan["total"] == 4.0
    assert seen["shape"]["hidden_size"] == 2048
    assert {k: seen[k] for k in ("zero_stage", "num_ranks", "dtype", "micro_tokens", "gradient_checkpointing",
                                 "logits_chunk", "offload_optimizer")} == {
        "zero_stage": 2, "num_ranks": 1, "dtype": "bfloat16", "micro_tokens": 9216,
        "gradient_checkpointing": lcfg["gradient_checkpointing"], "logits_chunk": lcfg["logits_chunk_size"],
        "offload_optimizer": False}
    entry = gpu_kit.against_plan({"peak_allocated_gib": 5.0, "peak_reserved_gib": 6.0}, plan, note)
    assert (entry["ratio_allocated"], entry["ratio_reserved"]) == (1.25, 1.5)


def test_budget_skips_a_part_that_would_not_fit_and_keeps_failures_to_their_part():
    now = [0.0]
    budget = gpu_kit.Budget(100.0, clock=lambda: now[0])
    calls = []
    ok = gpu_kit.run_part(lambda left: calls.append(left) or {"x": 1}, budget, need=50.0)
    assert ok["status"] == "ok" and ok["x"] == 1 and calls == [100.0]
    failed = gpu_kit.run_part(lambda left: 1 / 0, budget, need=50.0)
    assert failed["status"] == "failed" and failed["error"].startswith("ZeroDivisionError")
    said = gpu_kit.run_part(lambda left: {"error": "OutOfMemoryError: CUDA out of memory"}, budget, need=50.0)
    assert said["status"] == "failed" and "out of memory" in said["error"]
    now[0] = 60.0
    skipped = gpu_kit.run_part(lambda left: calls.append(left) or {}, budget, need=50.0)
    assert skipped["status"] == "skipped" and "40 s left" in skipped["reason"] and len(calls) == 1


def test_kit_order_and_payloads():
    a = gpu_kit.parse([])
    todo = gpu_kit.plan_kit(a)
    assert [name for name, _, _ in todo] == ["learner_memory Qwen3-0.6B-Base", "learner_memory Qwen3-1.7B-Base",
                                             "ipc_transfer", "nccl_broadcast"]
    assert all(json.loads(json.dumps(p))["part"] == part for _, part, p in todo)
    with pytest.raises(SystemExit):
        gpu_kit.parse(["--parts", "learner_memory,warp_drive"])
    with pytest.raises(SystemExit):
        gpu_kit.parse(["--shapes", "Qwen/Qwen3-0.5T"])


def test_results_file_and_table(tmp_path):
    from rich.console import Console

    results = {
        "learner_memory Qwen3-0.6B-Base": gpu_kit.against_plan(
            {"status": "ok", "seconds": 40.0, "params": 596_049_920, "peak_allocated_gib": 9.5,
             "peak_reserved_gib": 11.0}, None, "stapoctl.preflight.memory.learner_memory is not there"),
        "ipc_transfer": {"status": "failed", "error": "RuntimeError: receiver: boom", "seconds": 3.0},
        "nccl_broadcast": {"status": "skipped", "reason": "1 GPU here: the broadcast needs two or more"},
    }
    console = Console(record=True, width=200)
    gpu_kit.print_table(results, console, title="gpu_kit")
    text = console.export_text()
    assert "9.50 GiB allocated" in text and "plan: none" in text and "receiver: boom" in text
    a = gpu_kit.parse(["--out", str(tmp_path)])
    path = gpu_kit.save(results, a, env={"gpu": "test"}, seconds=1.0)
    assert path.parent == tmp_path and path.name.startswith("gpu_kit_") and path.suffix == ".json"
    saved = json.loads(path.read_text())
    assert saved["bench"] == "gpu_kit" and saved["parts"]["learner_memory Qwen3-0.6B-Base"]["plan"] is None


def test_the_kit_runs_its_parts_in_order_and_reports_each(monkeypatch):
    """run_kit with stand-in workers (their answers shaped as the real ones are): the plan joins
    each learner entry, a failure stays in its part, the table has a line per entry."""
    from rich.console import Console

    module, other = tiny_qwen3(0), tiny_qwen3(1)
    names = K.pick_names(module)
    differed = {n: a != b for (n, a), b in zip(K.fingerprint(other, names).items(),
                                                 K.fingerprint(module, names).values())}
    assert list(differed.values()) == [True, True, True, False]  # the final norm: ones in both
    link = gpu_kit.link_result(module, names, differed,
                               {"hashes": K.fingerprint(module, names),
                                "checksum": K.PlainModelWorker(module).stapo_weight_checksum()},
                               [{"send_s": 0.5, "tensors": 23, "missing": []}] + [{"send_s": 0.1, "tensors": 23}] * 3, K)
    assert all(link["bit_equal"].values()) and link["checksum_equal"] and link["differed_before"] == differed
    assert link["gb_per_s"] == pytest.approx(K.param_bytes(module) / 1e9 / 0.1)
    answers = {
        "learner_memory": lambda p: {"model": p["model"], "params": 596_049_920, "peak_allocated_gib": 20.0,
                                     "peak_reserved_gib": 22.0, "steps": []},
        "ipc_transfer": lambda p: link,
        "nccl_broadcast": lambda p: {"error": "RuntimeError: rank 1: NCCL error"},
    }
    monkeypatch.setattr(gpu_kit, "in_worker", lambda payload: lambda left: answers[payload["part"]](payload))
    monkeypatch.setitem(sys.modules, gpu_kit.PLAN_MODULE, types.SimpleNamespace(
        learner_memory=lambda shape, **kw: {"total": 16.0 if shape["hidden_size"] == 1024 else 40.0}))
    console = Console(record=True, width=240)
    results = gpu_kit.run_kit(gpu_kit.parse([]), gpu_kit.Budget(450.0), 2, console)
    assert [e["status"] for e in results.values()] == ["ok", "ok", "ok", "failed"]
    assert results["learner_memory Qwen3-0.6B-Base"]["ratio_allocated"] == 1.25
    assert results["learner_memory Qwen3-1.7B-Base"]["ratio_reserved"] == 0.55
    text = console.export_text()
    assert "measured/plan 1.25x allocated" in text and "4/4 tensors bit-equal, checksum equal" in text
    assert "NCCL error" in text
    one_gpu = gpu_kit.run_kit(gpu_kit.parse(["--parts", "nccl_broadcast"]), gpu_kit.Budget(450.0), 1, console)
    assert one_gpu["nccl_broadcast"]["status"] == "skipped"


def test_the_plans_own_estimate_answers_for_both_shapes():
    pytest.importorskip(gpu_kit.PLAN_MODULE)
    lcfg = gpu_kit.learner_config(prompts=8)
    for model in gpu_kit.SHAPES:
        plan, note = gpu_kit.learner_plan(model, lcfg, gpu_kit.micro_tokens(lcfg, 128, 1024))
        assert note == "" and plan["total"] > 0, (model, note)
