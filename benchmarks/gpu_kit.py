"""The GPU kit: what a session with a lent GPU measures, in one call of at most 8 minutes (needs CUDA).

    stapoctl bench gpu_kit [--out DIR] [--budget-s 450] [--parts learner_memory,ipc_transfer,nccl_broadcast]
                           [--shapes Qwen/Qwen3-0.6B-Base,Qwen/Qwen3-1.7B-Base] [--repeats 3]

1. learner_memory, per shape: stapoctl's DeepSpeed `Learner` (bf16, ZeRO-2, one rank, NCCL, the
   other fields `LearnerConfig`'s defaults: micro-batch 8, logits chunk 1024, no gradient
   checkpointing) on a random-init Qwen3 of that shape (stapoctl/config/shapes.py); the peak GPU
   memory (`max_memory_allocated` and `max_memory_reserved`) of each of two learner steps on
   gpu_learner's fixed batch (8 prompts x 8 responses, 128 + <= 1024 tokens, lr 0), held against
   the plan's estimate `stapoctl.preflight.memory.learner_memory` (ratio measured / plan; "plan":
   null with the reason where that function is missing or fails).
2. ipc_transfer: the learner's weights (0.6B shape) over CUDA IPC to a second process on the same
   GPU, through the learner's own `send_weights` and the worker extension's
   `stapo_load_weights` into a plain transformers model; vLLM's two ends are stood in for
   (benchmarks/_gpu_link.py says exactly what is stapoctl's and what stands in). 1 cold + R
   rounds, the weights negated between rounds; sha256 of four tensors and the extension's
   checksum on both sides; GB/s of the `send_weights` call (share, hand over, open, load).
3. nccl_broadcast: the 0.6B shape's parameters broadcast tensor by tensor from GPU 0 to every
   other GPU (skipped, and said so, with one GPU); GB/s and bit-equality on every rank.

Each measurement runs in its own process, so a failure, an out-of-memory or a hang loses only
itself; a part starts only while the time budget has room for it (else "skipped"). Results:
DIR/gpu_kit_<date>_<time>.json (default benchmarks/results/gpu/) and a rich table. Without a CUDA
device it prints one line and exits 2, as gpu_learner does. Not in `stapoctl bench all`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

NO_CUDA = "no CUDA device: the GPU kit runs on a machine with a GPU (see docs/PERFORMANCE.md)"
BUDGET_S = 450.0  # the whole kit, inside the 8 minutes of one call on a lent machine
# what a measurement needs at most on an H100 (imports, a model built and saved, DeepSpeed set-up,
# its steps); one starts only with this much budget left
NEEDS_S = {"learner_memory": 90.0, "ipc_transfer": 100.0, "nccl_broadcast": 60.0}
PARTS = tuple(NEEDS_S)
SHAPES = ("Qwen/Qwen3-0.6B-Base", "Qwen/Qwen3-1.7B-Base")
LINK_SHAPE = "Qwen/Qwen3-0.6B-Base"
PLAN_MODULE = "stapoctl.preflight.memory"  # learner_memory(shape, *, zero_stage, num_ranks, dtype, ...), GiB


# -- budget and parts ------------------------------------------------------------------------------
class Budget:
    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock, self.end = clock, clock() + seconds

    def left(self) -> float:
        return self.end - self.clock()


def run_part(work: Callable[[float], dict], budget: Budget, need: float) -> dict[str, Any]:
    """`work(timeout)` if the budget has `need` seconds left; its dict (status "ok" unless it says
    otherwise), "failed" with the error in one line, or "skipped" for the budget."""
    from _gpu_link import one_line

    left = budget.left()
    if left < need:
        return {"status": "skipped", "reason": f"time budget: {max(left, 0):.0f} s left, this needs ~{need:.0f} s"}
    t0 = time.perf_counter()
    try:
        out = dict(work(left))
        if "error" in out:
            out = {"status": "failed", **out}
        out.setdefault("status", "ok")
    except Exception as exc:
        out = {"status": "failed", "error": one_line(exc)}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def in_worker(payload: dict) -> Callable[[float], dict]:
    """The measurement in a fresh process (`gpu_kit.py --worker JSON`), killed at the budget's end;
    its own waits (payload "timeout") end 15 s before that."""
    import subprocess

    def work(left: float) -> dict:
        limit = max(10.0, left - 5.0)
        try:
            return H.run_worker(Path(__file__), {**payload, "timeout": max(5.0, left - 15.0)}, timeout=limit)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"still running at the budget's end ({limit:.0f} s): stopped") from None

    return work


# -- 1. learner memory -----------------------------------------------------------------------------
def learner_config(prompts: int) -> dict:
    """`LearnerConfig`'s defaults on one GPU, ZeRO-2, lr 0 (every step the same work)."""
    from dataclasses import asdict

    from stapoctl.config.schema import LearnerConfig

    lcfg = asdict(LearnerConfig())
    lcfg.update(gpus_per_rank=1, num_ranks=1, zero_stage=2, lr=0.0, warmup_steps=0, ppo_mini_batch_size=prompts)
    return lcfg


