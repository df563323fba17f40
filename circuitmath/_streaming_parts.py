"""A checkpoint's parts as processing and its replay read them (:mod:`circuitmath._streaming_process`,
:mod:`circuitmath._streaming_check_processed`).

:class:`PartReader` hands over each part contiguous (or in the stored layout, where processing
keeps it), converted to the compute dtype, the blocks in reused buffers; :func:`find_untouched`
finds, on a small model of the same kind, which tensors the processing hands back as it got
them, so that they are neither converted nor written anew; :func:`replayed` runs one part
through :func:`~circuitmath.process_weights`, a processing of its own, or a chain of identities.
"""

from __future__ import annotations

import math
import mmap
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ._checkpoint import Checkpoint, open_checkpoint
from ._config import Config
from ._errors import CircuitMathError
from ._processing._memory import in_memory, new_tensor
from ._processing._parts import InMemory, Parts
from ._processing.pipeline import process_weights
from ._state import expected_shapes, not_finite

__all__ = ["opened", "Untouched", "find_untouched", "PartReader", "replayed"]


def opened(source, config=None) -> Checkpoint:
    return source if isinstance(source, Checkpoint) else open_checkpoint(source, config)


def _zeros(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Zeros that hold no memory: a private anonymous map, read through the kernel's zero page."""
    count = math.prod(shape)
    if count * dtype.itemsize < 1 << 20:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


@dataclass(frozen=True)
class Untouched:
    """The tensors of a kind of part (the ends, or a block in the names of block 0) that
    :func:`process_weights` hands back as it got them: ``kept`` (returned as the very tensor it
    was given: the transforms share what they do not change), and of those ``unread``, the
    ones that no other output depends on."""

    kept: frozenset[str] = frozenset()
    unread: frozenset[str] = frozenset()
    #: the steps the small model's part applied: a part that applies others (a step that applies
    #: or not by its weights, left to apply where it can) is read again whole
    applied: tuple[str, ...] = ()


def find_untouched(cfg: Config, keywords: dict, layer: int | None, dtype: torch.dtype) -> Untouched:
    """:class:`Untouched` of the part ``layer`` (``None``: the ends) of a model of ``cfg``'s
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
        return Untouched()
    return Untouched(frozenset(kept), frozenset(unread), applied[0])


class PartReader:
    """A checkpoint's parts as :class:`~circuitmath._processing._parts.Parts` takes them from a
    source: every tensor :func:`in_memory`, then converted to ``compute`` (``None``: left in the
    checkpoint's dtype). The blocks, all of one shape, are copied into ``buffer_sets`` sets of
    buffers in turn: a block's tensors live until ``buffer_sets`` more blocks are read.

    With ``untouched`` (``{True: ends, False: block}``, each an :class:`Untouched`), an unread
    tensor is handed over as zeros of ``compute`` that hold no memory, unless it is not finite
    (then as it is, so that the processing refuses it as in memory), and ``natives`` keeps the
    last part's kept tensors in the checkpoint's dtype, to be written in their place (with
    ``keep_all``, every tensor of the last part, contiguous in the checkpoint's dtype). With
    ``unread_as_stored``, an unread tensor's native is the checkpoint's tensor as the converters
    hand it over, not made contiguous: for a caller that writes it from another thread, which
    then does the copy. With ``as_stored``, no tensor is made contiguous: each is handed over
    as the converters give it (a view of the stored ``[out, in]`` matrix), for processing that
    keeps that layout and a writer that writes it (:mod:`circuitmath._stored`).
    """

    def __init__(self, checkpoint: Checkpoint, compute: torch.dtype | None, untouched: dict | None = None,
                 keep_all: bool = False, buffer_sets: int = 1, unread_as_stored: bool = False, as_stored: bool = False):
        self.checkpoint, self.compute, self.untouched, self.keep_all = checkpoint, compute, untouched, keep_all
        self.unread_as_stored, self.as_stored = unread_as_stored, as_stored
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
        untouched = Untouched() if self.untouched is None else self.untouched[layer is None]
        prefix = f"blocks.{layer}."
        self.natives, self.stand_ins, out = {}, {}, {}
        for name, tensor in tensors.items():
            key = None if layer is None else "blocks.0." + name[len(prefix):] if name.startswith(prefix) else name
            part_name = name if layer is None else key
            unread = part_name in untouched.unread and not not_finite(tensor)
            if (unread and self.unread_as_stored) or self.as_stored:
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


def replayed(parts: Parts, layer: int | None, keywords) -> tuple[dict[str, torch.Tensor], Config, set[int]]:
    """Part ``layer`` (``None``: the ends) of ``parts`` through :func:`process_weights` with
    ``keywords`` (or through each identity of a tuple of them, in turn): its tensors, its
    config, and the ids of the tensors handed back as given."""
    same: set[int] = set()

    def transform(state_dict, part_cfg):
        if isinstance(keywords, dict):
            out, out_cfg = process_weights(state_dict, part_cfg, **keywords)
        elif callable(keywords):  # the processing a folder is written in its own layout with
            out, out_cfg = keywords(state_dict, part_cfg)
        else:
            out, out_cfg = state_dict, part_cfg
            for identity in keywords:
                out, out_cfg = identity.transform(out, out_cfg)
        same.update(id(t) for n, t in out.items() if t is state_dict.get(n))
        return out, out_cfg

    out, out_cfg = parts.run(layer, transform)
    return out, out_cfg, same
