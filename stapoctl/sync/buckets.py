"""How the gloo transport lays tensors into byte buckets: one broadcast per bucket instead of per
tensor, each tensor's raw bytes (any dtype, bf16 included), cut from the same metadata on both
sides so sender and receivers agree without another message."""

from __future__ import annotations

from typing import Iterator, Sequence

DEFAULT_BUCKET_BYTES = 64 * 2**20


def nbytes(dtype_name: str, shape: Sequence[int]) -> int:
    import torch

    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


def plan(dtype_names: Sequence[str], shapes: Sequence[Sequence[int]], bucket_bytes: int) -> list[list[int]]:
    """Tensor indices per bucket, in order; a tensor larger than a bucket travels alone."""
    out: list[list[int]] = []
    size = 0
    for i, (dt, shape) in enumerate(zip(dtype_names, shapes)):
        b = nbytes(dt, shape)
        if out and size + b <= bucket_bytes and size > 0:
            out[-1].append(i)
            size += b
        else:
            out.append([i])
            size = b
    return out


def pack(tensors: Sequence) -> "object":
    """One uint8 buffer holding the tensors' bytes end to end."""
    import torch

    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for t in tensors])


def unpack(buffer, dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> Iterator:
    """The tensors back out of a received buffer (views into it)."""
    import torch

    offset = 0
    for dt, shape in zip(dtype_names, shapes):
        b = nbytes(dt, shape)
        yield buffer[offset: offset + b].view(getattr(torch, dt)).reshape([int(s) for s in shape])
        offset += b