def micro_tokens(lcfg: dict, prompt_length: int, response_length: int) -> int:
    """Tokens of a full micro-batch, what a plan sizes activations by: rows x (prompt + response)."""
    return int(lcfg["micro_batch_size"]) * (prompt_length + response_length)


def learner_plan(model_id: str, lcfg: dict, tokens: int) -> tuple[Optional[dict], str]:
    """(the plan's GiB per GPU by part with "total", "") or (None, why not)."""
    from stapoctl.config.shapes import known_shape

    try:
        from stapoctl.preflight.memory import learner_memory as fn  # PLAN_MODULE
    except ImportError as exc:  # a tree without the plan's estimate: the kit still measures
        return None, f"{PLAN_MODULE}.learner_memory is not there ({type(exc).__name__}: {exc})"
    try:
        plan = fn(known_shape(model_id), zero_stage=int(lcfg["zero_stage"]), num_ranks=1, dtype="bfloat16",
                  micro_tokens=tokens, gradient_checkpointing=bool(lcfg["gradient_checkpointing"]),
                  logits_chunk=int(lcfg["logits_chunk_size"]), offload_optimizer=bool(lcfg["offload_optimizer"]))
        return {k: float(v) for k, v in plan.items()}, ""
    except Exception as exc:
        return None, f"learner_memory raised {type(exc).__name__}: {exc}"


def against_plan(measured: dict, plan: Optional[dict], note: str) -> dict:
    """The measurement with the plan and the ratios measured / plan (None without a plan)."""
    total = (plan or {}).get("total")
    ratio = (lambda key: round(measured[key] / total, 3) if total and measured.get(key) is not None else None)
    return {**measured, "plan": plan, "plan_note": note, "ratio_allocated": ratio("peak_allocated_gib"),
            "ratio_reserved": ratio("peak_reserved_gib")}


def memory_now() -> dict:
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": gib(torch.cuda.memory_allocated()),
            "peak_allocated_gib": gib(torch.cuda.max_memory_allocated()),
            "peak_reserved_gib": gib(torch.cuda.max_memory_reserved()),
            "device_used_gib": gib(total - free)}  # now, CUDA context and NCCL included


def gib(n: float) -> float:
    return round(n / 2**30, 3)


def start_learner(p: dict, model_dir: str):
    """stapoctl's Learner, rank 0 of 1, in this process (NCCL, bf16)."""
    import stapoctl.losses as L
    from stapoctl.learner.deepspeed_learner import Learner
    from stapoctl.learner.engine_setup import free_port

    lrn = Learner(0, 1)
    lrn.setup(model_dir, p["learner"], dict(vars(L.LOSSES[p["loss"]].config_cls())), n_per_prompt=p["n"],
              temperature=1.0, dtype="bfloat16", seed=0, max_response_length=p["response_length"],
              master_port=free_port())
    return lrn


