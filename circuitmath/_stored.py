"""A processed model in its checkpoint's own names and layout: written there, and read back.

A Hugging Face folder that :func:`circuitmath.io.process_checkpoint` processes is written as a
folder of the same architecture where it can be: the same tensor names, shapes and dtype, each
processed weight written through the converter's own views of the stored tensors (the view
``W_Q`` of ``q_proj.weight`` is written, so the stored ``[out, in]`` matrix is), a folded norm
stored as the identity norm (gain 1, bias 0), ``config.json`` copied, and the circuitmath config
in the metadata with :data:`LAYOUT_KEY`. The converter that reads the input reads the output
(:func:`processed_layout` drops the identity norms, checked), so one mapping of names serves
both ways, and no tensor is transposed on the way out.

The processed model fits the layout when every tensor the converter makes up (a bias the
architecture lacks, read as zeros) is still what it makes up, and tensors stored once (a tied
embedding and unembedding) are still equal; :func:`place` checks both and raises
:class:`NotStored` otherwise (a GPT-2 whose folded final LayerNorm gives the unembedding a bias:
the caller writes circuitmath's layout instead).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from ._config import Config
from ._errors import StateDictError
from ._hf import Layout, _Source
from ._processing._memory import in_memory
from ._state import expected_shapes

__all__ = ["LAYOUT_KEY", "NotStored", "place", "processed_layout", "viewers"]

#: The metadata key saying that a folder's tensors are in the names and layout of its
#: ``config.json``'s architecture (value: ``"config.json"``), its circuitmath config under
#: :data:`~circuitmath._files.CONFIG_KEY` describing the processed model.
LAYOUT_KEY = "circuitmath.layout"


class NotStored(Exception):
    """A processed part that the checkpoint's layout cannot hold exactly (the message says which
    tensor and why)."""


def identity_value(name: str, offset: float = 0.0) -> float | None:
    """The value a norm parameter folded away by processing is stored as in its architecture's
    layout (1 for a gain, 0 for a bias: the norm without an affine map, ``LNPre`` or ``RMSPre``;
    a gain applied as ``offset + w``, ``Config.norm_gain_offset``, is stored as ``1 - offset``);
    ``None`` for a name that is not a norm's parameter.

    >>> identity_value("blocks.3.ln2.w"), identity_value("ln_final.b"), identity_value("blocks.3.attn.b_O")
    (1.0, 0.0, None)
    """
    match = re.fullmatch(r"(?:blocks\.\d+\.)?(?:ln1|ln2|ln_final|embed\.ln)\.([wb])", name)
    return None if match is None else 1.0 - offset if match[1] == "w" else 0.0


def processed_layout(layout: Layout, cfg: Config) -> Layout:
    """``layout`` (a converter's) reading a processed checkpoint of config ``cfg``: the tensors
    ``cfg`` has no place for (the folded norms) are dropped, once checked to be the identity
    norm's (on placeholders, which hold no values, only their names are checked)."""
    shapes = expected_shapes(cfg)

    def dropping(convert):
        def converted(src: _Source, *layer):
            out = {}
            for name, tensor in convert(src, *layer).items():
                value = identity_value(name, cfg.norm_gain_offset)
                if name in shapes:
                    out[name] = tensor
                elif value is None:
                    raise StateDictError(f"the converter gives {name!r}, which the circuitmath config in the metadata lacks")
                elif src.holds_values and not bool((tensor == value).all()):
                    raise StateDictError(
                        f"{name} (stored under the architecture's name) is not {value:g} everywhere, but the circuitmath"
                        " config in the metadata says its norm was folded")
            return out
        return converted

    return dataclasses.replace(layout, cfg=cfg, embed=dropping(layout.embed), block=dropping(layout.block),
                               final=dropping(layout.final))


def _part(layout: Layout, src: _Source, layer: int | None) -> dict[str, torch.Tensor]:
    return layout.embed(src) | layout.final(src) if layer is None else layout.block(src, layer)


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes a stored tensor's views start in: all of it when contiguous, else its first
    entry (a zero-stride placeholder)."""
    start = tensor.data_ptr()
    return start, start + (tensor.nbytes if tensor.is_contiguous() else tensor.element_size())


def _base(view: torch.Tensor, spans: dict[str, tuple[int, int]]) -> str | None:
    """The stored tensor ``view`` is a view of, by where its first entry lies; ``None`` for a
    tensor the converter made up."""
    if view.numel() == 0:
        return None
    where = view.data_ptr()
    return next((name for name, (start, stop) in spans.items() if start <= where < stop), None)


def _grouped(layout: Layout, stored: Mapping[str, torch.Tensor], layer: int | None):
    """Part ``layer`` converted from ``stored`` (tensors by their names in the checkpoint):
    the converter's tensors, the circuitmath names it takes as views of each stored tensor it
    takes (in ``stored``'s order), and the names it makes up (views of no stored tensor)."""
    src = layout.source(stored)
    unused = set(src.unused)
    views = _part(layout, src, layer)
    taken = {src.names[name] for name in unused - src.unused}
    spans = {name: _span(tensor) for name, tensor in stored.items() if name in taken}
    through: dict[str, list[str]] = {name: [] for name in stored if name in taken}
    made_up = []
    for name, view in views.items():
        base = _base(view, spans)
        if base is None:
            made_up.append(name)
        else:
            through[base].append(name)
    return views, through, made_up


def viewers(layout: Layout, stored: Mapping[str, torch.Tensor], layer: int | None) -> dict[str, list[str]]:
    """The stored tensors part ``layer`` is converted from (``stored``: a checkpoint's tensors by
    their names, placeholders will do, each the same tensor whenever it is looked up), in its
    order, each with the circuitmath names the converter takes as views of it."""
    return _grouped(layout, stored, layer)[1]


def _as_stored(view: torch.Tensor, buffer: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` (a processed tensor for ``view``, a view of all of the stored tensor ``buffer``)
    as the stored tensor itself, sharing its memory, when its entries lie in memory as ``view``'s
    do (a product the processing wrote in the checkpoint's layout); else ``None``."""
    if (tensor.dtype != buffer.dtype or tensor.device.type != "cpu" or tensor.shape != view.shape
            or tensor.stride() != view.stride() or view.data_ptr() != buffer.data_ptr() or view.numel() != buffer.numel()):
        return None
    stored = tensor.as_strided(buffer.shape, buffer.stride(), tensor.storage_offset())
    return stored if stored.is_contiguous() else None


def place(layout: Layout, layer: int | None, processed: Mapping[str, torch.Tensor],
          buffers: Mapping[str, torch.Tensor], kept: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The stored tensors of part ``layer`` (``None``: the ends) of a processed model,
    ``processed`` (its tensors in circuitmath names, on the CPU), by their names in the
    checkpoint. ``buffers`` holds a contiguous tensor of each stored tensor's shape and dtype
    (uninitialised; zero-stride placeholders may stand in for those named in ``kept``, whose
    bytes the caller copies from the checkpoint and which are not returned).

    A processed tensor whose entries already lie in memory as the stored tensor's do (written in
    the checkpoint's layout) is returned as it is, reshaped; any other is copied into its
    buffer through the converter's view, and a norm the processing folded away is written as the
    identity norm. Raises :class:`NotStored` when the part does not fit the layout: a tensor the
    converter makes up (zeros for a bias the architecture lacks) that the processing changed, a
    stored tensor that the converter uses in part (its views must cover it exactly once) or
    twice (tied tensors: each view must read back what was written through it), or a processed
    tensor the layout has no place for.
    """
    views, through, made_up = _grouped(layout, buffers, layer)
    extra = sorted(set(processed) - set(views))
    if extra:
        raise NotStored(f"the processed {extra[:3]} have no place in the checkpoint's layout")
    for name in made_up:
        wanted = processed.get(name)
        wanted = identity_value(name, layout.cfg.norm_gain_offset) if wanted is None else wanted
        if wanted is None or not bool((views[name] == wanted).all()):
            raise NotStored(f"the processed {name} is not the {'identity norm' if name not in processed else 'zeros'}"
                            " the architecture's converter reads where it stores no tensor")
    out = {}
    for stored, names in through.items():
        if stored in kept:
            continue
        buffer, sizes = buffers[stored], [views[name].numel() for name in names]
        tied = len(names) > 1 and all(size == buffer.numel() for size in sizes)
        if sum(sizes) != buffer.numel() and not tied:
            raise NotStored(f"{stored}: the converter takes {names} from it, which do not cover it once")
        if len(names) == 1 and names[0] in processed:
            out[stored] = _as_stored(views[names[0]], buffer, processed[names[0]])
            if out[stored] is not None:
                continue
        for name in names:
            value, view = processed.get(name), views[name]
            if value is None:
                view.fill_(identity_value(name, layout.cfg.norm_gain_offset))
            elif view.dim() >= 2 and view.data_ptr() == buffer.data_ptr() and view.numel() == buffer.numel() \
                    and view.mT.is_contiguous():  # the stored matrix transposed: written as whole transposes
                in_memory(value.mT, buffer.view(view.mT.shape))
            else:
                view.copy_(value)
        if tied and not all(torch.equal(views[name], processed[name]) for name in names if name in processed):
            raise NotStored(f"{stored} is stored once for {names}, which the processing made different")
        out[stored] = buffer
    return out
