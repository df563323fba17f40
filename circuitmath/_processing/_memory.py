"""New tensors for large processed weights, backed by transparent huge pages where Linux offers them.

A fresh tensor's memory is mapped by the kernel on first write, one 4 KiB page at a time; for a
GPT-2-sized embedding that is tens of thousands of page faults, and they cost more than computing
the entries (``benchmarks/process_weights.py`` measures the whole processing). Tensors of at least :data:`HUGE_PAGE_MIN_BYTES` are therefore
allocated as a private anonymous ``mmap`` advised ``MADV_HUGEPAGE`` and wrapped by
:func:`torch.frombuffer`: an ordinary contiguous CPU tensor that frees its memory when its last
view is deleted. Its storage cannot be resized (``resize_`` raises). Where the advice is not
available (not Linux, or the kernel refuses it) the tensor comes from :func:`torch.empty`.

Temporaries that processing frees while it goes on (a half-precision weight cast to float32, a
block of rows) are mapped from the smaller :data:`SCRATCH_MIN_BYTES` (:func:`scratch`), so that
the C allocator's heap holds only small tensors and outputs. Nothing here changes the
allocator's process-wide settings.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import mmap
import sys

import torch

__all__ = [
    "HUGE_PAGE_MIN_BYTES", "SCRATCH_MIN_BYTES", "new_tensor", "scratch", "converted", "rows_per_block", "recycling",
    "without_huge_pages", "in_memory",
]

HUGE_PAGE_MIN_BYTES = 4 << 20

#: Temporaries of at least this size are mapped by :func:`scratch` (see there).
SCRATCH_MIN_BYTES = 64 << 10


class _Maps(list):
    """The maps :func:`new_tensor` made within one :func:`recycling` (none are kept where maps are
    not ``reused``: :func:`without_huge_pages`), and whether new ones are advised huge pages."""

    def __init__(self, huge_pages: bool, reused: bool = True):
        super().__init__()
        self.huge_pages, self.reused = huge_pages, reused


#: How :func:`new_tensor` maps: the maps made within :func:`recycling`, or the policy of
#: :func:`without_huge_pages` (``None`` outside both: huge pages advised, no map reused).
_RECYCLED: contextvars.ContextVar[_Maps | None] = contextvars.ContextVar("recycled", default=None)


@contextlib.contextmanager
def _maps(maps: _Maps):
    """Within it, :func:`new_tensor` maps by the policy of ``maps`` (and keeps its maps there)."""
    token = _RECYCLED.set(maps)
    try:
        yield
    finally:
        _RECYCLED.reset(token)


def recycling():
    """Within it, a tensor that :func:`new_tensor` maps reuses a map made earlier within it, of
    the same size in bytes, that no tensor uses any more (its contents are left as they were),
    instead of a fresh one: for a loop that makes tensors of the same sizes over and over (a
    checkpoint's blocks, processed and written one after another). A fresh map costs the
    kernel a page fault and the zeroing of every page on first write, a large share of the
    time of streamed processing. A map no tensor uses stays mapped until the ``with`` statement ends, so memory holds
    what the loop held at most.

    >>> with recycling():
    ...     first = new_tensor((1 << 20,), torch.float32, torch.device("cpu")).fill_(7)
    ...     address = first.data_ptr()
    ...     del first
    ...     again = new_tensor((1 << 20,), torch.float32, torch.device("cpu"))
    >>> again.data_ptr() == address and bool((again == 7).all())
    True
    """
    return _maps(_Maps(huge_pages=True))


def without_huge_pages():
    """Within it, :func:`new_tensor` advises no map huge pages (and reuses none): for tensors that
    live only as long as a check and are read once or twice (a replayed rewrite, certified and
    dropped), which save no TLB misses worth it, while where the kernel must compact memory to
    find huge pages, or a hypervisor back them, an advised map's first touch costs several times
    that of 4 KiB pages (``benchmarks/check_speed.py``)."""
    return _maps(_Maps(huge_pages=False, reused=False))


def _reused(size: int) -> mmap.mmap | None:
    """A map of ``size`` bytes made within :func:`recycling` that no tensor uses, if any. Each
    storage made by :func:`torch.frombuffer` holds a reference to its map (the buffer export)
    until the last of its views is freed: a map no tensor uses is referred to by the list of
    maps alone (and by ``getrefcount``'s argument)."""
    maps = _RECYCLED.get()
    for i in range(len(maps or ())):
        if len(maps[i]) == size and sys.getrefcount(maps[i]) == 2:
            return maps[i]
    return None


#: A block of rows that a loop works on while it stays in a CPU core's cache.
CACHE_BLOCK_BYTES = 1 << 20

#: The most bytes of a block of rows on another device (a GPU pays for each block in kernel
#: launches, not in cache misses), and the least number of blocks a tensor is cut into there, so
#: that a float32 scratch for a half-precision tensor stays a small fraction of it.
DEVICE_BLOCK_BYTES, DEVICE_MIN_BLOCKS = 64 << 20, 8


def rows_per_block(
    count: int, row_bytes: int, device: torch.device, *, cpu_rows: int | None = None, staged: bool = True
) -> int:
    """How many of a tensor's ``count`` rows of ``row_bytes`` each a loop works on at a time
    (at least 2, where there are 2): on the CPU ``cpu_rows``, or as many as fit in
    :data:`CACHE_BLOCK_BYTES`; on any other device, all of them when a block is not ``staged``
    in a scratch, else as many as fit in :data:`DEVICE_BLOCK_BYTES` but no more than a
    :data:`DEVICE_MIN_BLOCKS`-th of the rows.

    >>> rows_per_block(4096, 4096 * 4, torch.device("cpu"))
    64
    >>> rows_per_block(4096, 4096 * 4, torch.device("meta"))
    512
    >>> rows_per_block(4096, 4096 * 4, torch.device("meta"), staged=False)
    4096
    """
    if torch.device(device).type == "cpu":
        rows = cpu_rows or CACHE_BLOCK_BYTES // max(1, row_bytes)
    elif not staged:
        rows = count
    else:
        rows = min(DEVICE_BLOCK_BYTES // max(1, row_bytes), -(-count // DEVICE_MIN_BLOCKS))
    return max(2, rows)


def new_tensor(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device, *,
    mapped_from: int | None = None,
) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on ``device``: on the CPU,
    one of at least ``mapped_from`` bytes is mapped (advised huge pages from
    :data:`HUGE_PAGE_MIN_BYTES`); a smaller one, or one on any other device, from :func:`torch.empty`.
    ``mapped_from`` defaults to :data:`HUGE_PAGE_MIN_BYTES`. Within :func:`recycling`, a map no
    tensor uses any more is mapped again; within :func:`without_huge_pages`, none is advised.
    """
    if mapped_from is None:
        mapped_from = HUGE_PAGE_MIN_BYTES
    count = math.prod(shape)
    size = count * dtype.itemsize
    if torch.device(device).type != "cpu" or size < mapped_from or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, device=device)
    maps = _RECYCLED.get()
    buffer = _reused(size)
    if buffer is None:
        try:
            buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if size >= HUGE_PAGE_MIN_BYTES and (maps is None or maps.huge_pages):
                buffer.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError):
            return torch.empty(shape, dtype=dtype, device=device)
        if maps is not None and maps.reused:
            maps.append(buffer)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


def scratch(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for a temporary that a loop reuses (write into it with ``out=`` or
    ``copy_``), mapped on the CPU from :data:`SCRATCH_MIN_BYTES`.

    A temporary from :func:`torch.empty` is freed into glibc's heap: once a mapped block has
    been freed, glibc raises its mapping threshold to that block's size (up to 32 MB) and serves
    later mid-sized blocks from the heap, where the small tensors made after them and kept (a
    block's sum, a bias) split the freed space, so the next block of the same size takes new
    memory, and freed heap memory stays resident (``benchmarks/process_weights.py`` measures
    the memory processing adds). A mapped temporary goes back to the system when it is freed; one reused per loop
    costs one mapping, not one per block.
    """
    return new_tensor(shape, dtype, device, mapped_from=SCRATCH_MIN_BYTES)


def converted(
    tensor: torch.Tensor, dtype: torch.dtype, *, mapped_from: int | None = None
) -> torch.Tensor:
    """``tensor`` in ``dtype``: itself when it has that dtype already, else a copy in memory from
    :func:`new_tensor` (mapped from ``mapped_from`` bytes, by default as there). A large temporary copy (a
    half-precision weight cast to float32 while it is processed) is then mapped and unmapped
    with the tensor, so freeing it returns its memory to the system: from :func:`torch.empty`,
    the C allocator keeps freed blocks of up to 32 MB in the process's heap, and a model's worth
    of them stays resident after processing. A temporary that is freed while tensors made after
    it live on is better mapped from :data:`SCRATCH_MIN_BYTES` (see :func:`scratch`)."""
    if tensor.dtype == dtype:
        return tensor
    return new_tensor(tensor.shape, dtype, tensor.device, mapped_from=mapped_from).copy_(tensor)


def _transposed(view: torch.Tensor) -> bool:
    """Whether the 2-D ``view`` is ``m.T`` for a contiguous ``m``: torch copies those a block of
    entries at a time (aten's transposing copy), in the same dtype only."""
    return view.dim() == 2 and view.stride(0) == 1 and view.stride(1) == view.shape[0]


def in_memory(tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor`` contiguous, in its own dtype: without ``out``, itself when it is contiguous
    already, else a copy; with ``out`` (a contiguous tensor of its shape and dtype), copied into it.

    The converters hand a checkpoint's linear maps over as transposed views of the stored
    ``[out, in]`` matrices (``W_in = up_proj.weight.T``; per head, ``W_Q[h] =
    q_proj.weight[h * d_head:(h + 1) * d_head].T``). Such a view is copied as whole 2-D
    transposes, which torch does in cache-sized blocks: several times faster than the strided
    element-by-element copy it makes of a 3-D view, and than any copy that also converts the
    dtype (a transposing cast to float32). Casting afterwards, contiguous to contiguous, is cheap.
    """
    if tensor.is_contiguous():
        return tensor if out is None else out.copy_(tensor)
    out = new_tensor(tensor.shape, tensor.dtype, tensor.device) if out is None else out
    if tensor.dim() > 2:
        try:
            rows = tensor.view(-1, tensor.shape[-1])  # W_O: [n_heads, d_head, d_model] from o_proj.weight.T
        except RuntimeError:
            rows = None
        if rows is not None and _transposed(rows):
            out.view(-1, tensor.shape[-1]).copy_(rows)
            return out
        if tensor.dim() == 3 and all(_transposed(tensor[i]) for i in range(tensor.shape[0])):
            for i in range(tensor.shape[0]):  # W_Q, W_K, W_V: one transpose per head
                out[i].copy_(tensor[i])
            return out
    return out.copy_(tensor)