def learner_memory_worker(p: dict) -> dict:
    import torch

    import gpu_learner as GL
    import stapoctl.losses as L

    tmp, lrn = Path(tempfile.mkdtemp(prefix="stapoctl-gpu-kit-")), None
    try:
        model_dir, params = GL.build_model(p["model"], tmp / "model")
        torch.cuda.reset_peak_memory_stats()
        lrn = start_learner(p, model_dir)
        torch.cuda.synchronize()
        setup = memory_now()
        batch, rewards = GL.fixed_batch(p["prompts"], p["n"], p["prompt_length"], p["response_length"])
        adv = L.compute_advantages(lrn.loss_config, rewards, batch.group_ids)
        batch = batch.with_(rewards=rewards, advantages=adv)
        steps = []
        for i in range(p["steps"]):  # the first step also creates the optimizer's state
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            lrn.train_step(batch, i + 1)
            torch.cuda.synchronize()
            steps.append({**memory_now(), "seconds": round(time.perf_counter() - t0, 3)})
        return {"model": p["model"], "params": params, "response_tokens": int(batch.response_mask.sum()),
                "setup": setup, "steps": steps,
                "peak_allocated_gib": max(s["peak_allocated_gib"] for s in steps),
                "peak_reserved_gib": max(s["peak_reserved_gib"] for s in steps),
                "device_total_gib": gib(torch.cuda.get_device_properties(0).total_memory)}
    finally:
        if lrn is not None:
            lrn.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


# -- 2. CUDA IPC -----------------------------------------------------------------------------------
def ipc_worker(p: dict) -> dict:
    import multiprocessing as mp

    import torch

    import _gpu_link as K
    import gpu_learner as GL

    tmp, lrn, recv = Path(tempfile.mkdtemp(prefix="stapoctl-gpu-kit-")), None, None
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    wait = min(120.0, p["timeout"])
    try:
        recv = ctx.Process(target=K.receiver_main, daemon=True, args=(child, p["model"], torch.cuda.current_device()))
        recv.start()  # builds its model while the learner starts
        model_dir, _ = GL.build_model(p["model"], tmp / "model")
        lrn = start_learner(p, model_dir)
        if K.answer(conn, wait) != "ready":
            raise RuntimeError("the receiver did not start")
        names = K.pick_names(lrn.module)
        conn.send(("fingerprint", names))
        before, first = K.answer(conn, wait)["hashes"], K.fingerprint(lrn.module, names)
        differed = {n: before[n] != first[n] for n in names}  # RMSNorm weights start at 1 on both
        lrn.transfer = K.IPCSender(lrn.module, conn, timeout=wait)
        rounds = []
        for r in range(p["repeats"] + 1):
            if r:
                K.flip_signs(lrn.module)
            rounds.append({"send_s": lrn.send_weights(), **lrn.transfer.replies[-1]})
        conn.send(("fingerprint", names))
        theirs = K.answer(conn, wait)
        conn.send(("stop", None))
        return link_result(lrn.module, names, differed, theirs, rounds, K)
    finally:
        conn.close()
        if recv is not None:
            recv.join(timeout=30)
            if recv.is_alive():
                recv.kill()
        if lrn is not None:
            lrn.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def link_result(module, names: list, differed: dict, theirs: dict, rounds: list, K) -> dict:
    """The figures and checks of the IPC part; `theirs`: the receiver's fingerprints at the end."""
    mine = K.fingerprint(module, names)
    size = K.param_bytes(module)
    steady = H.summary([r["send_s"] for r in rounds[1:]])
    return {"model": LINK_SHAPE, "bytes": size, "tensors": rounds[0]["tensors"], "rounds": rounds,
            "cold_s": rounds[0]["send_s"], "send_s": steady,
            "gb_per_s": size / 1e9 / steady["median"] if steady["median"] else None,
            "cold_gb_per_s": size / 1e9 / rounds[0]["send_s"],
            "differed_before": differed,
            "bit_equal": {n: theirs["hashes"][n] == mine[n] for n in names},
            "checksum_equal": theirs["checksum"] == K.PlainModelWorker(module).stapo_weight_checksum(),
            "missing": rounds[-1].get("missing", [])}


