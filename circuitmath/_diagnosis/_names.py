"""The names a check speaks: each tensor of a converted input by the input's own name.

:class:`InputNames` is built once, when an input in an architecture's naming is resolved, from the
converter's views of its tensors, and travels with it (``Model.names``); every check turns its
diagnosis into the names of the input whose tensors it names (:func:`speak`). circuitmath's
names stay where the input used them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from .._hf import Layout
from .._stored import grouped
from ._tensors import SHOWN_RANGES

__all__ = ["InputNames", "checkpoint_names", "speak"]


class InputNames:
    """Each tensor of a converted model by the name and the entries it has in the input: the
    converter's view ``blocks.1.mlp.W_in`` of the stored ``model.layers.1.mlp.up_proj.weight``,
    and where a view lies in its stored tensor (``transformer.h.0.attn.c_attn.weight[:, 8:16]``
    for head 1 of ``W_Q``). Built once from the converter's views of the input's tensors: no
    tensor is copied or read."""

    def __init__(self, views: dict[str, tuple]):
        self.views = views  # circuitmath name -> (stored name, stored shape, view shape, view strides, offset)

    @classmethod
    def of(cls, layout: Layout, stored: Mapping[str, torch.Tensor]) -> "InputNames":
        """The names ``layout`` (a converter) takes from ``stored`` (the input's tensors by their names)."""
        views = {}
        for part in [None, *range(layout.cfg.n_layers)]:
            converted, through, _made_up = grouped(layout, stored, part)
            for name, taken in through.items():
                base = stored[name]
                for view_name in taken:
                    view = converted[view_name]
                    if base.is_contiguous() and view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
                        views[view_name] = (name, tuple(base.shape), tuple(view.shape), view.stride(),
                                            view.storage_offset() - base.storage_offset())
                    else:
                        views[view_name] = (name, None, None, None, None)
        return cls(views)

    def name(self, name: str, heads: tuple[int, ...] = ()) -> str:
        """``name`` (a circuitmath name) as the input names it, with the entries it (or its ``heads``,
        along the head axis ``0``) takes of the stored tensor: ``q_proj.weight[8:16, :]``."""
        found = self.views.get(name)
        if found is None:
            return name
        stored, shape, view_shape, strides, offset = found
        if shape is None:
            return stored
        whole = [(0, size - 1) for size in view_shape]
        boxes = [[(h, h), *whole[1:]] for h in heads] or [whole]
        slices = []
        for box in boxes:
            described = _slice(shape, strides, offset, box)
            if described is None and view_shape:  # strided across the stored tensor: one piece per index of axis 0
                pieces = [_slice(shape, strides, offset, [(i, i), *box[1:]]) or "" for i in range(box[0][0], box[0][1] + 1)]
                described = ", ".join(pieces if len(pieces) <= 4 else [*pieces[:2], f"... ({len(pieces)} pieces)"])
            slices.append(described or "")
        return stored + ", ".join(dict.fromkeys(s for s in slices if s))

    def index(self, name: str, at: tuple[int, ...]) -> str:
        """The entry ``at`` of ``name`` (a circuitmath name) as the input indexes its stored tensor:
        ``"[5, 3]"`` (empty when the view is not known)."""
        found = self.views.get(name)
        if found is None or found[1] is None or len(at) != len(found[2]):
            return ""
        _stored, shape, _view_shape, strides, offset = found
        return _slice(shape, strides, offset, [(i, i) for i in at]) or ""

    def rows(self, parameter) -> str:
        """A :class:`~._tensors.ParameterMismatch`'s differing rows as the entries of the input's
        tensor they are (the first ranges shown): ``"[:, 4:8]"``; empty when the view is not a box
        of it."""
        found = self.views.get(parameter.name)
        if not parameter.rows or found is None or found[1] is None:
            return ""
        _stored, shape, view_shape, strides, offset = found
        whole = [(0, size - 1) for size in view_shape]
        pieces = []
        for first, last in parameter.rows[:SHOWN_RANGES]:
            box = list(whole)
            box[parameter.row_axis] = (first, last)
            piece = _slice(shape, strides, offset, box)
            if not piece:
                return ""
            pieces.append(piece)
        more = len(parameter.rows) - SHOWN_RANGES
        return ", ".join(pieces) + (f", … ({more} more ranges)" if more > 0 else "")

    def text(self, text: str | None) -> str | None:
        """``text`` with every circuitmath name the input does not use replaced by the input's."""
        if not text:
            return text
        pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(self.views, key=len, reverse=True)))
                             + r")(?![\w.])")
        return pattern.sub(lambda match: self.name(match[1]), text)


def _slice(shape: tuple[int, ...], strides, offset: int, box) -> str:
    """The entries of a stored tensor of ``shape`` (contiguous) that the box ``box`` (first and
    last index per axis) of a view (``strides``, ``offset``) covers, as ``[a:b, :]`` (empty when
    the whole tensor; ``None`` when the box's entries are strided across the stored tensor, not a
    box of it): from the box's corners, exact for views that permute, split and narrow axes."""
    low, high = [None] * len(shape), [None] * len(shape)
    for corner in range(2 ** len(box)):
        flat = offset + sum(box[k][(corner >> k) & 1] * strides[k] for k in range(len(box)))
        for axis in reversed(range(len(shape))):
            flat, index = divmod(flat, shape[axis])
            low[axis] = index if low[axis] is None else min(low[axis], index)
            high[axis] = index if high[axis] is None else max(high[axis], index)
    if math.prod(b - a + 1 for a, b in zip(low, high)) != math.prod(b - a + 1 for a, b in box):
        return None  # the box's entries do not fill the stored box: strided
    parts = [":" if (a, b) == (0, n - 1) else str(a) if a == b else f"{a}:{b + 1}" for a, b, n in zip(low, high, shape)]
    return "" if all(p == ":" for p in parts) else f"[{', '.join(parts)}]"


def checkpoint_names(source, config=None) -> "InputNames | None":
    """The names of a checkpoint (a folder or a file, or an opened one) in its architecture's
    layout; ``None`` for one in circuitmath's names. Only headers are read."""
    from .._checkpoint import Checkpoint, open_checkpoint

    checkpoint = source if isinstance(source, Checkpoint) else open_checkpoint(source, config)
    return None if checkpoint.native is None else InputNames.of(checkpoint.native, dict(checkpoint.tensors))


def speak(report, names: "InputNames | None"):
    """``report`` (a :class:`~._report.Diagnosis` or the rows of a checkpoint check) in the input's names."""
    from ._report import Diagnosis, in_input_names

    if names is None:
        return report
    if isinstance(report, Diagnosis):
        return in_input_names(report, names)
    if hasattr(report, "rows"):
        report.rows = [dict(row, explanation=names.text(row.get("explanation"))) for row in report.rows]
    return report
