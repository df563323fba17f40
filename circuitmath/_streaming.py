"""Processing checkpoints larger than memory, one part at a time.

:func:`process_checkpoint` runs :func:`~circuitmath.process_weights` itself, unchanged, on the
parts of ``circuitmath._processing._parts`` (the embedding and unembedding, then each block),
read from the checkpoint as they are needed and written as one shard each. Each part's tensors
are those the whole model's processing writes, bit for bit, and each refusal is the whole
model's, naming the real layer. Memory holds one part at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from ._config import Config
from ._errors import InputError
from ._processing._parts import Parts
from ._processing.pipeline import KEYWORD_OF, STEPS, process_weights, rounded_once
from ._state import DTYPES

__all__ = ["STEPS", "KEYWORD_OF", "checkpoint_parts", "process_checkpoint", "opened"]

Progress = Callable[[int, int, str], None]


def opened(source, config=None) -> Checkpoint:
    return source if isinstance(source, Checkpoint) else open_checkpoint(source, config)


def checkpoint_parts(checkpoint: Checkpoint, dtype: torch.dtype | None = None, device=None) -> Parts:
    """``checkpoint`` cut into parts cast to ``dtype`` (default: its own) on ``device`` (default: the CPU)."""
    return Parts(checkpoint, checkpoint.cfg, dtype or checkpoint.dtype, device or torch.device("cpu"), checkpoint.path)


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.cpu().contiguous() for n, t in tensors.items()}


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
    exist. Peak memory is what :func:`process_weights` needs for the largest part.
    """
    keywords = _keywords(steps)
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"dtype {dtype}: circuitmath computes in {', '.join(map(str, DTYPES))}")
    try:
        device = torch.device(device) if device is not None else None
        if device is not None:
            torch.empty(0, device=device)  # a device this torch build cannot use is refused here
    except (RuntimeError, AssertionError) as error:
        raise InputError(f"device {device!r} cannot be used: {error}") from None
    checkpoint = opened(source, config)
    target = dtype or checkpoint.dtype
    # a half-precision checkpoint kept in its dtype: each part read straight into float32 and
    # rounded once at the end, as process_weights does with a half-precision model (the same
    # bits), not cast twice; a cast to another dtype first rounds the weights to it (then
    # process_weights computes a half-precision part in float32 itself)
    half = torch.finfo(target).bits < 32 and target == checkpoint.dtype
    parts = checkpoint_parts(checkpoint, torch.float32 if half else target, device)
    cfg = parts.cfg

    def transform(state_dict, part_cfg):
        out, out_cfg = process_weights(state_dict, part_cfg, **keywords)
        return (rounded_once(out, target) if half else out), out_cfg

    with CheckpointWriter(destination, cfg.n_layers + 1) as writer:
        out, out_cfg = parts.run(None, transform)
        writer.write(_on_cpu(out), out_cfg)
        del out
        if progress:
            progress(1, cfg.n_layers + 1, "embedding and unembedding")
        for layer in range(cfg.n_layers):
            out, layer_cfg = parts.run(layer, transform)
            if layer_cfg != out_cfg.replace(n_layers=1, d_vocab=1):
                raise InputError(
                    f"{parts.path}: the steps that apply differ between parts: block {layer} gets"
                    f" {layer_cfg.applied}, the embedding and unembedding {out_cfg.applied}; name the steps to apply"
                )
            writer.write(_on_cpu(out), out_cfg)
            del out
            if progress:
                progress(layer + 2, cfg.n_layers + 1, f"block {layer}")
    return out_cfg
