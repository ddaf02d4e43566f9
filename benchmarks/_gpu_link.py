"""The two ends of the learner → vLLM weight link, for `gpu_kit` on a machine without vLLM.

A lent GPU machine has no vLLM (nor Ray): its CUDA wheel cannot be carried there. What the kit
runs of stapoctl's own code on the link is real; what vLLM would do is stood in for here, and
only that:

- the sender is stapoctl's `Learner`; its own `StateIO.send_weights` (the ZeRO-3 gather
  context, the timing) calls `self.transfer.send_weights()`. In a run `transfer` is vLLM's
  `IPCTrainerWeightTransferEngine` (sync/trainer_engines.py); here it is `IPCSender`, which does
  what vLLM 0.32's engine does in its unpacked mode: iterate `module.named_parameters()` (vLLM's
  `ModuleSource`), one `reduce_tensor` handle per tensor keyed by the GPU's UUID, the update's
  names / dtype_names / shapes / ipc_handles fields, and wait for the receiver.
- the receiver stands in for a vLLM worker: it opens the handles as vLLM's
  `IPCWeightTransferEngine.receive_weights` does (`rebuild_cuda_tensor`, the device index
  rewritten to its own) and loads them through stapoctl's worker extension
  (`WeightSyncExtension.stapo_load_weights` → `unpack` → the worker's `reload_weights`) into a
  plain transformers model; `PlainModelWorker` supplies the two worker features the extension
  uses (`reload_weights`, `model_runner.get_model()`).

Note that in a real GPU run vLLM's engine hands the opened tensors to vLLM's own
`model.load_weights`, not to the extension; the extension's loader is what the CPU path
(object store) runs on every sync. The NCCL part broadcasts a model's parameters tensor by
tensor with torch.distributed (`broadcast_rank`), on GPUs with NCCL or, in the tests, on the CPU
with gloo.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Optional

import _harness  # noqa: F401  (puts this checkout's stapoctl first on sys.path, as for every benchmark)

from stapoctl.sync.worker_extension import WeightSyncExtension


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


# -- the receiving worker (in place of vLLM's) --------------------------------------------------
class PlainModelWorker(WeightSyncExtension):
    """A transformers model behind stapoctl's worker extension, as vLLM's Worker would be: the
    extension's methods run unchanged; `reload_weights` copies by parameter name (what vLLM's
    loader does for an unfused model) and refuses a name or shape the model does not have."""

    def __init__(self, model) -> None:
        self.model = model
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.loaded: list[str] = []

    def reload_weights(self, weights_iterator: Iterable) -> None:
        import torch

        params = dict(self.model.named_parameters())
        self.loaded = []
        with torch.no_grad():
            for name, tensor in weights_iterator:
                if name not in params:
                    raise KeyError(f"the receiving model has no parameter {name!r}")
                if tuple(params[name].shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} sent, {tuple(params[name].shape)} here")
                params[name].copy_(tensor)
                self.loaded.append(name)

    def missing(self) -> list[str]:
        """Parameters the last load did not set."""
        return sorted(set(dict(self.model.named_parameters())) - set(self.loaded))


# -- the IPC wire format (vLLM 0.32's IPCWeightTransferUpdateInfo, unpacked) -------------------
def share_weights(named: Iterable, gpu_uuid: str, reduce: Optional[Callable] = None) -> tuple[dict, list]:
    """(update, refs): names, dtype_names, shapes and one {gpu_uuid: reduce args} per tensor.
    `refs` holds the contiguous tensors; the sender keeps them until the receiver has loaded."""
    if reduce is None:
        from torch.multiprocessing.reductions import reduce_tensor as reduce
    update: dict[str, list] = {"names": [], "dtype_names": [], "shapes": [], "ipc_handles": []}
    refs = []
    for name, tensor in named:
        weight = tensor.detach().contiguous()
        refs.append(weight)
        _, args = reduce(weight)
        update["names"].append(name)
        update["dtype_names"].append(str(weight.dtype).split(".")[-1])
        update["shapes"].append(list(weight.shape))
        update["ipc_handles"].append({gpu_uuid: args})
    return update, refs


def open_weights(update: dict, gpu_uuid: str, device_index: int, rebuild: Optional[Callable] = None) -> list:
    """(name, tensor) per handle of this GPU; argument 6 of `reduce_tensor`'s tuple is the device."""
    if rebuild is None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor as rebuild
    out = []
    for name, handle in zip(update["names"], update["ipc_handles"]):
        if gpu_uuid not in handle:
            raise ValueError(f"no IPC handle for GPU {gpu_uuid} (have: {list(handle)})")
        args = list(handle[gpu_uuid])
        args[6] = device_index
        out.append((name, rebuild(*args)))
    return out


def receive(worker: PlainModelWorker, update: dict, gpu_uuid: str, device_index: int) -> dict:
    """One update on the receiving side: open, load through the extension, release the views."""
    import torch

    t0 = time.perf_counter()
    items = open_weights(update, gpu_uuid, device_index)
    t1 = time.perf_counter()
    count = worker.stapo_load_weights(items)
    torch.cuda.synchronize(device_index)
    t2 = time.perf_counter()
    del items
    return {"tensors": count, "open_s": t1 - t0, "load_s": t2 - t1, "missing": worker.missing()[:5]}


class IPCSender:
    """`Learner.transfer` for the kit: the learner's `send_weights` calls `send_weights()` here."""

    def __init__(self, module, conn, *, timeout: float = 120.0) -> None:
        import torch

        self.module, self.conn, self.timeout = module, conn, timeout
        self.gpu_uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        self.replies: list[dict] = []

    def send_weights(self) -> None:
        import torch

        update, refs = share_weights(self.module.named_parameters(), self.gpu_uuid)
        torch.cuda.synchronize()
        self.conn.send(("update", update))
        self.replies.append(answer(self.conn, self.timeout))
        del refs
        torch.cuda.ipc_collect()


