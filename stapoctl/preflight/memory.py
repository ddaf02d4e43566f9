"""Memory of each role on one device, in GiB, from the model's architecture and the run's config.

Model states (weights, gradients, optimizer) come from DeepSpeed's own estimators for ZeRO-2/3
(`estimate_zero{2,3}_model_states_mem_needs`); ZeRO-0/1 and fp32 training have none, so they use
the same per-parameter accounting read from DeepSpeed's optimizers (`BYTES_PER_PARAM`, the table
in docs/TRAINING.md). Activations, the log-prob chunk of `token_stats` and the KV cache are ours:
the per-token formulas below, stated where they are computed. All figures are estimates; the
error measured against real peaks is in docs/TRAINING.md ("How good is the plan").
"""

from __future__ import annotations

import math
from typing import Optional

from stapoctl.preflight.model_shape import parameter_count

GIB = 2**30
# CUDA context, cuBLAS/NCCL workspaces and the caching allocator's slack of one process (typical
# H100 figures: the context alone is ~0.5 GiB), and on CPU the interpreter with torch, DeepSpeed
# and transformers imported (measured: docs/TRAINING.md)
RUNTIME_GIB = {"gpu": 1.0, "cpu": 0.9}
# vLLM's default batch for the LLM class on a GPU: the profile run forwards this many tokens
VLLM_PROFILE_TOKENS = 16384
VLLM_MAX_SEQS = 256


def dtype_bytes(dtype: str) -> int:
    return 2 if str(dtype) in ("bfloat16", "bf16", "float16", "fp16", "half") else 4


def _quiet_deepspeed() -> None:
    """DeepSpeed announces a CPU accelerator at import on a machine without CUDA: name it first."""
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _largest_layer(shape: dict) -> int:
    """Parameters of the largest single module (ZeRO-3 gathers one at a time): the embedding."""
    h = int(shape["hidden_size"])
    return max(int(shape["vocab_size"]) * h, h * int(shape["intermediate_size"]))


def _zero_states_bytes(params: int, shape: dict, *, stage: int, ranks: int, offload: bool) -> float:
    """Bytes per GPU of weights + gradients + optimizer states for mixed-precision (16-bit) Adam."""
    _quiet_deepspeed()
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=ranks, cpu_offload=offload)
        return float(gpu)
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, gpu, _ = estimate_zero3_model_states_mem_needs(params, _largest_layer(shape), num_gpus_per_node=ranks,
                                                          cpu_offload=offload, cpu_offload_params=False)
        return float(gpu)
    return params * bytes_per_param(stage, ranks, bf16=True, offload=offload)


def bytes_per_param(stage: int, ranks: int, *, bf16: bool, offload: bool = False) -> float:
    """Model-state bytes per parameter on one rank (read from DeepSpeed's optimizers):
    16-bit: ZeRO-0 (FP16_Optimizer for bf16) keeps 2 bf16 weights + 2 bf16 grads + 4 fp32 master
    + 4 fp32 grads + 8 Adam = 20; ZeRO-1 partitions the fp32 part: 4 + 16/N; ZeRO-2 also the bf16
    grads: 2 + 18/N; ZeRO-3 everything: 18/N (+ the largest layer gathered).
    fp32: ZeRO-0 4 weights + 4 grads + 8 Adam = 16; ZeRO-1 8 + 16/N (a cloned fp32 master
    partition); ZeRO-2 4 + 16/N; ZeRO-3 20/N. Offload moves the optimizer's part to the host (ZeRO-2: the gradient partition too, as
    DeepSpeed's estimator has it)."""
    n = max(1, int(ranks))
    if bf16:
        table = {0: (4.0, 16.0, 16.0), 1: (4.0, 16.0 / n, 16.0 / n), 2: (2.0, 18.0 / n, 18.0 / n),
                 3: (0.0, 18.0 / n, 16.0 / n)}
    else:
        table = {0: (8.0, 8.0, 8.0), 1: (8.0, 16.0 / n, 16.0 / n), 2: (4.0, 16.0 / n, 16.0 / n),
                 3: (0.0, 20.0 / n, 12.0 / n)}
    fixed, sharded, offloadable = table[int(stage)]
    if offload and int(stage) >= 1:
        sharded -= offloadable
    return fixed + sharded


