"""Processing checkpoints larger than memory, one part at a time.

:func:`process_checkpoint` runs :func:`~circuitmath.process_weights` itself, unchanged, on the
parts of ``circuitmath._processing._parts`` (the embedding and unembedding, then each block),
read from the checkpoint as they are needed and written as one shard each. Each part's tensors
are those the whole model's processing writes, bit for bit, and each refusal is the whole
model's, naming the real layer. Memory holds two parts at a time: one processed while the one
before is written by a thread of its own.

Most of the time goes into moving bytes, so each is moved only as much as it must be. A Hugging
Face folder is written in its own layout where the processed model fits it
(:mod:`circuitmath._stored`): a tensor the processing hands back as it got it is copied by the
kernel from the checkpoint's file (:func:`_untouched` finds which, on a small model of the same
kind), and where the processing keeps its inputs' layout
(:func:`~circuitmath._processing.dispatch.bits_free_of_strides`: the fused steps of a pre-RMSNorm
model) each product is computed from the mapped ``[out, in]`` matrix and written as it comes, so
no matrix is transposed. Otherwise (circuitmath's layout, or other steps) a stored ``[out, in]``
matrix is transposed in its own dtype (:func:`~circuitmath._processing._memory.in_memory`) into
:class:`PartReader`'s two sets of buffers, and a tensor the processing hands back is written as
the checkpoint holds it, unconverted. No block takes fresh memory: the processing maps its
outputs where those of the blocks written before were
(:func:`~circuitmath._processing._memory.recycling`), and the writer reuses its own buffers.
Fresh memory costs the kernel a fault and the zeroing of every page.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from dataclasses import dataclass

import torch

from ._checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from ._config import Config
from ._errors import CircuitMathError, InputError
from ._processing._memory import in_memory, new_tensor, recycling
from ._processing._parts import InMemory, Parts
from ._processing.dispatch import bits_free_of_strides
from ._processing.pipeline import process_weights
from ._processing.steps import STEPS, leaving_out, steps_between
from ._state import DTYPES, expected_shapes, not_finite, usable_device
from ._stored import NotStored, place, writing_steps

__all__ = ["process_checkpoint", "opened", "PartReader", "replayed"]

Progress = Callable[[int, int, str], None]


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
        untouched = _Untouched() if self.untouched is None else self.untouched[layer is None]
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

    A Hugging Face folder (its ``config.json`` a dict) comes out in its own architecture's names
    and layout where the processed model fits them (:mod:`circuitmath._stored`: for LLaMA, the
    same tensors with the norms' gains folded into the next maps and set to 1, ``config.json``
    copied), so it loads wherever the input did; the tensors the processing hands back as given
    are copied by the kernel, and no matrix is transposed. GPT-2 and GPT-NeoX, which have no
    unembedding bias for the folded final LayerNorm's, are processed with the steps
    :func:`~circuitmath._stored.writing_steps` chooses (the norms' readers not centered, the
    final norm's bias kept; ``applied`` says which). A processed model the layout cannot hold (a
    tied embedding the processing makes differ from the unembedding) is written in
    circuitmath's names, with :func:`process_weights`' steps, as a circuitmath checkpoint is.
    """
    keywords = _keywords(steps)
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"dtype {dtype}: circuitmath computes in {', '.join(map(str, DTYPES))}")
    device = usable_device(device, "device")
    checkpoint = opened(source, config)
    # A step left to apply where it can (None) that some part does not apply is left out of the
    # whole model, as process_weights leaves it out in memory: found on a part, it is left out
    # of every part and the writing starts again (what was written is removed). So is a part the
    # checkpoint's own layout cannot hold: then the whole model is written in circuitmath's.
    left_out: frozenset[str] = frozenset()
    stored = checkpoint.hf_config is not None
    while True:
        try:
            steps = leaving_out(keywords, left_out)
            steps = writing_steps(checkpoint.stored(None), checkpoint.cfg, steps) if stored else steps
            return _written(checkpoint, destination, steps, dtype or checkpoint.dtype, device, progress, stored)
        except _PartsDisagree as disagreement:
            if disagreement.keywords <= left_out:  # cannot happen: a step left out applies nowhere
                raise RuntimeError(f"process_checkpoint: the parts disagree on {sorted(left_out)} left out") from None
            left_out |= disagreement.keywords
        except NotStored:
            stored = False


class _PartsDisagree(Exception):
    """A block applied other steps than the ends: ``keywords``, the steps one of them left out."""

    def __init__(self, keywords: frozenset[str]):
        super().__init__(sorted(keywords))
        self.keywords = keywords


def _config_written(checkpoint: Checkpoint, dtype: torch.dtype) -> dict:
    """The checkpoint's ``config.json`` for its processed copy in ``dtype``."""
    config = dict(checkpoint.hf_config)
    for key in ("torch_dtype", "dtype"):  # transformers 4 and 5
        if key in config and dtype != checkpoint.dtype:
            config[key] = str(dtype).removeprefix("torch.")
    return config


