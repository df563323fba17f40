"""Recovering, from two state dicts, the permutation of one tensor's heads or neurons (matching
slices): heads or neurons moved by hand in some tensors, which no registered identity's
``recover`` explains (the symmetries' own recovery is their identity's, ``Identity.recover``)."""

from __future__ import annotations

import math

import torch

from .._config import Config
from ._tensors import _HEAD_AXIS, _location

__all__ = ["slice_permutation", "tensors_layer", "unit_axis"]


def unit_axis(name: str, cfg: Config) -> tuple[str, int] | None:
    """``("heads", axis)`` or ``("neurons", axis)``: the axis of ``name`` that indexes heads or
    MLP neurons (``None`` for other tensors)."""
    leaf = name.rsplit(".", 1)[-1]
    if ".attn." in name and leaf in _HEAD_AXIS:
        return "heads", _HEAD_AXIS[leaf]
    if ".mlp." in name and leaf in ("W_in", "W_gate", "b_in", "W_out"):
        return "neurons", 1 if leaf in ("W_in", "W_gate") else 0
    return None


def tensors_layer(name: str) -> int | None:
    return _location(name)[0]


def slice_permutation(ours: torch.Tensor, theirs: torch.Tensor, axis: int, threshold: float) -> tuple | None:
    """The permutation ``p`` (not the identity) with ``theirs`` = ``ours`` indexed by ``p`` along
    ``axis``, each slice within ``threshold`` of the tensors' largest entry, or ``None``."""
    a, b = (t.movedim(axis, 0).reshape(t.shape[axis], -1).double() for t in (ours, theirs))
    scale = max(float(a.abs().max()), float(b.abs().max())) if a.numel() else 0.0
    if a.shape[0] < 2 or scale == 0:
        return None
    # a permutation keeps the multiset of the slices' largest entries: a cheap test before all pairs
    if a.shape[1] and float((a.abs().amax(1).sort().values - b.abs().amax(1).sort().values).abs().max()) > \
            threshold * scale:
        return None
    distance = _max_distances(b, a, threshold * scale)
    perm = distance.argmin(dim=1)
    close = distance.gather(1, perm[:, None]).flatten() <= threshold * scale
    if not bool(close.all()) or len(set(perm.tolist())) != len(perm) or torch.equal(perm, torch.arange(len(perm), device=perm.device)):
        return None
    return tuple(perm.tolist())



def _max_distances(b: torch.Tensor, a: torch.Tensor, within: float) -> torch.Tensor:
    """``cdist(b, a, p=inf)`` (``[n, n]`` for slices ``[n, m]``, float64) where it is at most
    ``within``, and ``inf`` where it is more: each pair is first screened by its Euclidean distance
    (one matrix product), which is at least the largest entry's and at most ``sqrt(m)`` times it,
    so only pairs that may be within ``within`` are compared entry by entry. The same argmin and
    closeness as the full ``cdist``, at the cost of a product where slices are far apart."""
    n, m = a.shape
    if not m:
        return torch.zeros(n, n, dtype=a.dtype, device=a.device)
    a_norms, b_norms = a.square().sum(1), b.square().sum(1)
    squared = (b_norms[:, None] + a_norms[None, :]).sub_(b @ a.T, alpha=2)
    slack = 1e-12 * (b_norms[:, None] + a_norms[None, :])  # the rounding of the expansion, in float64
    maybe = squared <= m * within**2 * (1 + 1e-9) + slack
    distance = torch.full((n, n), math.inf, dtype=a.dtype, device=a.device)
    rows, columns = torch.nonzero(maybe, as_tuple=True)
    for start in range(0, rows.numel(), 1 << 12):
        i, j = rows[start:start + (1 << 12)], columns[start:start + (1 << 12)]
        distance[i, j] = (b[i] - a[j]).abs().amax(1)
    return distance
