"""Processing checkpoints larger than memory, one part at a time.

:func:`process_checkpoint` runs :func:`~circuitmath.process_weights` itself, unchanged, on the
parts of ``circuitmath._processing._parts`` (the embedding and unembedding, then each block),
read from the checkpoint as they are needed and written as one shard each. Each part's tensors
are those the whole model's processing writes, bit for bit, and each refusal is the whole
model's, naming the real layer. Memory holds two parts at a time: one processed while the one
before is written by a thread of its own.

Most of the time goes into moving bytes, so each is moved only as much as it must be: a stored
``[out, in]`` matrix is transposed in its own dtype (:func:`in_memory`); a tensor the processing
hands back as it got it is written as the checkpoint holds it, unconverted (:func:`_untouched`
finds which, on a small model of the same kind), and one it does not even read is transposed by
the writing thread (:class:`_Contiguous`), which otherwise waits on the disk; and no block takes
fresh memory: :class:`PartReader` reads the blocks into two sets of buffers in turn, the
processing maps its outputs where those of the blocks written before were
(:func:`~circuitmath._processing._memory.recycling`), and the writing thread has buffers of its
own. Fresh memory costs the kernel a fault and the zeroing of every page.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ._checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from ._config import Config
from ._errors import CircuitMathError, InputError
from ._processing._memory import new_tensor, recycling
from ._processing._parts import InMemory, Parts
from ._processing.pipeline import KEYWORD_OF, STEPS, process_weights, steps_between, steps_left_out
from ._state import DTYPES, expected_shapes, not_finite, usable_device

__all__ = ["STEPS", "KEYWORD_OF", "process_checkpoint", "opened", "PartReader", "replayed"]

Progress = Callable[[int, int, str], None]


def opened(source, config=None) -> Checkpoint:
    return source if isinstance(source, Checkpoint) else open_checkpoint(source, config)


def _transposed(view: torch.Tensor) -> bool:
    """Whether the 2-D ``view`` is ``m.T`` for a contiguous ``m``: torch copies those a block of
    entries at a time (aten's transposing copy), in the same dtype only."""
    return view.dim() == 2 and view.stride(0) == 1 and view.stride(1) == view.shape[0]


def in_memory(tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor`` contiguous, in its own dtype: itself when it is contiguous already, else a copy
    (into ``out``, a contiguous tensor of its shape and dtype, when given).

    The converters hand a checkpoint's linear maps over as transposed views of the stored
    ``[out, in]`` matrices (``W_in = up_proj.weight.T``; per head, ``W_Q[h] =
    q_proj.weight[h * d_head:(h + 1) * d_head].T``). Such a view is copied as whole 2-D
    transposes, which torch does in cache-sized blocks: several times faster than the strided
    element-by-element copy it makes of a 3-D view, and than any copy that also converts the
    dtype (for a bfloat16 ``[11008, 4096]`` matrix here, 0.11 s against 1.0 s for a transposing
    cast to float32). Casting afterwards, contiguous to contiguous, is cheap.
    """
    if tensor.is_contiguous():
        return tensor
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


def _zeros(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Zeros that hold no memory: a private anonymous map, read through the kernel's zero page."""
    count = math.prod(shape)
    if count * dtype.itemsize < 1 << 20:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


@dataclass(frozen=True)
class _Untouched:
    """The tensors of a kind of part (the ends, or a block in the names of block 0) that
    :func:`process_weights` hands back as it got them: ``kept`` (returned as the very tensor it
    was given: the transforms share what they do not change), and of those ``unread``, the
    ones that no other output depends on."""

    kept: frozenset[str] = frozenset()
    unread: frozenset[str] = frozenset()
    #: the steps the small model's part applied: a part that applies others (a step that applies
    #: or not by its weights, left to apply where it can) is read again whole
    applied: tuple[str, ...] = ()


def _untouched(cfg: Config, keywords: dict, layer: int | None, dtype: torch.dtype) -> _Untouched:
    """:class:`_Untouched` of the part ``layer`` (``None``: the ends) of a model of ``cfg``'s
    kind processed in ``dtype``, found by processing one: ``cfg`` with ``d_model``, ``d_mlp``,
    ``d_vocab`` and ``n_ctx`` shrunk (every flag, head count and ``d_head`` as they are) and
    random weights in ``dtype``, no entry zero (a half-precision part that process_weights casts
    to float32 hands nothing back as it got it). A kept tensor is unread when redrawing it, alone
    and then together with the other unread ones, leaves every other output as it was, bit for
    bit. What each step reads and writes depends on the config only, so a model's parts of that
    kind that apply the same steps share the answer (the tests compare every architecture's
    streamed output with the in-memory one); whether a step left to apply where it can applies
    may depend on the weights, so the steps applied are part of the answer. A refusal (or any
    failure) on the small model finds nothing untouched: the real part then meets its refusal,
    or is processed with every tensor converted."""
    small = cfg.replace(n_layers=1, d_model=4, d_mlp=None if cfg.d_mlp is None else 4, d_vocab=3, n_ctx=min(cfg.n_ctx, 3))
    g = torch.Generator().manual_seed(0)
    weights = {n: (torch.randn(shape, generator=g) + 0.5).to(dtype) for n, shape in expected_shapes(small).items()}
    parts = Parts(InMemory(weights), small, dtype, torch.device("cpu"))

    def processed(redrawn: frozenset[str] = frozenset()):
        given = {}

        def transform(state_dict, part_cfg):
            state_dict = dict(state_dict, **{n: (torch.randn(state_dict[n].shape, generator=g) * 3 - 1).to(dtype) for n in redrawn})
            given.update(state_dict)
            return process_weights(state_dict, part_cfg, **keywords)

        out, out_cfg = parts.run(layer, transform)
        applied.append(out_cfg.applied)
        return out, {n for n, t in out.items() if t is given.get(n)}

    def others_unchanged(out, redrawn) -> bool:
        return all(torch.equal(out[n], base[n]) for n in base if n not in redrawn)

    applied: list[tuple[str, ...]] = []
    try:
        base, kept = processed()
        unread = set()
        for name in kept:
            out, same = processed(frozenset([name]))
            if name in same and others_unchanged(out, {name}):
                unread.add(name)
        if unread:
            out, same = processed(frozenset(unread))
            if not (unread <= same and others_unchanged(out, unread)):
                unread = set()
    except (CircuitMathError, RuntimeError, ValueError):  # nothing found: every tensor converted, always right
        return _Untouched()
    return _Untouched(frozenset(kept), frozenset(unread), applied[0])


class PartReader:
    """A checkpoint's parts as :class:`~circuitmath._processing._parts.Parts` takes them from a
    source: every tensor :func:`in_memory`, then converted to ``compute`` (``None``: left in the
    checkpoint's dtype). The blocks, all of one shape, are copied into ``buffer_sets`` sets of
    buffers in turn: a block's tensors live until ``buffer_sets`` more blocks are read.

    With ``untouched`` (``{True: ends, False: block}``, each an :class:`_Untouched`), an unread
    tensor is handed over as zeros of ``compute`` that hold no memory, unless it is not finite
    (then as it is, so that the processing refuses it as in memory), and ``natives`` keeps the
    last part's kept tensors in the checkpoint's dtype, to be written in their place (with
    ``keep_all``, every tensor of the last part, contiguous in the checkpoint's dtype). With
    ``unread_as_stored``, an unread tensor's native is the checkpoint's tensor as the converters
    hand it over, not made contiguous: for a caller that writes it from another thread
    (:class:`_Contiguous`), which then does the copy.
    """

    def __init__(self, checkpoint: Checkpoint, compute: torch.dtype | None, untouched: dict | None = None,
                 keep_all: bool = False, buffer_sets: int = 1, unread_as_stored: bool = False):
        self.checkpoint, self.compute, self.untouched, self.keep_all = checkpoint, compute, untouched, keep_all
        self.unread_as_stored = unread_as_stored
        self.buffers: dict[tuple[int, str, str], torch.Tensor] = {}
        self.buffer_sets, self.blocks_read, self.again = buffer_sets, 0, False
        self.natives: dict[str, torch.Tensor] = {}
        self.stand_ins: dict[str, torch.Tensor] = {}
        self.handed: dict[str, torch.Tensor] = {}  # the last block, as handed over (in the reused buffers)

    def _buffer(self, kind: str, name: str | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        if name is None:  # the ends are read once: nothing to reuse
            return None
        key = (self.blocks_read % self.buffer_sets, kind, name)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != dtype:
            buffer = self.buffers[key] = new_tensor(like.shape, dtype, like.device)
        return buffer

    def _prepared(self, tensors: dict[str, torch.Tensor], layer: int | None) -> dict[str, torch.Tensor]:
        untouched = _Untouched() if self.untouched is None else self.untouched[layer is None]
        prefix = f"blocks.{layer}."
        self.natives, self.stand_ins, out = {}, {}, {}
        for name, tensor in tensors.items():
            key = None if layer is None else "blocks.0." + name[len(prefix):] if name.startswith(prefix) else name
            part_name = name if layer is None else key
            unread = part_name in untouched.unread and not not_finite(tensor)
            if unread and self.unread_as_stored:
                native = tensor
            else:
                native = in_memory(tensor, None if tensor.is_contiguous() else self._buffer("native", key, tensor, tensor.dtype))
            if self.keep_all or part_name in untouched.kept:
                self.natives[name] = native
            if unread:
                out[name] = self.stand_ins[name] = _zeros(native.shape, self.compute or native.dtype)
            elif self.compute is None or self.compute == native.dtype:
                out[name] = native
            else:
                converted = self._buffer("compute", key, native, self.compute)
                out[name] = native.to(self.compute) if converted is None else converted.copy_(native)
        self.handed = out if layer is not None else {}
        return out

    def ends(self) -> dict[str, torch.Tensor]:
        return self._prepared(self.checkpoint.ends(), None)

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        """Block ``layer``'s tensors, in the next of ``buffer_sets`` sets of buffers (with two, a
        block's tensors live until the next but one block is read)."""
        self.blocks_read += not self.again
        return self._prepared(self.checkpoint.block(layer), layer)

    @contextmanager
    def whole(self):
        """Within this block the part last read is read again, into the same buffers, with no
        stand-ins: every tensor as the checkpoint holds it."""
        untouched, self.untouched, self.again = self.untouched, None, True
        try:
            yield
        finally:
            self.untouched, self.again = untouched, False


def replayed(parts: Parts, layer: int | None, keywords: dict) -> tuple[dict[str, torch.Tensor], Config, set[int]]:
    """Part ``layer`` (``None``: the ends) of ``parts`` through :func:`process_weights` with
    ``keywords``: its tensors, its config, and the ids of the tensors handed back as given."""
    same: set[int] = set()

    def transform(state_dict, part_cfg):
        out, out_cfg = process_weights(state_dict, part_cfg, **keywords)
        same.update(id(t) for n, t in out.items() if t is state_dict.get(n))
        return out, out_cfg

    out, out_cfg = parts.run(layer, transform)
    return out, out_cfg, same


class _Contiguous:
    """A part's tensors contiguous, for writing: one that is not is copied by :func:`in_memory`,
    a block's into a buffer that the next block reuses for its tensor of the same place, shape
    and dtype (a block's tensors come in the same order in every block). For the one thread
    that writes the parts, one at a time."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def __call__(self, tensors: dict[str, torch.Tensor], block: bool) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for place, (name, tensor) in enumerate(tensors.items()):
            key = (place, tensor.shape, tensor.dtype)
            if block and not tensor.is_contiguous() and key not in self.buffers:
                self.buffers[key] = new_tensor(tensor.shape, tensor.dtype, tensor.device)
            out[name] = in_memory(tensor, self.buffers.get(key) if block else None)
        return out


def _keywords(steps) -> dict[str, bool | None]:
    """:func:`process_weights` keywords: its defaults (``None``), every step that applies
    (``"applicable"``), or exactly the steps named (an iterable of keywords)."""
    if steps is None:
        return {}
    if steps == "applicable":
        return dict.fromkeys(STEPS)
    chosen = list(steps)
    unknown = [s for s in chosen if s not in STEPS]
    if unknown:
        raise InputError(f"unknown processing steps {unknown}; the steps are {', '.join(STEPS)} (or 'applicable')")
    return {keyword: keyword in chosen for keyword in STEPS}


def process_checkpoint(
    source, destination, *, steps=None, dtype: torch.dtype | None = None, device=None, config=None,
    progress: Progress | None = None,
) -> Config:
    """:func:`~circuitmath.process_weights` of the checkpoint ``source``, written to the folder
    ``destination`` one part at a time; returns the processed model's config.

    ``source`` is anything :func:`~circuitmath.io.open_checkpoint` opens (``config`` as there).
    ``steps``: ``None`` for :func:`process_weights`' defaults, ``"applicable"`` for every step
    where it applies, or the keywords of the steps to apply (the others are left out). ``dtype``
    casts the weights before processing (default: the checkpoint's); ``device`` is where each
    part is processed. The output is one safetensors shard per part (``model-00001-of-N``, the
    embedding and unembedding first), each carrying the processed config in its metadata, and
    ``model.safetensors.index.json``; it is written under a temporary name and renamed at the
    end, so a refusal, an error or an interruption leaves nothing. ``destination`` must not
    exist. Peak memory is what :func:`process_weights` needs for the largest part, plus the part
    before it (written meanwhile).
    """
    keywords = _keywords(steps)
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"dtype {dtype}: circuitmath computes in {', '.join(map(str, DTYPES))}")
    device = usable_device(device, "device")
    checkpoint = opened(source, config)
    # A step left to apply where it can (None) that some part does not apply is left out of the
    # whole model, as process_weights leaves it out in memory: found on a part, it is left out
    # of every part and the writing starts again (what was written is removed).
    left_out: frozenset[str] = frozenset()
    while True:
        try:
            with steps_left_out(left_out):
                return _written(checkpoint, destination, keywords, dtype or checkpoint.dtype, device, progress)
        except _PartsDisagree as disagreement:
            if disagreement.keywords <= left_out:  # cannot happen: a step left out applies nowhere
                raise RuntimeError(f"process_checkpoint: the parts disagree on {sorted(left_out)} left out") from None
            left_out |= disagreement.keywords


class _PartsDisagree(Exception):
    """A block applied other steps than the ends: ``keywords``, the steps one of them left out."""

    def __init__(self, keywords: frozenset[str]):
        super().__init__(sorted(keywords))
        self.keywords = keywords


def _written(checkpoint: Checkpoint, destination, keywords: dict, target: torch.dtype, device: torch.device,
             progress: Progress | None) -> Config:
    """The body of :func:`process_checkpoint`: ``checkpoint`` processed in ``target`` on ``device``
    and written to ``destination``; raises :class:`_PartsDisagree` when a block applies other
    steps than the ends."""
    # each part in the target dtype: process_weights computes a half-precision one in float32
    # itself (a block of rows at a time where the fused steps are all it applies), rounded once
    cfg = checkpoint.cfg
    # In its own dtype, on the CPU, a tensor that the processing hands back as it got it is
    # written as the checkpoint holds it (the same bits: float32 holds every half-precision
    # number), and an unread one is neither converted nor rounded.
    untouched = None
    if target == checkpoint.dtype and device.type == "cpu":
        untouched = {True: _untouched(cfg, keywords, None, target), False: _untouched(cfg, keywords, 0, target)}
    # two sets of block buffers: a block's tensors are written while the next block is read
    reader = PartReader(checkpoint, target if device.type == "cpu" else None, untouched, buffer_sets=2,
                        unread_as_stored=True)
    parts = Parts(reader, cfg, target, device, checkpoint.path)

    def run(layer: int | None) -> tuple[dict[str, torch.Tensor], Config]:
        out, out_cfg, same = replayed(parts, layer, keywords)
        if reader.stand_ins and out_cfg.applied != untouched[layer is None].applied:
            # the part takes other steps than the small model did, so the stand-ins may have been
            # read: read it again whole (the checkpoint's tensors, every one converted)
            del out
            with reader.whole():
                out, out_cfg, same = replayed(parts, layer, keywords)
        if any(out.get(n) is not t for n, t in reader.stand_ins.items()):  # _untouched found them passed through
            raise RuntimeError(f"process_checkpoint: {process_weights.__name__} rewrote {sorted(reader.stand_ins)}, found untouched")
        written = {n: reader.natives[n] if id(t) in same and n in reader.natives else t for n, t in out.items()}
        reader.natives, reader.stand_ins = {}, {}
        return written, out_cfg

    total = cfg.n_layers + 1
    # Each part is written by a thread of its own while the next is read and processed (a file's
    # write lets go of the GIL); at most one write is under way, so at most two parts are held.
    contiguous = _Contiguous()  # the writing thread's: it copies the tensors written as stored
    with CheckpointWriter(destination, total) as writer, ThreadPoolExecutor(1) as pool:
        writing, written = None, []

        def wait() -> None:
            if writing is not None:
                writing.result()  # the part before is on disk (its error raised here)
                if progress:
                    progress(len(written), total, written[-1])

        def write(out: dict[str, torch.Tensor], what: str, block: bool = True) -> None:
            nonlocal writing
            wait()
            on_cpu = {n: t.cpu() for n, t in out.items()}
            writing = pool.submit(lambda tensors, cfg: writer.write(contiguous(tensors, block), cfg), on_cpu, out_cfg)
            written.append(what)

        out, out_cfg = run(None)
        write(out, "embedding and unembedding", block=False)
        del out
        with recycling():  # the blocks' new tensors in the maps of those written before
            for layer in range(cfg.n_layers):
                out, layer_cfg = run(layer)
                if layer_cfg.applied != out_cfg.applied:
                    raise _PartsDisagree(steps_between(layer_cfg.applied, out_cfg.applied))
                if layer_cfg != out_cfg.replace(n_layers=1, d_vocab=1):  # cannot happen: the same steps, the same config
                    raise RuntimeError(f"process_checkpoint: block {layer} gives {layer_cfg}, the ends {out_cfg}")
                write(out, f"block {layer}")
                del out
            wait()
    return out_cfg
