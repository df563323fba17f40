"""Recovering a symmetry's free parameter from two state dicts: the residual rotation ``Q``
(orthogonal Procrustes on anchor tensors, snapped to ``Q 1 = ±1`` where LayerNorm allows it) and
the permutation of one tensor's heads or neurons (matching slices)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .._config import Config
from .._processing.rotation import procrustes, residual_writers, rotated_tensors, rotation_mismatches
from ._tensors import _HEAD_AXIS, _location, Thresholds

__all__ = ["anchor_sets", "anchors", "best_rotation", "fixes_ones", "fixing_ones_exactly", "slice_permutation", "tensors_layer",
           "unit_axis"]


def fixes_ones(Q: torch.Tensor) -> bool:
    """Whether ``Q 1 = 1`` or ``Q 1 = -1`` to float64 rounding (``layer_norm_rotation`` may apply)."""
    ones = torch.ones(Q.shape[0], dtype=Q.dtype, device=Q.device)
    image = Q @ ones
    return min(float((image - ones).abs().max()), float((image + ones).abs().max())) <= 1e-6


def anchors(cfg: Config) -> list[str]:
    """The tensors a rotation is recovered from: ``W_E`` (``[d_vocab, d_model]``, which the usual
    processing before a rotation leaves as it is once the writes are centered; the other tensors
    then show a wrong rotation), or every writer's weight when ``d_vocab < d_model``."""
    if cfg.d_vocab >= cfg.d_model:
        return ["embed.W_E"]
    return [n for n in residual_writers(cfg) if not n.rsplit(".", 1)[-1].startswith("b_")]


def anchor_sets(cfg: Config) -> list:
    """The tensors a rotation is recovered from, each set tried: :func:`anchors`; every tensor
    (``None``); and, in a model with MLPs, the writers outside the heads and the embedding
    (``W_pos``, ``b_O``, ``W_out``, ``b_out``: ``W_out`` first), which a rotation inside the heads
    (``rotate_heads``) or a centered ``W_E`` leave as the rotation made them."""
    sets = [anchors(cfg), None]
    outside = [n for n in residual_writers(cfg) if n != "embed.W_E" and not n.endswith("attn.W_O")]
    if not cfg.attn_only and outside:  # none in the ends of a rotary model
        sets.append(sorted(outside, key=lambda n: not n.endswith("mlp.W_out")))
    return sets


def fixing_ones_exactly(Q: torch.Tensor) -> torch.Tensor:
    """The orthogonal matrix nearest ``P Q P + s u u^T`` (``u = 1 / sqrt(d)``, ``P = I - u u^T``,
    ``s = ±1`` the sign of ``u^T Q u``): ``Q`` with ``Q 1 = s 1`` to rounding (``u`` is a
    singular vector of value 1)."""
    u = torch.full((Q.shape[0], 1), Q.shape[0] ** -0.5, dtype=Q.dtype, device=Q.device)
    P = torch.eye(Q.shape[0], dtype=Q.dtype, device=Q.device) - u @ u.T
    sign = 1.0 if float(u.T @ Q @ u) >= 0 else -1.0
    U, _S, Vh = torch.linalg.svd(P @ Q @ P + sign * (u @ u.T))
    return U @ Vh


def best_rotation(state: Mapping, after: Mapping, cfg: Config) -> tuple[torch.Tensor, list[str] | None]:
    """``(Q, names)``: the Procrustes ``Q`` and the tensors it is fitted on (``None``: every
    one). First from each of :func:`anchor_sets`, whichever leaves fewer tensors of ``after``
    unexplained: ``W_E`` is robust to a wrong rotation of other tensors, but leaves the image of
    a direction no writer has (1, once the writes are centered) free, which uncentered readers
    then fix. Between fits that leave as many unexplained (in half precision the mismatch
    tolerance, of the replay's float32, passes no fit at all), the one that reproduces more of
    the rotated tensors to the replay's recognition threshold, then the one with the smaller
    median misfit: other steps (a centered ``W_E``, rotated heads, scales migrated into the
    readers) change some of them and leave the others as the rotation made them, while a fit bent
    by the changed tensors reproduces none.

    In half precision the fit is then refined on every rotated tensor it reproduces (writers and
    readers), unless that reproduces fewer: the anchors alone (``W_E``'s ``d_vocab`` rows) leave
    ``Q`` known to about ``1e-3``, and each reproduced tensor's rounding is independent of the
    others', so the fit on all of them is several times closer (the widening of
    :mod:`._uncertain` shrinks with it)."""
    fits = [(procrustes(state, after, cfg, names), names) for names in anchor_sets(cfg)]
    keys = [_fit_key(state, after, cfg, Q) for Q, _names in fits]
    best = min(range(len(fits)), key=lambda i: keys[i][:3])
    Q, names = fits[best]
    if after["embed.W_E"].dtype not in (torch.bfloat16, torch.float16):
        return Q, names
    reproduced = keys[best][3]
    if len(reproduced) > len(names or []) and reproduced != names:
        refined = procrustes(state, after, cfg, reproduced)
        if _fit_key(state, after, cfg, refined)[:2] <= keys[best][:2]:
            return refined, reproduced
    return Q, names


def _fit_key(state: Mapping, after: Mapping, cfg: Config, Q: torch.Tensor) -> tuple:
    """``(mismatches, tensors missed, median misfit, tensors reproduced)`` of the fit ``Q`` (see
    :func:`best_rotation`): a tensor is reproduced within the replay's recognition threshold."""
    misfits = _misfits(state, after, cfg, Q)
    reproduced = [n for n, m in misfits.items() if m <= Thresholds.of(after[n].dtype, cfg).recognise]
    median = float(torch.tensor(list(misfits.values())).median()) if misfits else 0.0
    return len(rotation_mismatches(state, after, cfg, Q)), len(misfits) - len(reproduced), median, reproduced


def _misfits(state: Mapping, after: Mapping, cfg: Config, Q: torch.Tensor) -> dict[str, float]:
    """``max |after - rotated| / max |after|`` of each tensor ``Q`` rotates."""
    misfits = {}
    for name, rotated in rotated_tensors(state, cfg, Q).items():
        theirs = after[name].double()
        scale = float(theirs.abs().max()) if theirs.numel() else 0.0
        misfits[name] = float((theirs - rotated.double()).abs().max()) / scale if scale > 0 else 0.0
    return misfits


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