# -- 3. NCCL broadcast -----------------------------------------------------------------------------
def nccl_worker(p: dict) -> dict:
    import torch

    import _gpu_link as K

    world = min(torch.cuda.device_count(), 8)
    shapes = K.param_shapes(p["model"])
    out = K.spawn_broadcast(world, shapes, dtype="bfloat16", repeats=p["repeats"], backend="nccl",
                            device_kind="cuda", timeout=p["timeout"])
    size = sum(2 * _numel(s) for _, s in shapes)
    steady = H.summary(out["rounds_s"][1:])
    return {**out, "model": p["model"], "bytes": size, "cold_s": out["rounds_s"][0], "seconds_per_round": steady,
            "gb_per_s": size / 1e9 / steady["median"] if steady["median"] else None}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


WORKERS = {"learner_memory": learner_memory_worker, "ipc_transfer": ipc_worker, "nccl_broadcast": nccl_worker}


def worker_main(payload: str) -> int:
    """`--worker JSON`: one measurement; its last stdout line is the JSON answer (or {"error"})."""
    import traceback

    from _gpu_link import one_line

    p = json.loads(payload)
    try:
        out = WORKERS[p["part"]](p)
    except Exception as exc:
        traceback.print_exc()
        out = {"error": one_line(exc)}
    print(json.dumps(out, default=str), flush=True)
    return 0


# -- the kit ---------------------------------------------------------------------------------------
def plan_kit(a) -> list[tuple[str, str, dict]]:
    """(entry name, part, worker payload) in the order they run."""
    lcfg = learner_config(a.prompts)
    common = {"learner": lcfg, "loss": a.loss, "prompts": a.prompts, "n": a.n, "prompt_length": a.prompt_length,
              "response_length": a.response_length, "repeats": a.repeats}
    todo = []
    for part in a.parts:
        if part == "learner_memory":
            todo += [(f"learner_memory {m.split('/')[-1]}", part, {**common, "part": part, "model": m, "steps": 2})
                     for m in a.shapes]
        else:
            todo.append((part, part, {**common, "part": part, "model": LINK_SHAPE}))
    return todo


def run_kit(a, budget: Budget, gpus: int, console) -> dict[str, dict]:
    results = {}
    for name, part, payload in plan_kit(a):
        if part == "nccl_broadcast" and gpus < 2:
            entry = {"status": "skipped", "reason": f"{gpus} GPU here: the broadcast needs two or more"}
        else:
            entry = run_part(in_worker(payload), budget, NEEDS_S[part])
        if part == "learner_memory" and entry["status"] == "ok":
            lcfg = payload["learner"]
            tokens = micro_tokens(lcfg, a.prompt_length, a.response_length)
            entry = against_plan({**entry, "micro_tokens": tokens}, *learner_plan(payload["model"], lcfg, tokens))
        results[name] = entry
        console.print(f"[bold]{name}[/]: {entry['status']} ({entry.get('seconds', 0)} s) {summary_text(entry)}",
                      highlight=False, soft_wrap=True)
    return results


