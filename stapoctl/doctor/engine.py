"""The slow checks, on the trainer's own engines (`trainer.engines.launch_engines`, so the path
is the one a run takes), in the run's own topology: its rollout workers (× TP ranks) and learner
ranks on the run's model, without the KL reference. Four rows: the engines start; the KV cache
vLLM reports against the expected figure (CPU: rollout.kv_cache_gb; GPU: the memory plan's); the
linked transport's ranks (each vLLM worker process its own); and a weight-sync canary — the
learner's weights perturbed, pushed through the run's transport, and the log-probs of a fixed
sequence compared on every worker (max |Δ logp|: one fixed sequence, no tail to fear; the trainer's canary reads the p99)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from stapoctl.doctor.rows import Row, failed, from_error, not_applicable, passed

# max |Δ logp| after a sync: fp32 stays at float noise (~5e-6 measured here; the e2e tests hold the
# training canary under 1e-4); bf16/fp16 kernels of vLLM and the learner differ by ~6e-2-9e-2
SYNC_TOLERANCE = {"float32": 1e-4, "fp32": 1e-4}
SYNC_TOLERANCE_LOW_PRECISION = 0.25
PERTURB_SCALE = 0.2  # × each weight tensor's std: the same relative change at 0.5M or 8B parameters
KV_SHORTFALL = 0.9  # vLLM got less than this share of the expected KV cache: FAIL
ENGINES_FIX = ("run `stapoctl train trainer.total_steps=1` to see the engines' own error, or check "
               "rollout.kv_cache_gb / rollout.gpu_memory_utilization and the model's dtype")


def sync_tolerance(dtype: str) -> float:
    return SYNC_TOLERANCE.get(str(dtype), SYNC_TOLERANCE_LOW_PRECISION)


def _on_gpu(conf: DictConfig) -> bool:
    return float(conf.rollout.gpus_per_worker or 0) > 0 or float(conf.learner.gpus_per_rank or 0) > 0


def _expected_kv_gib(conf: DictConfig) -> Optional[float]:
    """The KV cache the run expects per rollout worker, GiB: rollout.kv_cache_gb on CPU; on a
    GPU the memory plan's figure (None when the plan cannot size the model)."""
    if not _on_gpu(conf):
        return float(conf.rollout.kv_cache_gb)
    from stapoctl.preflight.memory_plan import build_plan

    rollout = build_plan(conf).role("rollout")
    return None if rollout is None or rollout.kv_cache_gib is None else float(rollout.kv_cache_gib)


def kv_row(reported: float, expected: Optional[float], source: str, tp: int = 1) -> Row:
    """The KV cache vLLM allocated (`reported`: summed over its `tp` tensor-parallel ranks, as
    `vllm_engine.kv_cache_gib` gives it) per rank against the expected per-GPU figure (less than
    KV_SHORTFALL of it fails). Per rank: at TP 2 a sum read ≈2× and could not fail (#49 R6)."""
    tp = max(1, int(tp))
    got = f"vLLM allocated {reported:.3g} GiB of KV cache"
    if tp > 1:
        got = f"vLLM allocated {reported / tp:.3g} GiB of KV cache per rank (TP {tp}: {reported:.3g} in all)"
    reported = reported / tp
    if expected is None:
        return passed("vLLM KV cache", f"{got} (no expected figure: the plan cannot size this model)")
    if reported < KV_SHORTFALL * expected:
        return failed("vLLM KV cache", f"{got}, expected {expected:.3g} GiB ({source})",
                      "lower rollout.max_response_length / data.max_prompt_length, raise rollout.gpu_memory_utilization, "
                      "or check what else holds the GPU's memory (nvidia-smi)")
    return passed("vLLM KV cache", f"{got}, expected {expected:.3g} GiB ({source})")


def sync_row(before: float, after: float, tolerance: float, sync_s: float, method: str) -> Row:
    """After the push vLLM's log-probs equal the learner's within `tolerance`; before it, the
    perturbed learner differed (else the canary could not see a sync that did nothing)."""
    detail = (f"max |Δ logp| {after:.1e} after the sync ({method}, {sync_s * 1e3:.0f} ms), {before:.1e} before; "
              f"tolerance {tolerance:g}")
    if not after <= tolerance:
        return failed("weight sync", detail, "vLLM does not hold the learner's weights after a sync: check "
                      "rollout.weight_sync and model.dtype (run tests/test_weight_sync.py)")
    if not before > after:
        return failed("weight sync", detail, "the perturbed learner's log-probs equal vLLM's before the sync: "
                      "the canary cannot see the sync (report this)")
    return passed("weight sync", detail)


