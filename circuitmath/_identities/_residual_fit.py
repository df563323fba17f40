"""Recovering the rotation ``Q`` of the residual stream from two models: the free parameter of
``rotate_residual_stream`` and ``layer_norm_rotation`` (:mod:`.rotation` registers them with
:func:`recover_residual_rotation` and :func:`rotate_by_fit`).

``Q`` is fitted by orthogonal Procrustes on anchor tensors, the best of several fits
(:func:`best_rotation`), and snapped to ``Q 1 = ±1`` in an ``LNPre`` model where the fit maps 1
to ±1 to float64 rounding (:func:`fixing_ones_exactly`). :class:`ResidualFit` holds the fit and
what the diagnosis needs to estimate its uncertainty in half precision; :func:`undone` gives the
processed model with each fit undone, against which the diagnosis replays the other steps.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from .._compare import recognition_threshold
from .._config import Config
from .._processing.rotation import (
    procrustes,
    residual_readers,
    residual_writers,
    rotate_residual_stream,
    rotated_tensors,
    rotation_mismatches,
)
from .._registry import SharedRotation
from .._state import StateDict
from .norms import LAYER_NORM_TO_RMS_NORM

__all__ = ["ResidualFit", "anchor_sets", "anchors", "best_rotation", "fixes_ones", "fixing_ones_exactly",
           "recover_residual_rotation", "rotate_by_fit", "switch_first", "undone"]


def fixes_ones(Q: torch.Tensor) -> bool:
    """Whether ``Q 1 = 1`` or ``Q 1 = -1`` to float64 rounding (``layer_norm_rotation`` may apply)."""
    ones = torch.ones(Q.shape[0], dtype=Q.dtype, device=Q.device)
    image = Q @ ones
    return min(float((image - ones).abs().max()), float((image + ones).abs().max())) <= 1e-6


def fixing_ones_exactly(Q: torch.Tensor) -> torch.Tensor:
    """The orthogonal matrix nearest ``P Q P + s u u^T`` (``u = 1 / sqrt(d)``, ``P = I - u u^T``,
    ``s = ±1`` the sign of ``u^T Q u``): ``Q`` with ``Q 1 = s 1`` to rounding (``u`` is a
    singular vector of value 1)."""
    u = torch.full((Q.shape[0], 1), Q.shape[0] ** -0.5, dtype=Q.dtype, device=Q.device)
    P = torch.eye(Q.shape[0], dtype=Q.dtype, device=Q.device) - u @ u.T
    sign = 1.0 if float(u.T @ Q @ u) >= 0 else -1.0
    U, _S, Vh = torch.linalg.svd(P @ Q @ P + sign * (u @ u.T))
    return U @ Vh


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


def best_rotation(state: Mapping, after: Mapping, cfg: Config) -> tuple[torch.Tensor, list[str] | None]:
    """``(Q, names)``: the Procrustes ``Q`` and the tensors it is fitted on (``None``: every
    one). First from each of :func:`anchor_sets`, whichever leaves fewer tensors of ``after``
    unexplained: ``W_E`` is robust to a wrong rotation of other tensors, but leaves the image of
    a direction no writer has (1, once the writes are centered) free, which uncentered readers
    then fix. Between fits that leave as many unexplained (in half precision the mismatch
    tolerance, of the replay's float32, passes no fit at all), the one that reproduces more of
    the rotated tensors to the recognition threshold, then the one with the smaller median
    misfit: other steps (a centered ``W_E``, rotated heads, scales migrated into the readers)
    change some of them and leave the others as the rotation made them, while a fit bent by the
    changed tensors reproduces none.

    In half precision the fit is then refined on every rotated tensor it reproduces (writers and
    readers), unless that reproduces fewer: the anchors alone (``W_E``'s ``d_vocab`` rows) leave
    ``Q`` known to about ``1e-3``, and each reproduced tensor's rounding is independent of the
    others', so the fit on all of them is several times closer (the diagnosis's widening of the
    bounds shrinks with it)."""
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
    :func:`best_rotation`): a tensor is reproduced within the recognition threshold of its dtype."""
    misfits = _misfits(state, after, cfg, Q)
    reproduced = [n for n, m in misfits.items() if m <= recognition_threshold(after[n].dtype)]
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


@dataclass(frozen=True, eq=False)
class ResidualFit(SharedRotation):
    """A rotation of the residual stream recovered from two models: ``matrix``, the Procrustes
    ``Q`` (``[d_model, d_model]``, float64, on the CPU); ``names``, the tensors it is fitted on
    (``None``: every writer and reader); ``centered``: whether the model's norms are ``LNPre``,
    which rotates only by a ``Q`` with ``Q 1 = ±1``."""

    matrix: torch.Tensor
    names: list[str] | None
    centered: bool

    @cached_property
    def exact(self) -> torch.Tensor:
        """``Q`` as the rewrite takes it: in an ``LNPre`` model, where the fit maps 1 to ±1 to
        float64 rounding, :func:`fixing_ones_exactly` of it (the fit moves 1 by a little more than
        the rotation's own rounding allows)."""
        return fixing_ones_exactly(self.matrix) if self.centered and fixes_ones(self.matrix) else self.matrix

    def rewrite(self, state_dict: Mapping, cfg: Config) -> dict:
        return dict(state_dict) | rotated_tensors(state_dict, cfg, self.matrix)

    def refit(self, before: Mapping, after: Mapping, cfg: Config) -> "ResidualFit":
        return ResidualFit(procrustes(before, after, cfg, self.names), self.names, self.centered)

    def axes(self, cfg: Config) -> dict[str, int]:
        readers = set(residual_readers(cfg))
        return {n: -2 if n in readers else -1 for n in [*residual_writers(cfg), *readers]}


def recover_residual_rotation(before: StateDict, after: StateDict, cfg: Config) -> ResidualFit | None:
    """The rotation of the residual stream that maps ``before`` onto ``after`` best
    (:func:`best_rotation`), unverified: the diagnosis compares each tensor rewritten with it;
    ``None`` unless the models have the same tensors (:func:`_same_names`)."""
    if not _same_names(before, after):
        return None
    Q, names = best_rotation(before, after, cfg)
    return ResidualFit(Q, names, cfg.normalization_type == "LNPre")


def rotate_by_fit(state_dict: StateDict, cfg: Config, fit: ResidualFit) -> tuple[dict, Config]:
    """:func:`~circuitmath.rotate_residual_stream` by the recovered ``fit`` (its :attr:`ResidualFit.exact` ``Q``)."""
    return rotate_residual_stream(state_dict, cfg, fit.exact)


def _same_names(state: Mapping, after: Mapping) -> bool:
    """The same tensor names, but for norm parameters ``after`` may add: a later step (a scale
    migration into a folded norm, ``migrate_norm_scales``) gives a gain back to a norm a fold took
    it from, and the rotation before it is recovered all the same."""
    extra = set(after) - set(state)
    return set(state) <= set(after) and all(re.search(r"(^|\.)ln(1|2|_final)\.[wb]$", name) for name in extra)


def undone(start: Mapping, after: Mapping, cfg: Config, same: Callable[[str, torch.Tensor], bool],
           recognise: float) -> Iterator[dict] | None:
    """``after`` rotated back by ``Q^T``, ``Q`` fitted from ``start`` on each of :func:`anchor_sets`
    whose first writer (``W_E`` for every tensor) ``after`` changed (``same(name, tensor)``: whether
    ``tensor`` is ``after``'s ``name``) but whose row norms it kept, to ``recognise`` times the
    largest: a rotation keeps the norm of every row of a writer. Each computed as it is asked
    for; ``None`` where the names differ (:func:`_same_names`)."""
    if not _same_names(start, after):
        return None
    return (dict(after) | rotated_tensors(after, cfg, procrustes(start, after, cfg, names).T)
            for names in anchor_sets(cfg) if _norms_kept(start, after, (names or ["embed.W_E"])[0], same, recognise))


def _norms_kept(start: Mapping, after: Mapping, name: str, same, recognise: float) -> bool:
    """Whether ``after``'s writer ``name`` differs from ``start``'s but its rows have the same norms
    (to ``recognise`` times the largest): the cheap test before a rotation from ``start`` is looked for."""
    if same(name, start[name]):
        return False  # the writer itself unchanged: nothing rotated it
    ours, theirs = (sd[name].double().norm(dim=-1) for sd in (start, after))
    if ours.shape != theirs.shape or ours.device != theirs.device:
        return ours.shape == theirs.shape
    scale = max(float(ours.max()), float(theirs.max()), 1e-30)
    return float((ours - theirs).abs().max()) <= recognise * scale


def switch_first(state: StateDict, after: StateDict, cfg: Config):
    """``layer_norm_to_rms_norm`` where an ``LNPre`` model is rotated by a ``Q`` (fitted on every
    tensor) that moves 1: ``LNPre`` rotates only by a ``Q`` with ``Q 1 = ±1``, so after centered
    writes the model was switched to RMSNorm first; else ``None``."""
    if cfg.normalization_type == "LNPre" and not fixes_ones(procrustes(state, after, cfg)):
        return LAYER_NORM_TO_RMS_NORM
    return None
