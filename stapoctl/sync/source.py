"""The learner's weights as vLLM's `WeightSource`: what every collective transport sends.

The state dict, not `named_parameters()`: a model with tied embeddings holds `lm_head.weight` as an
alias that `named_parameters()` drops, and vLLM's loader then keeps its base model's head (Δlogp
2.07 in ../shared/ENGINES.md's measurement). Under ZeRO-3 each parameter is gathered alone, just
before it is sent, and released after: the push holds one full parameter, not the whole model.
Iterating is a collective under ZeRO-3: every learner rank iterates, in the same order.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Iterator


def weight_source(module_of: Callable[[], Any], zero_stage: int):
    """A `WeightSource` over whatever module `module_of()` returns now: a sweep's reset builds a new
    module, and the source must send that one, not the module it was created with."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateDictSource(WeightSource):
        def _named(self):
            return list(module_of().state_dict(keep_vars=True).items())

        def metadata(self) -> list:
            return [ParamMeta(name, p.dtype, tuple(getattr(p, "ds_shape", p.shape))) for name, p in self._named()]

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            for name, p in self._named():
                with gathered_one(p, zero_stage):
                    yield name, p.detach()

    return StateDictSource()


def gathered_one(param, zero_stage: int, modifier_rank=None):
    """The full parameter inside the block under ZeRO-3 (released at its end; a change made on
    `modifier_rank` is kept and re-partitioned); as it is otherwise."""
    if zero_stage != 3 or not hasattr(param, "ds_id"):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=modifier_rank)


def gathered_bytes(module) -> int:
    """Bytes of the ZeRO-3 parameters that are full right now (tests hold the push's peak to it)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(p.numel() * p.element_size() for p in module.parameters()
               if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE)