def answer(conn, timeout: float):
    """The other end's reply; its error as a RuntimeError, a silent end as a TimeoutError."""
    if not conn.poll(timeout):
        raise TimeoutError(f"the receiver did not answer in {timeout:.0f} s")
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(f"receiver: {msg['error']}")
    return msg


def receiver_main(conn, model_id: str, device_index: int, seed: int = 1) -> None:
    """The receiving process: a random model of the same shape (another seed, so a landed
    transfer shows), then updates and fingerprint requests until "stop" or the pipe closes."""
    try:
        import torch
        from transformers import Qwen3ForCausalLM

        import gpu_learner as GL

        torch.cuda.set_device(device_index)
        torch.manual_seed(seed)
        with torch.device("cuda", device_index):
            model = Qwen3ForCausalLM(GL.qwen3_config(model_id)).to(torch.bfloat16)
        worker = PlainModelWorker(model)
        gpu_uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        conn.send("ready")
        while True:
            kind, body = conn.recv()
            if kind == "stop":
                return
            if kind == "update":
                conn.send(receive(worker, body, gpu_uuid, device_index))
            elif kind == "fingerprint":
                conn.send({"hashes": fingerprint(model, body), "checksum": worker.stapo_weight_checksum()})
    except EOFError:  # the sender is gone
        return
    except Exception as exc:
        traceback.print_exc()
        try:
            conn.send({"error": one_line(exc)})
        except Exception:
            pass


# -- checks ----------------------------------------------------------------------------------------
def fingerprint(module, names: Iterable[str]) -> dict[str, str]:
    """sha256 of each named parameter's bytes: equal hashes = bit-equal tensors."""
    import torch

    params = dict(module.named_parameters())
    return {n: hashlib.sha256(params[n].detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
                              .tobytes()).hexdigest() for n in names}


def pick_names(module) -> list[str]:
    """Four parameters spread over the model: the first (embedding), the middle matrix, the last
    matrix and the last parameter (the final norm)."""
    names = [n for n, _ in module.named_parameters()]
    matrices = [n for n, p in module.named_parameters() if p.dim() >= 2]
    picked = [names[0], matrices[len(matrices) // 2], matrices[-1], names[-1]]
    return list(dict.fromkeys(picked))


def flip_signs(module) -> None:
    """Negate every parameter in place: the next send carries other bytes than the last."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.neg_()


def param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def param_shapes(model_id: str) -> list[tuple[str, list[int]]]:
    """(name, shape) of a Qwen3 shape's parameters, from a model on the meta device (no memory)."""
    import torch
    from transformers import Qwen3ForCausalLM

    import gpu_learner as GL

    with torch.device("meta"):
        model = Qwen3ForCausalLM(GL.qwen3_config(model_id))
    return [(n, list(p.shape)) for n, p in model.named_parameters()]


# -- NCCL broadcast ------------------------------------------------------------------------------
def broadcast_rank(rank: int, world: int, port: int, shapes: list, dtype: str, repeats: int, backend: str,
                   device_kind: str, queue) -> None:
    """One rank: rank 0 holds random tensors, the others zeros (again before every round); each
    round broadcasts them one by one from rank 0. Puts {rank, times, digest} (or the error)."""
    import torch
    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        kind = getattr(torch, dtype)
        g = torch.Generator(device=device).manual_seed(0)
        tensors = [torch.randn(s, generator=g, device=device).to(kind) if rank == 0 else
                   torch.zeros(s, device=device, dtype=kind) for _, s in shapes]
        times = []
        for _ in range(repeats + 1):
            for t in tensors if rank else ():
                t.zero_()
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            for t in tensors:
                dist.broadcast(t, src=0)
            _sync(device)
            times.append(time.perf_counter() - t0)
        digest = hashlib.sha256()
        for t in tensors:
            digest.update(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
        queue.put({"rank": rank, "times": times, "digest": digest.hexdigest()})
    except Exception as exc:
        traceback.print_exc()
        queue.put({"rank": rank, "error": one_line(exc)})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spawn_broadcast(world: int, shapes: list, *, dtype: str, repeats: int, backend: str, device_kind: str,
                    timeout: float) -> dict[str, Any]:
    """`world` rank processes; the round time is the slowest rank's; bit-equal when every rank's
    digest is rank 0's."""
    import multiprocessing as mp

    from stapoctl.learner.engine_setup import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=broadcast_rank, daemon=True,
                         args=(r, world, port, shapes, dtype, repeats, backend, device_kind, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    end, got = time.monotonic() + timeout, []
    try:
        for _ in procs:
            got.append(queue.get(timeout=max(1.0, end - time.monotonic())))
    except Exception as exc:  # queue.Empty: a rank hangs or died without a word
        raise TimeoutError(f"{len(got)} of {world} ranks answered in {timeout:.0f} s") from exc
    finally:
        for p in procs:
            p.join(timeout=max(1.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
    errors = [f"rank {x['rank']}: {x['error']}" for x in got if "error" in x]
    if errors:
        raise RuntimeError("; ".join(errors))
    got.sort(key=lambda x: x["rank"])
    rounds = [max(x["times"][i] for x in got) for i in range(repeats + 1)]
    return {"world": world, "rounds_s": rounds, "bit_equal": all(x["digest"] == got[0]["digest"] for x in got)}
