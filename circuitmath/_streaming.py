"""Processing checkpoints larger than memory, one part at a time.

Every processing identity is local: each processed tensor is a function of a few tensors of the
same layer (a reader and its norm, ``W_O`` and ``b_V``, a writer), or of the embedding and
unembedding. So :func:`process_checkpoint` runs :func:`~circuitmath.process_weights` itself,
unchanged, on one part of the model at a time: the embedding and unembedding as a model with no
blocks, then each block as a one-block model whose other tensors are zero stand-ins (a
one-token vocabulary; a shortformer model keeps its real ``W_pos``, which its blocks read). Each
part's tensors are those the whole model's processing writes, bit for bit, and each refusal is
the whole model's, naming the real layer. Memory holds one part at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ._checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from ._config import Config
from ._errors import CircuitMathError, InputError, PreconditionError
from ._processing.pipeline import PIPELINE_STEPS, process_weights
from ._state import DTYPES, expected_shapes

__all__ = ["STEPS", "KEYWORD_OF", "Parts", "process_checkpoint", "opened"]

#: The keywords of :func:`~circuitmath.process_weights`, in the order it applies them.
STEPS = tuple(keyword for keyword, _step in PIPELINE_STEPS)

#: The keyword of :func:`~circuitmath.process_weights` that applies each identity it records.
KEYWORD_OF = {
    "shortformer_to_tables": "fold_ln", "fold_layer_norm": "fold_ln", "center_reading_weights": "fold_ln",
    "fold_rms_norm": "fold_ln", "fold_value_biases": "fold_value_biases",
    "center_writing_weights": "center_writing_weights", "center_unembed": "center_unembed",
    "refactor_factored_attn_matrices": "refactor_factored_attn_matrices",
}

Progress = Callable[[int, int, str], None]


def opened(source, config=None) -> Checkpoint:
    return source if isinstance(source, Checkpoint) else open_checkpoint(source, config)


def _renamed(tensors: Mapping[str, torch.Tensor], old: int, new: int) -> dict[str, torch.Tensor]:
    prefix, into = f"blocks.{old}.", f"blocks.{new}."
    return {into + name[len(prefix):] if name.startswith(prefix) else name: t for name, t in tensors.items()}


def _in_part(error: CircuitMathError, path: Path, layer: int | None) -> CircuitMathError:
    """``error`` raised on a one-block part, saying the real layer (and the file, for bad input)."""
    message = str(error) if layer is None else re.sub(r"\bblocks\.0\.", f"blocks.{layer}.", str(error))
    if isinstance(error, PreconditionError):
        error.detail = error.detail if layer is None else re.sub(r"\bblocks\.0\.", f"blocks.{layer}.", error.detail)
    elif not message.startswith(str(path)):
        message = f"{path}: {message}"
    error.args = (message,)
    return error


class Parts:
    """A checkpoint cut into the models :func:`process_weights` runs on: :meth:`ends` (no
    blocks) and :meth:`block` (one block, with zero stand-ins for the rest), cast to ``dtype``
    and moved to ``device``."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype | None = None, device: torch.device | None = None):
        self.checkpoint, self.cfg = checkpoint, checkpoint.cfg
        self.dtype, self.device = dtype or checkpoint.dtype, device or torch.device("cpu")
        self.ends_cfg = self.cfg.replace(n_layers=0)
        self.block_cfg = self.cfg.replace(n_layers=1, d_vocab=1)
        self.positions = None  # a shortformer's W_pos, read by every block

    def _ready(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: t.contiguous().to(device=self.device, dtype=self.dtype) for n, t in tensors.items()}

    def ends(self) -> dict[str, torch.Tensor]:
        tensors = self._ready(self.checkpoint.ends())
        if self.cfg.positional_embedding_type == "shortformer":
            self.positions = tensors["pos_embed.W_pos"]
        return tensors

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        if self.cfg.positional_embedding_type == "shortformer" and self.positions is None:
            self.positions = self._ready({"W_pos": self.checkpoint.ends()["pos_embed.W_pos"]})["W_pos"]
        tensors = self._ready(_renamed(self.checkpoint.block(layer), layer, 0))
        for name, shape in expected_shapes(self.block_cfg).items():
            if not name.startswith("blocks."):
                tensors[name] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.positions is not None:
            tensors["pos_embed.W_pos"] = self.positions
        return tensors

    def run(self, layer: int | None, transform: Callable) -> tuple[dict[str, torch.Tensor], Config]:
        """``transform(state_dict, cfg)`` on the part (``None``: the ends), its output in the
        whole model's names (stand-ins dropped) on the CPU; errors name the real layer."""
        try:
            if layer is None:
                out, out_cfg = transform(self.ends(), self.ends_cfg)
                return {n: t.cpu().contiguous() for n, t in out.items()}, out_cfg.replace(n_layers=self.cfg.n_layers)
            out, out_cfg = transform(self.block(layer), self.block_cfg)
            kept = {n: t.cpu().contiguous() for n, t in out.items() if n.startswith("blocks.0.")}
            return _renamed(kept, 0, layer), out_cfg
        except CircuitMathError as error:
            raise _in_part(error, self.checkpoint.path, layer) from None


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
    parts = Parts(opened(source, config), dtype, device)
    cfg = parts.cfg

    def transform(state_dict, part_cfg):
        return process_weights(state_dict, part_cfg, **keywords)

    with CheckpointWriter(destination, cfg.n_layers + 1) as writer:
        out, out_cfg = parts.run(None, transform)
        writer.write(out, out_cfg)
        del out
        if progress:
            progress(1, cfg.n_layers + 1, "embedding and unembedding")
        for layer in range(cfg.n_layers):
            out, layer_cfg = parts.run(layer, transform)
            if layer_cfg != out_cfg.replace(n_layers=1, d_vocab=1):
                raise InputError(
                    f"{parts.checkpoint.path}: the steps that apply differ between parts: block {layer} gets"
                    f" {layer_cfg.applied}, the embedding and unembedding {out_cfg.applied}; name the steps to apply"
                )
            writer.write(out, out_cfg)
            del out
            if progress:
                progress(layer + 2, cfg.n_layers + 1, f"block {layer}")
    return out_cfg
