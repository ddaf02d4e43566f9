"""vLLM worker extension: the code that runs inside vLLM's worker to take the learner's weights.

vLLM mixes this class into its Worker (`worker_extension_cls=` by dotted name), so `self` is
the worker. On CPU, `model.load_weights` breaks after the first load ("'Parameter' object has
no attribute 'weight_loader'", ENGINES.md); the worker's `reload_weights(weights_iterator=)`
re-runs the loader in place and is what we call.
"""

from __future__ import annotations

from typing import Any, Iterable

EXTENSION_CLS = "stapoctl.sync.worker_extension.WeightSyncExtension"


def raw_views(named_tensors: Iterable[tuple[str, "object"]]) -> list[tuple[str, "object", str, list[int]]]:
    """(name, raw bytes as a numpy uint8 view, dtype, shape), bf16 included (numpy has no bf16).
    No copy for a contiguous CPU tensor: Ray writes the views once into its object store
    (pickle5 out-of-band buffers) and a reader on the node maps them in place (`unpack`)."""
    import torch

    out = []
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        out.append((name, t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), list(t.shape)))
    return out


def pack_for_rpc(named_tensors: Iterable[tuple[str, "object"]]) -> list[tuple[str, bytes, str, list[int]]]:
    """(name, raw bytes, dtype, shape): what crosses vLLM's multiprocess RPC, which cannot
    pickle tensors ("cannot pickle memoryview objects"). The in-process engine needs none of it."""
    return [(name, raw.tobytes(), dtype, shape) for name, raw, dtype, shape in raw_views(named_tensors)]


def unpack(item) -> tuple[str, "object"]:
    """(name, tensor) from (name, tensor), or from (name, raw bytes, dtype, shape) where the bytes
    are a numpy uint8 array (the learner's payload, read in place from Ray's object store: the
    tensor is a read-only view, which the loader only copies from) or `bytes` (the RPC payload)."""
    import warnings

    import numpy as np
    import torch

    if len(item) == 2:
        name, tensor = item
        return name, tensor if isinstance(tensor, torch.Tensor) else torch.as_tensor(tensor)
    name, raw, dtype, shape = item
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():  # "not writable": the object store's pages are read-only
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(raw)
    else:
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return name, flat.view(getattr(torch, dtype)).reshape(shape)


class WeightSyncExtension:
    def stapo_load_weights(self, named_tensors: Iterable) -> int:
        """Load (name, tensor) or packed (name, bytes, dtype, shape) items in place; returns how many."""
        items = [unpack(item) for item in named_tensors]
        self.reload_weights(weights_iterator=iter(items))
        return len(items)

    def stapo_transfer_rank(self) -> int:
        """This worker process's rank in a linked transport's group (-1: none)."""
        return transfer_rank(getattr(self, "weight_transfer_engine", None))

    def stapo_test_perturb_embedding(self, scale: float) -> None:
        """Tests only (the sync canary's alarm): the embedding moved by `scale` × its std."""
        import torch

        weight = self.model_runner.get_model().model.embed_tokens.weight
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            weight.add_(torch.randn(tuple(weight.shape), generator=g).to(weight) * float(scale) * weight.float().std())

    def stapo_weight_checksum(self) -> float:
        """Sum of every parameter, a cheap fingerprint tests use to see a sync landed."""
        import torch

        model = self.model_runner.get_model()
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def transfer_rank(engine: Any) -> int:
    """A worker engine's rank in its transport's group: stapoctl's gloo engine holds it as `rank`,
    vLLM's NCCL engine on its communicator (`model_update_group.rank`, a PyNcclCommunicator); -1
    where there is none (no link yet, or CUDA IPC, which has no group)."""
    if engine is None:
        return -1
    if isinstance(getattr(engine, "rank", None), int):
        return int(engine.rank)
    group = getattr(engine, "model_update_group", None)
    return int(getattr(group, "rank", -1)) if group is not None else -1


def register_transports() -> None:
    """stapoctl's vLLM weight-transfer engines (gloo), into this process's vLLM factory. vLLM imports
    this module into every worker by name before it builds the worker's transfer engine; the
    in-process engine of a CPU actor imported it earlier, so `make_llm` calls this too."""
    import sys

    if "vllm" in sys.modules:  # the learner imports this module (raw_views) and need not have vLLM
        from stapoctl.sync.gloo_engine import register

        register()


register_transports()
