"""The one place that builds a vLLM engine and samples from it.

Training rollouts (`rollout/vllm_worker.py`, a Ray actor) and evaluation (`eval/runner.py`)
both go through here, so decoding settings and the CPU quirks live in one module:
on a CPU machine the engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
`distributed_executor_backend="uni"`): ~4 s to start instead of ~50 s, and tensors can be
handed to the worker for a weight reload without pickling (see ../shared/ENGINES.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


def configure_env(kv_cache_gb: int = 1) -> None:
    """Environment vLLM reads at import/engine start; must run before `import vllm`."""
    if not cuda_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
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
    kv_cache_gb: int = 1
    enforce_eager: bool = True
    worker_extension_cls: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def make_llm(spec: EngineSpec):
    """A vLLM `LLM`; in-process single worker on CPU, normal executor on GPU."""
    configure_env(spec.kv_cache_gb)
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=spec.model_path,
        tokenizer=spec.model_path,
        seed=spec.seed,
        max_model_len=spec.max_model_len,
        dtype=spec.dtype,
        tensor_parallel_size=spec.tensor_parallel_size,
        enforce_eager=spec.enforce_eager,
        enable_prefix_caching=False,
    )
    if cuda_available():
        kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
    else:
        kwargs["distributed_executor_backend"] = "uni"
    if spec.worker_extension_cls:
        kwargs["worker_extension_cls"] = spec.worker_extension_cls
    kwargs.update(spec.extra)
    return LLM(**kwargs)


def generate(
    llm,
    prompts: Sequence[str] | Sequence[list[int]],
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_tokens: int,
    seed: int | None = None,
    use_tqdm: bool = False,
) -> list[list[Sample]]:
    """Sample n responses per prompt; returns, per prompt, its n samples with log-probs."""
    from vllm import SamplingParams

    params = SamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        logprobs=0,  # the sampled token's own log-prob
        seed=seed,
    )
    if prompts and not isinstance(prompts[0], str):
        inputs: Any = [{"prompt_token_ids": list(p)} for p in prompts]
    else:
        inputs = list(prompts)
    outputs = llm.generate(inputs, params, use_tqdm=use_tqdm)
    result: list[list[Sample]] = []
    for i, out in enumerate(outputs):
        samples = []
        for comp in out.outputs:
            ids = list(comp.token_ids)
            lps = [
                float(step[tok].logprob) if step is not None and tok in step else float("nan")
                for tok, step in zip(ids, comp.logprobs or [None] * len(ids))
            ]
            samples.append(
                Sample(
                    prompt_index=i,
                    token_ids=ids,
                    logprobs=lps,
                    text=comp.text,
                    finish_reason=comp.finish_reason or "stop",
                )
            )
        result.append(samples)
    return result


def shutdown(llm) -> None:
    """Release the engine's shared memory (otherwise /dev/shm segments linger after Ray exits)."""
    try:
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:
        pass