def activation_elems_per_token_layer(shape: dict) -> int:
    """Elements one decoder layer keeps for its backward per token (flash/SDPA attention, no
    [T, T] scores): norm inputs (2h), q/k-norm inputs (q + kv), attention's q, k, v and output
    (2q + 2kv), the MLP's input (h), gate, up, silu(gate) and their product (4I)."""
    h, inter = int(shape["hidden_size"]), int(shape["intermediate_size"])
    heads = int(shape["num_attention_heads"])
    hd = int(shape.get("head_dim") or h // heads)
    q, kv = heads * hd, int(shape.get("num_key_value_heads") or heads) * hd
    return 3 * h + 3 * q + 3 * kv + 4 * inter


def learner_memory(shape: dict, *, zero_stage: int, num_ranks: int, dtype: str, micro_tokens: int,
                   gradient_checkpointing: bool, logits_chunk: int, offload_optimizer: bool = False,
                   on_gpu: bool = True, entropy_grad: bool = False, seq_len: Optional[int] = None,
                   logit_tokens: Optional[int] = None) -> dict[str, float]:
    """GiB on one learner rank, by part, with "total" (the parts that count) and the activations
    of the other checkpointing choice as "activations_if_checkpointing_flipped". `seq_len` (tokens
    per sequence) sizes the attention scores a CPU learner keeps (below); `logit_tokens` the
    positions a ZeRO-3 forward computes logits for (default: all of micro_tokens)."""
    params = parameter_count(shape)
    d = dtype_bytes(dtype)
    bf16 = d == 2
    if bf16:
        states = _zero_states_bytes(params, shape, stage=zero_stage, ranks=num_ranks, offload=offload_optimizer)
    else:
        states = params * bytes_per_param(zero_stage, num_ranks, bf16=False, offload=offload_optimizer)
        if zero_stage == 3:
            states += 4 * _largest_layer(shape)
    layers, h, vocab = int(shape["num_hidden_layers"]), int(shape["hidden_size"]), int(shape["vocab_size"])
    full = layers * activation_elems_per_token_layer(shape) * micro_tokens * d
    # checkpointing keeps each layer's input and recomputes one layer at a time in the backward
    ckpt = (layers * h + activation_elems_per_token_layer(shape)) * micro_tokens * d
    chunk = min(int(logits_chunk), micro_tokens)
    # token_stats from the hidden states: a [chunk, V] logits slice in the weight's dtype and two
    # fp32 [chunk, V] buffers (+1 for an entropy gradient); ZeRO-3 goes through the module's
    # logits instead: [tokens, V] of the positions it keeps in the weight's dtype, and its gradient
    logits = chunk * vocab * (d + 4 * (3 if entropy_grad else 2)) + micro_tokens * h * (d + 4)
    if zero_stage == 3:
        logits += 2 * (micro_tokens if logit_tokens is None else logit_tokens) * vocab * d
    parts = {
        "model_states": states / GIB,
        "activations": (ckpt if gradient_checkpointing else full) / GIB,
        "activations_if_checkpointing_flipped": (full if gradient_checkpointing else ckpt) / GIB,
        "logits_chunk": logits / GIB,
        "deepspeed_buffers": deepspeed_buffers(zero_stage, d, params, num_ranks) / GIB,
        "runtime": RUNTIME_GIB["gpu" if on_gpu else "cpu"],
    }
    if not on_gpu and seq_len:
        parts["attention_scores"] = cpu_attention_scores(shape, micro_tokens, seq_len, d,
                                                         gradient_checkpointing) / GIB
    # a weight push under ZeRO-3 gathers one parameter at a time (sync/source.py): at most the
    # largest, between steps, when no activation is held, so it is not part of the step's total
    parts["weight_push_gather"] = (_largest_layer(shape) * d if zero_stage == 3 else 0) / GIB
    parts["total"] = sum(v for k, v in parts.items() if k not in NOT_IN_TOTAL)
    return parts


NOT_IN_TOTAL = ("activations_if_checkpointing_flipped", "weight_push_gather", "weight_push_buffer")


def cpu_attention_scores(shape: dict, micro_tokens: int, seq_len: int, d: int, checkpointing: bool) -> float:
    """Bytes of attention probabilities on CPU, where SDPA with a padding mask takes the math
    path and keeps each layer's [B, heads, T, T] softmax for its backward (a GPU's flash kernels
    keep none): every layer's without checkpointing, one layer's with it, plus ~3 in flight
    (scores, masked scores, their gradient). Measured against RSS: benchmarks/plan_accuracy.py."""
    rows = max(1, micro_tokens // max(1, seq_len))
    one = rows * int(shape["num_attention_heads"]) * seq_len * seq_len * d
    kept = 1 if checkpointing else int(shape["num_hidden_layers"])
    return float((kept + 3) * one)


def deepspeed_buffers(stage: int, d: int, params: int, ranks: int) -> float:
    """Bytes of DeepSpeed's communication buckets at its default sizes (read from its ZeRO config
    defaults): stages 1-2 a reduce bucket and an all-gather bucket; stage 3 the reduce bucket and
    the prefetch bucket. Never more than the parameters themselves; none without ZeRO or ranks."""
    if stage == 0 or ranks <= 1:
        return 0.0
    _quiet_deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cfg = DeepSpeedZeroConfig()
    elems = cfg.reduce_bucket_size + (cfg.prefetch_bucket_size if stage == 3 else cfg.allgather_bucket_size)
    return float(min(elems, 2 * params) * d)


def reference_gib(shape: dict, dtype: str) -> float:
    """The frozen reference policy of the KL term: its weights only (learner/reference.py)."""
    return parameter_count(shape) * dtype_bytes(dtype) / GIB


def kv_bytes_per_token(shape: dict, dtype: str, tp: int = 1) -> float:
    """2 (K and V) x layers x KV heads x head dim x dtype bytes, the KV heads split over TP."""
    heads = int(shape["num_attention_heads"])
    hd = int(shape.get("head_dim") or int(shape["hidden_size"]) // heads)
    kv_heads = int(shape.get("num_key_value_heads") or heads)
    return 2 * int(shape["num_hidden_layers"]) * max(1, math.ceil(kv_heads / max(1, tp))) * hd * dtype_bytes(dtype)


def rollout_memory(shape: dict, *, dtype: str, tp: int, device_gib: Optional[float], utilization: float,
                   kv_cache_gb: float, max_model_len: int, enforce_eager: bool) -> dict[str, float]:
    """GiB of one vLLM worker's GPU (device_gib given) or CPU process, and its KV cache as tokens
    and as sequences of max_model_len. On a GPU vLLM takes utilization x memory and gives the KV
    cache what is left after the weights, the profile run's peak and the CUDA graphs."""
    d = dtype_bytes(dtype)
    weights = parameter_count(shape) * d / max(1, tp) / GIB
    if device_gib is None:  # CPU: the KV cache is rollout.kv_cache_gb
        parts = {"weights": weights, "kv_cache": float(kv_cache_gb), "runtime": RUNTIME_GIB["cpu"]}
        parts["total"] = sum(parts.values())
    else:
        h, inter = int(shape["hidden_size"]), int(shape["intermediate_size"])
        tokens = VLLM_PROFILE_TOKENS
        profile = (tokens * (3 * h + 2 * inter // max(1, tp)) * d
                   + VLLM_MAX_SEQS * int(shape["vocab_size"]) * 4 * 2) / GIB
        graphs = 0.0 if enforce_eager else 0.5
        budget = utilization * device_gib
        kv = budget - weights - profile - graphs - RUNTIME_GIB["gpu"]
        parts = {"weights": weights, "activation_peak": profile, "cuda_graphs": graphs,
                 "runtime": RUNTIME_GIB["gpu"], "kv_cache": max(0.0, kv)}
        parts["total"] = budget
    per_token = kv_bytes_per_token(shape, dtype, tp)
    parts["kv_tokens"] = parts["kv_cache"] * GIB / per_token
    parts["kv_sequences"] = parts["kv_tokens"] / max(1, max_model_len)
    return parts
