"""The one place that builds a vLLM engine and samples from it.

Training rollouts (`rollout/vllm_worker.py`, a Ray actor) and evaluation (`eval/runner.py`)
both go through here, so decoding settings and the CPU quirks live in one module:
on a CPU machine the engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
`distributed_executor_backend="uni"`): ~4 s to start instead of ~50 s, and tensors can be
handed to the worker for a weight reload without pickling (see ../shared/ENGINES.md).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


def configure_env(spec: "EngineSpec | None" = None) -> None:
    """Environment vLLM reads at import/engine start; must run before `import vllm`. A value the
    user exported wins."""
    if spec is not None and spec.execute_model_timeout_s > 0:
        os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(math.ceil(spec.execute_model_timeout_s)))
    if not cuda_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class Sample:
    """One sampled response; token ids and per-token log-probs of the sampled tokens."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"


@dataclass
class EngineSpec:
    model_path: str
    seed: int = 0
    max_model_len: int = 512
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    kv_cache_gb: float = 1.0  # CPU only: the KV cache, GiB
    enforce_eager: bool = True
    worker_extension_cls: str | None = None
    num_threads: int = 0  # CPU: intra-op threads of the in-process engine (0 = torch's default)
    # vLLM's weight-transfer backend of a linked transport ("stapo_gloo" | "nccl" | "ipc", from
    # sync.transports); None = no trainer link (the object store, or evaluation)
    weight_transfer_backend: str | None = None
    colocated: bool = False  # GPU: the actor shares its GPU(s) with learner ranks
    kv_cache_bytes: int = 0  # GPU, colocated: the KV cache the memory plan leaves (0 = by utilisation)
    # vLLM's own bound on one model step at TP > 1 (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s): set
    # past the driver's stall bound, so a stuck step is named by that bound's line (0 = vLLM's)
    execute_model_timeout_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


# What the in-process CPU engine imports while it is built (its worker class, named by vLLM's CPU
# platform); imported with vLLM, under the paused GC, instead of inside `LLM(...)`.
CPU_ENGINE_MODULES = ("vllm.v1.worker.cpu_worker",)


def import_vllm(spec: "EngineSpec | None" = None) -> None:
    """vLLM's import, with the GC paused (the import is most of the engine's start-up on CPU); for
    `spec`'s engine on CPU in this very process (TP 1: `executor_backend` "uni") also the modules it
    imports while it is built. Once per process."""
    from stapoctl.launch.import_gc import paused_gc

    configure_env(spec)
    in_process = (spec is not None and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
                  and not cuda_available() and executor_backend(spec, on_gpu=False) == "uni")
    modules = ("vllm.entrypoints.llm", *(CPU_ENGINE_MODULES if in_process else ()))
    with paused_gc(*modules):
        import importlib

        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:  # another vLLM layout: `LLM(...)` imports what it needs itself
                if name == modules[0]:
                    raise


def make_llm(spec: EngineSpec):
    """A vLLM `LLM` with `engine_kwargs`'s settings."""
    import_vllm(spec)
    from vllm import LLM

    kwargs = engine_kwargs(spec, cuda_available())
    if spec.weight_transfer_backend:
        from stapoctl.sync.worker_extension import register_transports

        register_transports()
    try:
        return LLM(**kwargs)
    except ValueError as exc:
        # vLLM's two messages for a cache that cannot hold one sequence; not its other KV errors
        if cuda_available() or not ("cache blocks" in str(exc) or "available KV cache memory" in str(exc)):
            raise
        from stapoctl.errors import UserError

        raise UserError(
            f"rollout.kv_cache_gb={float(spec.kv_cache_gb):g} GiB cannot hold one sequence of max_model_len "
            f"{spec.max_model_len} for this model: raise it, e.g. rollout.kv_cache_gb=1"
        ) from None


def executor_backend(spec: EngineSpec, on_gpu: bool) -> str:
    """One process per engine ("uni") at TP 1. At TP > 1 vLLM's multiprocess executor ("mp"), whose
    workers use the GPUs (or CPU cores) the actor holds on its node: inside a placement group vLLM
    would otherwise pick its Ray executor, which refuses a bundle of more than one GPU. Colocated
    TP > 1 spans several one-GPU bundles: there vLLM's Ray executor places a worker in each
    (`VLLM_RAY_BUNDLE_INDICES`, `launch.placement.rollout_bundle_env`)."""
    if int(spec.tensor_parallel_size) <= 1:
        return "uni"
    return "ray" if (on_gpu and spec.colocated) else "mp"