def _written(checkpoint: Checkpoint, destination, keywords: dict, target: torch.dtype, device: torch.device,
             progress: Progress | None, stored: bool) -> Config:
    """The body of :func:`process_checkpoint`: ``checkpoint`` processed in ``target`` on ``device``
    and written to ``destination`` (with ``stored``, in the checkpoint's own layout); raises
    :class:`_PartsDisagree` when a block applies other steps than the ends, and
    :class:`~circuitmath._stored.NotStored` when a part does not fit the checkpoint's layout."""
    # each part in the target dtype: process_weights computes a half-precision one in float32
    # itself (a block of rows at a time where the fused steps are all it applies), rounded once
    cfg = checkpoint.cfg
    # In its own dtype, on the CPU, a tensor that the processing hands back as it got it is
    # written as the checkpoint holds it (the same bits: float32 holds every half-precision
    # number), and an unread one is neither converted nor rounded.
    untouched = None
    if target == checkpoint.dtype and device.type == "cpu" and isinstance(keywords, dict):
        untouched = {True: _untouched(cfg, keywords, None, target), False: _untouched(cfg, keywords, 0, target)}
    # two sets of block buffers: a block's tensors are written while the next block is read;
    # none where the output is in the checkpoint's layout and the processing keeps it: each
    # tensor is then processed where it is mapped and its product written as it comes
    as_stored = stored and isinstance(keywords, dict) and bits_free_of_strides(cfg, keywords)
    reader = PartReader(checkpoint, target if device.type == "cpu" else None, untouched, buffer_sets=2,
                        unread_as_stored=True, as_stored=as_stored)
    parts = Parts(reader, cfg, target, device, checkpoint.path, keep_layout=as_stored)

    def run(layer: int | None) -> tuple[dict[str, torch.Tensor], Config, set[int]]:
        out, out_cfg, same = replayed(parts, layer, keywords)
        if reader.stand_ins and out_cfg.applied != untouched[layer is None].applied:
            # the part takes other steps than the small model did, so the stand-ins may have been
            # read: read it again whole (the checkpoint's tensors, every one converted)
            del out
            with reader.whole():
                out, out_cfg, same = replayed(parts, layer, keywords)
        if any(out.get(n) is not t for n, t in reader.stand_ins.items()):  # _untouched found them passed through
            raise RuntimeError(f"process_checkpoint: {process_weights.__name__} rewrote {sorted(reader.stand_ins)}, found untouched")
        return out, out_cfg, same

    total = cfg.n_layers + 1
    # Each part is written by a thread of its own while the next is read and processed (a file's
    # write and torch's copies let go of the GIL); at most one write is under way, so at most
    # two parts are held.
    hf_config = _config_written(checkpoint, target) if stored else None
    with CheckpointWriter(destination, total, hf_config) as writer, ThreadPoolExecutor(1) as pool:
        writing, written = None, []

        def wait() -> None:
            if writing is not None:
                writing.result()  # the part before is on disk (its error raised here)
                if progress:
                    progress(len(written), total, written[-1])

        def write(layer: int | None, out: dict[str, torch.Tensor], same: set[int], what: str) -> None:
            nonlocal writing
            wait()
            as_given = {n for n, t in out.items() if id(t) in same and n in reader.natives}
            tensors = {n: reader.natives[n] if n in as_given else t.cpu() for n, t in out.items()}
            reader.natives, reader.stand_ins = {}, {}
            if stored:
                specs, fill, copied = _stored_part(checkpoint, layer, tensors, as_given, target)
                job = [partial(writer.write_stored, specs, fill, out_cfg, copied)]
            else:
                job = [partial(writer.write, tensors, out_cfg)]
            del tensors
            writing = pool.submit(_released, job)
            written.append(what)

        out, out_cfg, same = run(None)
        write(None, out, same, "embedding and unembedding")
        del out
        with recycling():  # the blocks' new tensors in the maps of those written before
            for layer in range(cfg.n_layers):
                out, layer_cfg, same = run(layer)
                if layer_cfg.applied != out_cfg.applied:
                    raise _PartsDisagree(steps_between(layer_cfg.applied, out_cfg.applied))
                if layer_cfg != out_cfg.replace(n_layers=1, d_vocab=1):  # cannot happen: the same steps, the same config
                    raise RuntimeError(f"process_checkpoint: block {layer} gives {layer_cfg}, the ends {out_cfg}")
                write(layer, out, same, f"block {layer}")
                del out
            wait()
    return out_cfg


def _released(job: list[Callable[[], None]]) -> None:
    """Run the one call in ``job``, taken out of it first. The pool's work item keeps its
    arguments until its thread gets round to dropping it, which may be after the part's result
    is in (on a busy machine, often): through ``job`` it keeps nothing, so once a part is on disk
    no reference to its tensors is left and the next blocks recycle their maps."""
    job.pop()()


def _stored_part(checkpoint: Checkpoint, layer: int | None, out: dict[str, torch.Tensor], as_given: set[str],
                 dtype: torch.dtype):
    """The stored tensors' specs, the fill and the copied tensors that
    :meth:`~circuitmath._checkpoint.CheckpointWriter.write_stored` takes to write part ``layer``
    of the processed model ``out`` (on the CPU) in the checkpoint's layout: filled by
    :func:`~circuitmath._stored.place`, but for the stored tensors whose every view the
    processing handed back as given (``as_given``: their tensors in ``out`` are the
    checkpoint's), copied from the checkpoint's file."""
    viewed = checkpoint.stored(layer)
    entries = checkpoint.tensors.entries
    copied = {name: (entries[name][0], entries[name][1] + entries[name][2]["data_offsets"][0])
              for name, names in viewed.items() if names and all(n in as_given for n in names)}
    specs = {name: (dtype, tuple(entries[name][2]["shape"])) for name in viewed}
    def fill(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # the copied ones as placeholders: the converter takes them, nothing writes them
        for name in copied:
            buffers[name] = torch.zeros((), dtype=dtype).expand(specs[name][1])
        return place(checkpoint.native, layer, out, buffers, kept=frozenset(copied))

    return specs, fill, copied