def summary_text(e: dict) -> str:
    """One cell: the figures of an entry, or why it has none."""
    if e["status"] != "ok":
        return e.get("error") or e.get("reason", "")
    if "peak_allocated_gib" in e:
        plan = e.get("plan") or {}
        versus = (f"; plan {plan['total']:.2f} GiB: measured/plan {e['ratio_allocated']:.2f}x allocated, "
                  f"{e['ratio_reserved']:.2f}x reserved" if plan.get("total") else f"; plan: none ({e['plan_note']})")
        return (f"{e['params'] / 1e9:.2f}B params, step peak {e['peak_allocated_gib']:.2f} GiB allocated, "
                f"{e['peak_reserved_gib']:.2f} GiB reserved" + versus)
    if "bit_equal" in e and isinstance(e["bit_equal"], dict):
        equal = sum(e["bit_equal"].values())
        return (f"{e['bytes'] / 1e9:.2f} GB, {e['tensors']} tensors: {H.fmt(e['send_s']['median'], 's')} = "
                f"{H.fmt(e['gb_per_s'], 'GB/s')} (cold {H.fmt(e['cold_s'], 's')}); {equal}/{len(e['bit_equal'])} "
                f"tensors bit-equal, checksum {'equal' if e['checksum_equal'] else 'DIFFERS'}"
                + (f"; NOT LOADED: {', '.join(e['missing'])}" if e.get("missing") else ""))
    if "world" in e:
        return (f"{e['bytes'] / 1e9:.2f} GB to {e['world'] - 1} GPU(s): "
                f"{H.fmt(e['seconds_per_round']['median'], 's')} = {H.fmt(e['gb_per_s'], 'GB/s')}; "
                f"{'bit-equal' if e['bit_equal'] else 'DIFFERS'} on every rank")
    return ""


def print_table(results: dict, console, title: str) -> None:
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for col in ("part", "status", "result", "s"):
        table.add_column(col, overflow="fold")
    for name, e in results.items():
        table.add_row(name, e["status"], summary_text(e), str(e.get("seconds", "")))
    console.print(table)


def save(results: dict, a, *, env: dict, seconds: float) -> Path:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu_kit_{time.strftime('%Y-%m-%d_%H%M%S')}.json"
    payload = {"bench": "gpu_kit", "command": " ".join(["stapoctl", "bench", "gpu_kit", *sys.argv[1:]]),
               "seconds": round(seconds, 1), "budget_s": a.budget_s, "environment": env,
               "config": {k: v for k, v in vars(a).items() if k not in ("out", "worker")}, "parts": results}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(H.RESULTS / "gpu"), help="results folder (default benchmarks/results/gpu)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help=f"time budget of the whole kit, seconds (default {BUDGET_S:.0f})")
    p.add_argument("--parts", default=",".join(PARTS), help=f"which parts (default all: {','.join(PARTS)})")
    p.add_argument("--shapes", default=",".join(SHAPES), help="learner_memory's shapes (stapoctl/config/shapes.py ids)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of the transfers after a cold one (default 3)")
    p.add_argument("--loss", default="stapo")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--response-length", type=int, default=1024)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    a.shapes = [x.strip() for x in a.shapes.split(",") if x.strip()]
    bad = [x for x in a.parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {', '.join(bad)} (have: {', '.join(PARTS)})")
    from stapoctl.config.shapes import QWEN3_SHAPES, known_shape

    bad = [x for x in a.shapes if known_shape(x) is None]
    if bad:
        p.error(f"--shapes: unknown {', '.join(bad)} (have: {', '.join(QWEN3_SHAPES)})")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        return worker_main(a.worker)
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, flush=True)
        return 2
    from rich.console import Console

    console, t0 = Console(), time.perf_counter()
    budget, gpus = Budget(a.budget_s), torch.cuda.device_count()
    env = {**H.environment(), "gpu": torch.cuda.get_device_name(0), "gpu_count": gpus,
           "cuda": torch.version.cuda, "nccl": str(torch.cuda.nccl.version())}
    console.print(f"gpu_kit on {gpus} x {env['gpu']}, budget {a.budget_s:.0f} s", highlight=False)
    results = run_kit(a, budget, gpus, console)
    seconds = time.perf_counter() - t0
    print_table(results, console, title=f"gpu_kit ({seconds:.0f} s, {env['gpu']})")
    console.print(f"results: {save(results, a, env=env, seconds=seconds)}", highlight=False, soft_wrap=True)
    return 1 if any(e["status"] == "failed" for e in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
