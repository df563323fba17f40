"""New tensors for large processed weights, backed by transparent huge pages where Linux offers them.

A fresh tensor's memory is mapped by the kernel on first write, one 4 KiB page at a time; for a
GPT-2-sized embedding (154 MB) that is 38,000 page faults, and they cost more than computing the
entries (measured here: writing a copy of it into ``torch.empty`` memory takes 74 ms, into memory
advised ``MADV_HUGEPAGE`` 27 ms). Tensors of at least :data:`HUGE_PAGE_MIN_BYTES` are therefore
allocated as a private anonymous ``mmap`` advised ``MADV_HUGEPAGE`` and wrapped by
:func:`torch.frombuffer`: an ordinary contiguous CPU tensor that frees its memory when its last
view is deleted. Its storage cannot be resized (``resize_`` raises). Where the advice is not
available (not Linux, or the kernel refuses it) the tensor comes from :func:`torch.empty`.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["HUGE_PAGE_MIN_BYTES", "new_tensor", "converted"]

HUGE_PAGE_MIN_BYTES = 4 << 20


def new_tensor(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on ``device`` (on the CPU,
    large ones on huge-page-advised memory; on any other device, :func:`torch.empty`)."""
    count = math.prod(shape)
    size = count * dtype.itemsize
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    if size < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, device=device)
    try:
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


def converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``: itself when it has that dtype already, else a copy in memory from
    :func:`new_tensor`. A large temporary copy (a half-precision weight cast to float32 while it is
    processed) is then mapped and unmapped with the tensor, so freeing it returns its memory to
    the system: from :func:`torch.empty`, the C allocator keeps freed blocks of up to 32 MB in
    the process's heap, and a model's worth of them stays resident after processing (measured on
    GPT-2-small in bfloat16: 0.2 GB, 0.6 times the weights)."""
    if tensor.dtype == dtype:
        return tensor
    return new_tensor(tensor.shape, dtype, tensor.device).copy_(tensor)