def engine_kwargs(spec: EngineSpec, on_gpu: bool) -> dict[str, Any]:
    """The `LLM` keyword arguments: decisions kept apart from the engine so tests check them on CPU."""
    kwargs: dict[str, Any] = dict(
        model=spec.model_path,
        tokenizer=spec.model_path,
        seed=spec.seed,
        max_model_len=spec.max_model_len,
        dtype=spec.dtype,
        tensor_parallel_size=spec.tensor_parallel_size,
        enforce_eager=spec.enforce_eager,
        # On: the n samples of a prompt share the KV of its full blocks instead of each
        # prefilling it again. The rollout actor resets the cache after every weight load
        # (`RolloutWorker._after_update`), so no cached block outlives the weights it was
        # computed with.
        enable_prefix_caching=True,
        # The sampled token's log-prob under the distribution it was drawn from: after the temperature
        # and top-p (renormalised over the kept set), not vLLM's default `raw_logprobs` (the model's own
        # before either). The learner computes the same (`losses/token_stats.py`), so the PPO ratio, IS
        # weights, drift and the sync canary compare like with like at any decoding setting. Prompt
        # log-probs (`score_logprobs`) are the model's own in every mode (vLLM's note on the field).
        logprobs_mode="processed_logprobs",
    )
    kwargs["distributed_executor_backend"] = executor_backend(spec, on_gpu)
    if spec.weight_transfer_backend:
        kwargs["weight_transfer_config"] = {"backend": spec.weight_transfer_backend}
    if on_gpu:
        if spec.colocated and spec.kv_cache_bytes > 0:
            kwargs["kv_cache_memory_bytes"] = int(spec.kv_cache_bytes)  # the plan's, not a share of free memory
        # colocated too: vLLM still checks at start that this share of the GPU is free (0.5 there, not
        # its default 0.9, which a GPU shared with a learner rank never has)
        kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
    else:
        # sized by the run, not vLLM-CPU's integer-GiB VLLM_CPU_KVCACHE_SPACE (which, when set in
        # the environment, still wins): a tiny model's rollout needs a few MiB, and 1 GiB took
        # 0.3 s to allocate and zero at every engine start
        kwargs["kv_cache_memory_bytes"] = int(float(spec.kv_cache_gb) * 2**30)
        # Seeded requests (reproducible rollouts, hence resumable runs) crash vLLM-CPU 0.32 when
        # a prefill is chunked: it rewinds the request's generator with set_offset, which CPU
        # generators lack ("CPU Generator does not use offset"). Whole prefills avoid that path.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(spec.max_model_len, 8192)
        # vLLM-CPU's default block is 128 tokens, longer than a toy or short math prompt, so no
        # block is ever full and prefix caching shares nothing; 32 is the smallest its attention
        # kernel takes. With it a 25M rollout of 8 prompts x 8 took 0.92 s instead of 1.15 s here,
        # with the same tokens and log-probs bit for bit
        # (`python benchmarks/_vllm_modes.py --size 25m --modes eager,eager-block128`).
        kwargs["block_size"] = 32
    if spec.worker_extension_cls:
        kwargs["worker_extension_cls"] = spec.worker_extension_cls
    kwargs.update(spec.extra)
    return kwargs


def prompt_seed(*parts: Any) -> int:
    """A request seed from what is sampled (run seed, step, prompt id, ...), not from where.

    Seeding each prompt by its identity makes rollouts independent of how prompts are split
    over workers and chunks: the same run seed gives the same samples with 1 or N workers, and
    a resumed evaluation draws what the uninterrupted one would. (vLLM gives child j of a
    request `seed + j`; seeds are 2^20 apart on average, so children of two prompts collide
    only with negligible probability — and then merely share random numbers.)
    """
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") % (2**31 - 2**16)


def request_seeds(seed: int | Sequence[int] | None, num_prompts: int, n: int) -> list[int | None]:
    """Per-prompt seeds: given as a list (one per prompt), or derived from one call seed, n apart
    (vLLM gives child j of a request `seed + j`, so prompts sharing a seed would draw the same
    random numbers)."""
    if seed is None:
        return [None] * num_prompts
    if not isinstance(seed, int):
        seeds = [int(s) for s in seed]
        if len(seeds) != num_prompts:
            raise ValueError(f"{len(seeds)} seeds for {num_prompts} prompts")
        return seeds
    base = (int(seed) * 1_000_003) % (2**31 - 1)
    return [(base + i * n) % (2**31 - 1) for i in range(num_prompts)]


def _token_logprob(step: Any, tok: int) -> float:
    if step is None:
        return float("nan")
    entry = step.get(tok) if hasattr(step, "get") else None
    return float(entry.logprob) if entry is not None else float("nan")


