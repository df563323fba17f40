"""A model cut into the parts that the processing pipeline runs on, one at a time.

Every processing identity is local: each processed tensor is a function of a few tensors of the
same block (a reader and its norm, ``W_O`` and ``b_V``, a writer), or of the embedding and
unembedding. So :func:`~circuitmath.process_weights` can run, unchanged, on one part of a model
at a time: the embedding and unembedding as a model with no blocks (:meth:`Parts.ends`), then
each block as a one-block model whose other tensors are zero stand-ins (:meth:`Parts.block`: a
one-token vocabulary; a shortformer model keeps its real ``W_pos``, which its blocks read). Each
part's tensors are those the whole model's processing writes, bit for bit, and a refusal on a
part is the whole model's, naming the real layer.

Two users: half-precision processing in memory (each part cast to float32 while it is
processed, so that no float32 copy of the whole model is made) and the processing of checkpoints
larger than memory (``circuitmath._streaming_process``). A source is anything with ``ends()`` and
``block(layer)`` returning tensors in circuitmath names: a :class:`~circuitmath._checkpoint.Checkpoint`
or :class:`InMemory`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from .._config import Config
from .._errors import CircuitMathError, PreconditionError
from .._state import expected_shapes
from ._memory import SCRATCH_MIN_BYTES, converted, new_tensor

__all__ = ["InMemory", "Parts"]


class InMemory:
    """A state dict seen as a source of parts: :meth:`ends` and :meth:`block` return its tensors
    (shared, not copied) outside the blocks and of one block."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.state_dict = state_dict

    def ends(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.state_dict.items() if not n.startswith("blocks.")}

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        prefix = f"blocks.{layer}."
        return {n: t for n, t in self.state_dict.items() if n.startswith(prefix)}


def _renamed(tensors: Mapping[str, torch.Tensor], old: int, new: int) -> dict[str, torch.Tensor]:
    prefix, into = f"blocks.{old}.", f"blocks.{new}."
    return {into + name[len(prefix):] if name.startswith(prefix) else name: t for name, t in tensors.items()}


def _in_part(error: CircuitMathError, path: Path | None, layer: int | None) -> CircuitMathError:
    """``error`` raised on a one-block part, saying the real layer (and the file, for bad input)."""
    message = str(error) if layer is None else re.sub(r"\bblocks\.0\.", f"blocks.{layer}.", str(error))
    if isinstance(error, PreconditionError):
        error.detail = error.detail if layer is None else re.sub(r"\bblocks\.0\.", f"blocks.{layer}.", error.detail)
    elif path is not None and not message.startswith(str(path)):
        message = f"{path}: {message}"
    error.args = (message,)
    return error


class Parts:
    """``source`` (config ``cfg``) cut into the models :func:`~circuitmath.process_weights` runs
    on, each cast to ``dtype`` and moved to ``device`` when it is taken (and made contiguous,
    unless ``keep_layout``); ``path`` (a file) is named by errors about bad input."""

    def __init__(self, source, cfg: Config, dtype: torch.dtype, device: torch.device, path: Path | None = None,
                 keep_layout: bool = False):
        self.source, self.cfg, self.dtype, self.device, self.path = source, cfg, dtype, device, path
        self.keep_layout = keep_layout
        self.ends_cfg = cfg.replace(n_layers=0)
        self.block_cfg = cfg.replace(n_layers=1, d_vocab=1)
        self.positions = None  # a shortformer's W_pos, read by every block

    def _ready(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # a cast copies into a contiguous tensor anyway: one pass, not a transpose and then a cast
        return {n: converted(t.to(device=self.device), self.dtype, mapped_from=SCRATCH_MIN_BYTES) if t.dtype != self.dtype
                else t.to(device=self.device) if self.keep_layout else t.to(device=self.device).contiguous()
                for n, t in tensors.items()}

    def ends(self) -> dict[str, torch.Tensor]:
        tensors = self._ready(self.source.ends())
        if self.cfg.positional_embedding_type == "shortformer":
            self.positions = tensors["pos_embed.W_pos"]
        return tensors

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        if self.cfg.positional_embedding_type == "shortformer" and self.positions is None:
            self.positions = self._ready({"W_pos": self.source.ends()["pos_embed.W_pos"]})["W_pos"]
        tensors = self._ready(_renamed(self.source.block(layer), layer, 0))
        for name, shape in expected_shapes(self.block_cfg).items():
            if not name.startswith("blocks."):
                # mapped: a stand-in (a context's W_pos) freed into the C heap would raise its mapping threshold
                tensors[name] = new_tensor(shape, self.dtype, self.device, mapped_from=SCRATCH_MIN_BYTES).zero_()
        if self.positions is not None:
            tensors["pos_embed.W_pos"] = self.positions
        return tensors

    def run(self, layer: int | None, transform: Callable) -> tuple[dict[str, torch.Tensor], Config]:
        """``transform(state_dict, cfg)`` on the part (``None``: the ends), its output in the
        whole model's names (stand-ins dropped), on the part's device; errors name the real layer.
        The part's dict is made for the call and is the transform's own: it may empty it."""
        try:
            if layer is None:
                out, out_cfg = transform(self.ends(), self.ends_cfg)
                return out, out_cfg.replace(n_layers=self.cfg.n_layers)
            out, out_cfg = transform(self.block(layer), self.block_cfg)
            return _renamed({n: t for n, t in out.items() if n.startswith("blocks.0.")}, 0, layer), out_cfg
        except CircuitMathError as error:
            raise _in_part(error, self.path, layer) from None

    def names(self) -> list[int | None]:
        """The parts in the order they are processed: ``None`` (the ends), then each layer."""
        return [None, *range(self.cfg.n_layers)]