def canary_rows(ranks: int) -> int:
    """Rows of the canary's batch: at least 4, a multiple of 2 (two prompts) and of the learner ranks,
    which each take an equal slice (a rank with none made the all-gather fail: issue #49 BUG-3)."""
    step = math.lcm(2, max(1, int(ranks)))
    return step * math.ceil(4 / step)


def fixed_batch(model_path: str, pad_id: int, ranks: int = 1):
    """A fixed sequence (two 12-token prompts with `canary_rows(ranks)` / 2 12-token responses each),
    ids drawn with a seeded generator below the model's vocabulary, as a `RolloutBatch`."""
    import torch

    from stapoctl.rollout.batch import RolloutBatch

    try:
        vocab = int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        vocab = 512
    g = torch.Generator().manual_seed(1234)
    high = max(8, min(vocab, 4096))
    prompts = [torch.randint(3, high, (12,), generator=g).tolist() for _ in range(2)]
    per = canary_rows(ranks) // 2
    resps = [[torch.randint(3, high, (12,), generator=g).tolist() for _ in range(per)] for _ in prompts]
    zeros = [[[0.0] * len(r) for r in rs] for rs in resps]
    return RolloutBatch.from_token_lists(prompts, resps, zeros, [[False] * per] * 2, [[""] * per] * 2, pad_id=pad_id)


def _max_diff(a, b, mask) -> float:
    import torch

    return float(torch.where(mask, (a - b).abs(), 0.0).max())


def canary(engines: Any, model_path: str) -> tuple[float, float, float]:
    """(max |Δ logp| before the sync, after it — the smallest and the largest over every rollout
    worker —, the push's seconds) on the fixed batch. Every learner rank is perturbed alike."""
    import ray

    batch = fixed_batch(model_path, int(engines.info.get("pad_token_id") or 0), ranks=len(engines.learners))
    engines.learners.perturb_weights(PERTURB_SCALE, seed=7, relative=True)
    # at T = 1 without top-p: vLLM's prompt log-probs are the model's own whatever the run samples with
    learner_lp = engines.learners.compute_log_probs(batch, raw=True)["log_prob"]

    def diffs() -> list[float]:
        return [_max_diff(s, learner_lp, batch.response_mask)
                for s in ray.get([w.score_batch.remote(batch) for w in engines.workers])]

    before = min(diffs())
    t0 = time.perf_counter()
    engines.push_weights()
    sync_s = time.perf_counter() - t0
    return before, max(diffs()), sync_s


def ranks_row(engines: Any, tp_size: int) -> Row:
    """A linked transport: every vLLM worker process holds its own rank, 1 … workers × TP (rank 0 is
    the learner's); two engines on one rank would hang the rendezvous of a real cluster run."""
    import ray

    from stapoctl.sync.transports import transport

    method = engines.info["sync_method"]
    if not transport(method).rendezvous:
        return ranks_verdict(method, [], len(engines.workers), tp_size)
    ranks = [r for per in ray.get([w.transfer_ranks.remote() for w in engines.workers]) for r in per]
    return ranks_verdict(method, ranks, len(engines.workers), tp_size)


def ranks_verdict(method: str, ranks: list, workers: int, tp_size: int) -> Row:
    """The row from the ranks the worker processes report (`worker_extension.transfer_rank`)."""
    from stapoctl.sync.transports import transport

    t = transport(method)
    if t.vllm_backend is None:
        return not_applicable("transfer ranks", f"{method}: no process group (each actor loads from the object store)")
    if not t.rendezvous:
        return not_applicable("transfer ranks", f"{method}: no process group (each vLLM worker opens the learner's "
                              "CUDA IPC handles on its own GPU)")
    want = list(range(1, 1 + workers * int(tp_size)))
    detail = f"{method}: {workers} engine(s) × TP {tp_size} on ranks {ranks} (learner rank 0)"
    if sorted(ranks) != want:
        return failed("transfer ranks", detail, f"expected each of {want} once: report this (sync/client.py)")
    return passed("transfer ranks", detail)