def generate(
    llm,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_tokens: int,
    seed: int | Sequence[int] | None = None,
    use_tqdm: bool = False,
) -> list[list[Sample]]:
    """Sample n responses per prompt; returns, per prompt, its n samples with log-probs.

    `seed`: one per prompt (see `prompt_seed`), or one for the call."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=0,  # the sampled token's own log-prob (under T and top-p: `engine_kwargs`)
            seed=s,
            # Texts are decoded below in one batch call instead of token by token inside the
            # engine loop (which also decoded every log-prob's token), and log-probs come back
            # as flat lists instead of a dict per token: a tiny-model rollout of 8 prompts x 8
            # took 54 instead of 66 ms here, the same tokens and log-probs bit for bit.
            detokenize=False,
            flat_logprobs=True,
        )
        for s in request_seeds(seed, len(prompts), n)
    ]
    if not prompts:
        return []
    if not isinstance(prompts[0], str):
        inputs: Any = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
    else:
        inputs = list(prompts)
    outputs = llm.generate(inputs, params, use_tqdm=use_tqdm)
    comps = [sorted(out.outputs, key=lambda c: c.index) for out in outputs]
    texts = iter(decode_texts(llm, [list(c.token_ids) for group in comps for c in group]))
    result: list[list[Sample]] = []
    for i, group in enumerate(comps):
        samples = []
        for comp in group:
            ids = list(comp.token_ids)
            samples.append(
                Sample(
                    prompt_index=i,
                    token_ids=ids,
                    logprobs=sampled_logprobs(ids, comp.logprobs),
                    text=next(texts),
                    finish_reason=comp.finish_reason or "stop",
                )
            )
        result.append(samples)
    return result


def decode_texts(llm, token_ids: list[list[int]]) -> list[str]:
    """Response texts as vLLM's own detokenizer gives them, decoded in one call: special tokens
    skipped, no clean-up of spaces, and no replacement characters for a multi-byte character
    that the token limit cut short (vLLM's incremental decoder never emits those)."""
    if not token_ids:
        return []
    tokenizer = llm.get_tokenizer()
    texts = tokenizer.batch_decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return [t.rstrip("\ufffd") for t in texts]


def sampled_logprobs(ids: Sequence[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token, from vLLM's flat lists (`flat_logprobs=True`) or its
    per-position dicts; NaN where the engine returned none."""
    if logprobs is None:
        return [math.nan] * len(ids)
    if not hasattr(logprobs, "start_indices"):
        return [_token_logprob(step, tok) for tok, step in zip(ids, logprobs)]
    starts, ends, toks, values = logprobs.start_indices, logprobs.end_indices, logprobs.token_ids, logprobs.logprobs
    out = []
    for pos, tok in enumerate(ids):
        value = math.nan
        if pos < len(starts):
            for j in range(starts[pos], ends[pos]):  # the sampled token comes first
                if toks[j] == tok:
                    value = float(values[j])
                    break
        out.append(value)
    return out


def score_logprobs(
    llm, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> list[list[float]]:
    """vLLM's log-prob of each response token given its prompt, for (prompt, response) pairs.

    A prefill with `prompt_logprobs=0` over prompt+response; the last len(response) entries
    are the response's. This is what the weight-sync test compares with the learner.
    """
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    inputs = [{"prompt_token_ids": [int(t) for t in p] + [int(t) for t in r]} for p, r in sequences]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    result = []
    for (prompt, response), out in zip(sequences, outputs):
        full = list(prompt) + list(response)
        plp = out.prompt_logprobs or []
        lps = [_token_logprob(plp[k], full[k]) if k < len(plp) else math.nan for k in range(len(full))]
        result.append(lps[len(prompt):])
    return result


def kv_cache_gib(llm) -> float:
    """The KV cache the engine allocated, GiB: its blocks × tokens per block × bytes per token
    (2 × layers × KV heads × head size × the cache dtype's bytes, over every tensor-parallel rank).
    Read from the front end's config, which the engine core fills in (also across processes)."""
    import torch

    cfg = llm.llm_engine.vllm_config
    model, cache, parallel = cfg.model_config, cfg.cache_config, cfg.parallel_config
    dtype = model.dtype if cache.cache_dtype == "auto" else getattr(torch, str(cache.cache_dtype), torch.uint8)
    per_token = (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel)
                 * int(parallel.tensor_parallel_size) * model.get_head_size() * torch.empty((), dtype=dtype).element_size())
    return int(cache.num_gpu_blocks or 0) * int(cache.block_size) * per_token / 2**30


def shutdown(llm) -> None:
    """Release the engine's shared memory (otherwise /dev/shm segments linger after Ray exits)."""
    try:
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:
        pass
