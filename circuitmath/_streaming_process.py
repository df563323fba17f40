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
kernel from the checkpoint's file (:func:`~circuitmath._streaming_parts.find_untouched` finds which, on a small model of the same
kind), and where the processing keeps its inputs' layout
(:func:`~circuitmath._processing.dispatch.bits_free_of_strides`: the fused steps of a pre-RMSNorm
model) each product is computed from the mapped ``[out, in]`` matrix and written as it comes, so
no matrix is transposed. Otherwise (circuitmath's layout, or other steps) a stored ``[out, in]``
matrix is transposed in its own dtype (:func:`~circuitmath._processing._memory.in_memory`) into
:class:`~circuitmath._streaming_parts.PartReader`'s two sets of buffers, and a tensor the processing hands back is written as
the checkpoint holds it, unconverted. No block takes fresh memory: the processing maps its
outputs where those of the blocks written before were
(:func:`~circuitmath._processing._memory.recycling`), and the writer reuses its own buffers.
Fresh memory costs the kernel a fault and the zeroing of every page.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from ._checkpoint import Checkpoint, CheckpointWriter
from ._config import Config
from ._errors import InputError
from ._processing._memory import recycling
from ._processing._parts import Parts
from ._processing.dispatch import bits_free_of_strides
from ._processing.pipeline import process_weights
from ._processing.steps import STEPS, leaving_out, steps_between
from ._state import DTYPES, usable_device
from ._stored import UNEMBEDDING, NotStored, Untied, place, writing_steps
from ._streaming_parts import PartReader, find_untouched, opened, replayed

__all__ = ["process_checkpoint"]

Progress = Callable[[int, int, str], None]


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
    stored, untie = checkpoint.hf_config is not None, False
    while True:
        try:
            steps = leaving_out(keywords, left_out)
            steps = writing_steps(checkpoint.stored(None), checkpoint.cfg, steps) if stored else steps
            return _written(checkpoint, destination, steps, dtype or checkpoint.dtype, device, progress, stored, untie)
        except _PartsDisagree as disagreement:
            if disagreement.keywords <= left_out:  # cannot happen: a step left out applies nowhere
                raise RuntimeError(f"process_checkpoint: the parts disagree on {sorted(left_out)} left out") from None
            left_out |= disagreement.keywords
        except Untied:  # the layout holds the unembedding untied: written so, the config saying it
            stored, untie = stored and not untie, True
        except NotStored:
            stored = False


class _PartsDisagree(Exception):
    """A block applied other steps than the ends: ``keywords``, the steps one of them left out."""

    def __init__(self, keywords: frozenset[str]):
        super().__init__(sorted(keywords))
        self.keywords = keywords


def _config_written(checkpoint: Checkpoint, dtype: torch.dtype, untie: bool) -> dict:
    """The checkpoint's ``config.json`` for its processed copy in ``dtype`` (with ``untie``, its
    unembedding stored apart from the token embedding)."""
    config = dict(checkpoint.hf_config) | ({"tie_word_embeddings": False} if untie else {})
    for key in ("torch_dtype", "dtype"):  # transformers 4 and 5
        if key in config and dtype != checkpoint.dtype:
            config[key] = str(dtype).removeprefix("torch.")
    return config


def _written(checkpoint: Checkpoint, destination, keywords: dict, target: torch.dtype, device: torch.device,
             progress: Progress | None, stored: bool, untie: bool = False) -> Config:
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
        untouched = {True: find_untouched(cfg, keywords, None, target), False: find_untouched(cfg, keywords, 0, target)}
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
        if rewritten := sorted(n for n, t in reader.stand_ins.items() if out.get(n) is not t):  # find_untouched: kept
            raise RuntimeError(f"process_checkpoint: {process_weights.__name__} rewrote {rewritten}, found untouched")
        return out, out_cfg, same

    total = cfg.n_layers + 1
    # Each part is written by a thread of its own while the next is read and processed (a file's
    # write and torch's copies let go of the GIL); at most one write is under way, so at most
    # two parts are held.
    hf_config = _config_written(checkpoint, target, untie) if stored else None
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
                as_given |= _unchanged_partly_viewed(checkpoint, layer, tensors)
                specs, fill, copied = _stored_part(checkpoint, layer, tensors, as_given, target, untie)
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
                # the same steps, the same config (a block's part tells nothing of the ends' tie)
                if layer_cfg != out_cfg.replace(n_layers=1, d_vocab=1, tied_embeddings=layer_cfg.tied_embeddings):
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


def _unchanged_partly_viewed(checkpoint: Checkpoint, layer: int | None, out: dict[str, torch.Tensor]) -> set[str]:
    """The names of ``out`` (part ``layer`` of the processed model, on the CPU) taken from a
    stored tensor that its views do not cover once (OPT's positions, whose first rows no view
    reads; a tied embedding), where every one of its views came out bit for bit as the checkpoint
    holds it: that stored tensor is copied as it is. In half precision the processing computes in
    float32 and hands back new tensors, so none is found by identity."""
    entries, given, found = checkpoint.tensors.entries, None, set()
    for stored, names in checkpoint.stored(layer).items():
        if not names or not all(n in out for n in names) or \
                sum(out[n].numel() for n in names) == math.prod(entries[stored][2]["shape"]):
            continue
        given = given or (checkpoint.ends() if layer is None else checkpoint.block(layer))
        if all(out[n].dtype == given[n].dtype and torch.equal(out[n], given[n]) for n in names):
            found.update(names)
    return found


def _stored_part(checkpoint: Checkpoint, layer: int | None, out: dict[str, torch.Tensor], as_given: set[str],
                 dtype: torch.dtype, untie: bool = False):
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
    if untie and layer is None:  # the unembedding apart from the embedding, which the converter then reads it from
        specs[UNEMBEDDING] = (dtype, (checkpoint.cfg.d_vocab, checkpoint.cfg.d_model))
    def fill(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # the copied ones as placeholders: the converter takes them, nothing writes them
        for name in copied:
            buffers[name] = torch.zeros((), dtype=dtype).expand(specs[name][1])
        return place(checkpoint.native, layer, out, buffers, kept=frozenset(copied))

    return specs, fill, copied