def doctor_engine_conf(conf: DictConfig) -> DictConfig:
    """The run's config as it is (workers, TP, learner ranks, transport), without the KL reference:
    the doctor checks the run's topology and needs no second copy of the model."""
    out = OmegaConf.create(OmegaConf.to_container(conf, resolve=True))
    out.loss.kl_coef = 0.0
    return out


def learner_fit(conf: DictConfig) -> Optional[str]:
    """Why a learner rank cannot even hold the model's weights on one GPU (None: it can, or CPU)."""
    if float(conf.learner.gpus_per_rank or 0) <= 0:
        return None
    from stapoctl.preflight.memory_plan import build_plan
    from stapoctl.preflight.memory import dtype_bytes

    try:
        plan = build_plan(conf)
    except Exception:  # the plan cannot size the model: let the engines say
        return None
    need = plan.params * dtype_bytes(conf.model.dtype) / 2**30
    if plan.device_gib is not None and need > plan.device_gib:
        return (f"the model's weights alone ({need:.1f} GiB in {conf.model.dtype}) exceed one GPU's "
                f"{plan.device_gib:.0f} GiB: the run needs learner.zero_stage=3 over its ranks, which the doctor "
                "does not start")
    return None


def engine_rows(conf: DictConfig, model_path: Optional[str], status=None) -> list[Row]:
    """Start the engines, read the KV cache, run the sync canary, stop them (and the Ray it started)."""
    names = ("engines start", "vLLM KV cache", "transfer ranks", "weight sync")
    if not model_path:
        return [not_applicable(n, "not run: needs the model (its row FAILs above)") for n in names]
    too_big = learner_fit(conf)
    if too_big:
        return [not_applicable(n, f"not run: {too_big}") for n in names]
    import ray

    from stapoctl.launch.ray_runtime import shutdown_ray
    from stapoctl.trainer.engines import launch_engines
    from stapoctl.trainer.setup import quiet_engine_logs

    dconf = doctor_engine_conf(conf)
    quiet_engine_logs(dconf)
    engines, rows, was_up = None, [], ray.is_initialized()
    say = status or (lambda msg: None)
    t0 = time.perf_counter()
    try:
        say(f"starting {dconf.rollout.num_workers} vLLM actor(s) (TP {dconf.rollout.tensor_parallel_size}) and "
            f"{dconf.learner.num_ranks} DeepSpeed learner rank(s) on {model_path}…")
        engines = launch_engines(dconf, model_path).ready()
        info = engines.info
        rows.append(passed("engines start", f"vLLM + learner up in {time.perf_counter() - t0:.0f} s (vLLM "
                           f"{info['vllm_init_s']:.0f} s, learner {info['learner_setup_s']:.0f} s, in parallel)"))
        rows.append(_kv(conf, engines))
        rows.append(ranks_row(engines, int(dconf.rollout.tensor_parallel_size)))
        say("weight-sync canary: learner → every vLLM actor, log-probs of a fixed sequence…")
        before, after, sync_s = canary(engines, model_path)
        rows.append(sync_row(before, after, sync_tolerance(conf.model.dtype), sync_s, info["sync_method"]))
    except Exception as exc:
        done = {r.check for r in rows}
        rows.append(from_error(next(n for n in names if n not in done), exc, ENGINES_FIX))
        rows += [not_applicable(n, "not run: the check above failed") for n in names if n not in done][1:]
    finally:  # a failed launch_engines / ready() has stopped its own actors already
        if engines is not None:
            engines.shutdown()
        if not was_up and ray.is_initialized():
            shutdown_ray()
    return rows


def _kv(conf: DictConfig, engines: Any) -> Row:
    import ray

    reported = float(ray.get(engines.workers[0].kv_cache_gib.remote()))
    source = "the memory plan" if _on_gpu(conf) else f"rollout.kv_cache_gb={float(conf.rollout.kv_cache_gb):g}"
    try:
        expected = _expected_kv_gib(conf)
    except Exception as exc:  # the plan cannot size the model here
        return passed("vLLM KV cache", f"vLLM allocated {reported:.3g} GiB of KV cache (no plan: "
                      f"{(str(exc).splitlines() or [''])[0][:120]})")
    return kv_row(reported, expected, source, tp=int(conf.rollout.tensor_parallel_size))
