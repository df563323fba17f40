"""The certificate of a tensor rewritten with a recovered parameter, in half precision: the bound
widened by the parameter's own uncertainty.

A rotation ``Q`` (``[d, d]``) recovered by orthogonal Procrustes from tensors rounded to bfloat16
is known to about ``1e-3`` per entry, while the certificate asks each entry for one unit in the
last place. Rewritten with ``Q^ = Q + E``, a tensor ``x`` whose vectors along the rotated axis are
``x_i`` (``[d]``: the rows of a writer ``[..., d_model]``, the columns of a reader ``[..., d_model,
n]``, a head's ``d_head`` vectors for a per-head ``R``) is off by ``x_i E`` (the replay runs in
float32: its own rounding is within the certificate's floor), so by Cauchy-Schwarz, entry by entry,

    |after_ij - rewrite_ij| <= CERTIFICATE_ULPS ulp(rewrite_ij) + floor * scale + |x_i|_2 |E e_j|_2 ,

``E e_j`` the column of ``E`` the entry's index ``j`` along the rotated axis picks (at most
``|E|_2``; for a random error about half of it).

A scale ``s`` recovered from gain ratios and reader rows (``migrate_norm_scales``, ``[d_model]``
per norm; ``scale_neurons``, ``[n_layers, d_mlp]``) is known to a relative ``|s^ / s - 1| <=
delta`` per channel; a tensor it multiplies, channel by channel, is off by at most ``delta``
times each entry: the bound widens by ``delta |rewrite_ij|``.

The uncertainty is estimated by re-fitting: the rewrite with the recovered parameter ``p^``,
rounded to the model's dtype, is a model processed exactly by ``p^`` and rounded as ``after`` was;
the same recovery from it gives ``p'``, and ``p' - p^`` is a draw of the recovery's error from
that rounding. For the residual stream's ``Q``, :data:`SPREAD` times each column's norm of ``Q' -
Q^`` stands for ``|E e_j|_2`` (a column's norm, a sum of ``d`` squares, varies little from draw
to draw). For one rotation per head, ``[..., d_head, d_head]``, recovered after other parameters
and so carrying their errors, which its re-fit does not draw, :data:`SPREAD` ``|R' - R^|_2``
stands for every column's (the largest over the heads). :data:`SPREAD` ``max |s' / s^ - 1|`` stands
for ``delta`` (over every channel).

Each widening is a :class:`Term`: an error operator ``E`` acting along one axis of the tensor
(``|E|_2`` at most its coefficient), or an entrywise relative error. Later rewrites carry it
along: a rotation or a scaling along another axis commutes with ``E``; a rotation ``M`` along the
same axis turns ``E`` into ``M E M^T``, of the same norm (an entrywise error becomes an operator
of its norm along that axis); a scaling ``diag(v)`` along the same axis turns it into ``diag(v) E
diag(v)^-1``, which the term's ``weights`` record. Only in half precision: in float32 the
recovery is exact to the certificate's bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .._config import Config
from .._registry import SharedRotation
from ._tensors import _MANTISSA_BITS, CERTIFICATE_ULPS, Thresholds

__all__ = ["SPREAD", "Term", "Widenings", "column_spreads", "rounded", "spread", "relative_spread",
           "widened_certificate", "widened_ratios"]

#: The re-fitted error's multiple taken for the recovered parameter's error.
SPREAD = 2.0


def spread(found: torch.Tensor, refit: torch.Tensor) -> float:
    """:data:`SPREAD` ``|refit - found|_2``, the largest over leading axes (``[..., d, d]``: one
    rotation per head)."""
    difference = (refit.double().cpu() - found.double().cpu()).reshape(-1, *found.shape[-2:])
    return SPREAD * float(torch.linalg.matrix_norm(difference, 2).max()) if difference.numel() else 0.0


def column_spreads(found: torch.Tensor, refit: torch.Tensor) -> torch.Tensor:
    """:data:`SPREAD` times the norm of each column of ``refit - found`` (``[d]``, float64), the
    largest over leading axes (``[..., d, d]``: one rotation per head)."""
    difference = (refit.double().cpu() - found.double().cpu()).reshape(-1, *found.shape[-2:])
    return SPREAD * torch.linalg.vector_norm(difference, dim=-2).amax(0)


def relative_spread(found: torch.Tensor, refit: torch.Tensor) -> float:
    """:data:`SPREAD` ``max |refit / found - 1|`` over every entry (per-channel scales, any shape)."""
    found, refit = found.double().cpu(), refit.double().cpu()
    return SPREAD * float(((refit - found).abs() / found.abs()).max()) if found.numel() else 0.0


def rounded(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state``'s tensors rounded to ``dtype`` (the model's: the replay runs in float32)."""
    return {name: tensor.to(dtype) for name, tensor in state.items()}


@dataclass(frozen=True, eq=False)
class Term:
    """One recovered parameter's share of a tensor's bound. ``axis`` ``None``: an entrywise
    relative error, ``coefficient |e_ij|``. Otherwise an error operator ``diag(w) E^T diag(w)^-1``
    along ``axis``, ``E`` with columns of norm at most ``columns`` (``[n]``, ``n`` the axis's
    length) and ``|E|_2`` at most ``coefficient``, ``w = weights`` (``[n]``; ``None``: ones): by
    Cauchy-Schwarz on row ``i`` of the operator, ``columns_i w_i |e / w|_2``, the norm over the
    axis's vector through the entry. Without ``columns``: ``coefficient w_i |e / w|_2``."""

    axis: int | None
    coefficient: float
    columns: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def bound(self, e: torch.Tensor) -> torch.Tensor:
        """The widening of each entry of ``e`` (float64, the rewrite), broadcastable to its shape."""
        if self.axis is None:
            return self.coefficient * e.abs()
        w = self._along(self.weights, e)
        norm = torch.linalg.vector_norm(e if w is None else e / w, dim=self.axis, keepdim=True)
        norm = norm * (self.coefficient if self.columns is None else self._along(self.columns, e))
        return norm if w is None else norm * w

    def _along(self, vector: torch.Tensor | None, e: torch.Tensor) -> torch.Tensor | None:
        if vector is None:
            return None
        shape = [1] * e.ndim
        shape[self.axis] = -1
        return vector.to(device=e.device, dtype=torch.float64).abs().reshape(shape)

    def rotated(self, axis: int) -> "Term":
        """The term after a rotation ``M`` along ``axis``: ``M`` times the error has the error's
        norm, at most ``|E|_2`` (times ``max w / min w``) times the vector's."""
        if self.axis is None:
            return Term(axis, self.coefficient)
        if self.axis != axis or self.weights is None and self.columns is None:
            return self if self.axis != axis else Term(axis, self.coefficient)
        w = torch.ones(1, dtype=torch.float64) if self.weights is None else self.weights.double().abs()
        return Term(axis, self.coefficient * float(w.max() / w.min()))

    def scaled(self, scaling: tuple[int, torch.Tensor] | None) -> "Term":
        """The term after a scaling ``(axis, v)``: ``diag(v)`` (``v`` ``[n]``) along ``axis``
        (``None``: a change not known to be one, after which the operator's norm is all that is left)."""
        if self.axis is None:
            return self
        if scaling is None:
            return self.rotated(self.axis)
        axis, v = scaling
        if axis != self.axis:  # it commutes with the term's operator
            return self
        w = v.double().cpu() if self.weights is None else self.weights.double().cpu() * v.double().cpu()
        return Term(axis, self.coefficient, self.columns, w)


def widened_certificate(got: torch.Tensor, expected: torch.Tensor, scale: float, thresholds: Thresholds,
                        widening: list[Term]) -> float:
    """The largest of :func:`widened_ratios`: at most 1 when ``got`` is certified."""
    ratio = widened_ratios(got, expected, scale, thresholds, widening)
    return float(ratio.max()) if ratio.numel() else 0.0


def widened_ratios(got: torch.Tensor, expected: torch.Tensor, scale: float, thresholds: Thresholds,
                   widening: list[Term]) -> torch.Tensor:
    """``|got - expected|`` over the certificate's bound (``CERTIFICATE_ULPS ulp(e) + floor *
    scale``) plus each :class:`Term`'s bound of ``widening``; entry by entry (``got``'s shape),
    in float64."""
    x, e = got.double(), expected.double().to(got.device)
    _mantissa, exponent = torch.frexp(e)
    bits = _MANTISSA_BITS[thresholds.dtype]
    unit = torch.where(e == 0, 0.0, torch.ldexp(torch.ones_like(e), exponent - 1 - bits))
    bound = CERTIFICATE_ULPS * unit + thresholds.floor * scale
    for term in widening:
        if e.ndim or term.axis is None:
            bound = bound + term.bound(e)
    return (x - e).abs() / bound.clamp_min(torch.finfo(torch.float64).tiny)


class Widenings:
    """The tensors a replay in ``dtype`` rewrote with a recovered parameter, and how each one's
    bound widens: its :class:`Term` list, one per recovered parameter that rewrote it (each
    rewrite of a tensor carries the terms of the tensor it replaces along). Nothing in float32."""

    def __init__(self, dtype: torch.dtype):
        self.half = dtype in (torch.bfloat16, torch.float16)
        self.dtype = dtype
        self._by_id: dict = {}  # id(tensor) -> (tensor, terms)

    def recovered(self, identity, state: Mapping, after: Mapping, cfg: Config, widened: Config | None = None):
        """``(parameter, widen)``: ``identity.recover(state, after, cfg)``, and what makes a rewrite
        with it widen the bound of each tensor it changes: where it recovers a rotation of a space
        many tensors share (a :class:`~circuitmath._registry.SharedRotation`, the residual
        stream's ``Q``), see :meth:`_shared`; where it recovers rotations (square
        ``[..., d_head, d_head]`` matrices), on the ``d_head`` axis (``W_O``'s second to last) by
        their :func:`spread` (not by columns: fitted after other recovered parameters, a rotation
        inside the heads carries their errors too, which a re-fit from its own rounding does not
        draw, and the spectral norm's slack covers); where it recovers scales (floating, not square), entrywise by their
        :func:`relative_spread`. A permutation is exact: no widening."""
        found = identity.recover(state, after, cfg)
        if isinstance(found, SharedRotation):
            return found, self._shared(found, state, cfg, cfg if widened is None else widened)
        values = list(found.values()) if isinstance(found, dict) else [found]
        if not self.half or found is None or not all(
                isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() for v in values):
            return found, _unchanged
        square = all(v.ndim >= 2 and v.shape[-1] == v.shape[-2] for v in values)
        try:
            rewrite = identity.with_parameters(state, cfg, found)[0]
            refit = identity.recover(state, rounded(rewrite, self.dtype), cfg)
        except Exception:  # noqa: BLE001 - as a wrong rewrite's: the parameter does not fit this model
            return found, _unchanged
        if refit is None or isinstance(found, dict) and (not isinstance(refit, dict) or set(refit) != set(found)):
            return found, _unchanged
        pairs = [(found[k], refit[k]) for k in found] if isinstance(found, dict) else [(found, refit)]
        changed = [n for n in set(state) | set(rewrite) if state.get(n) is not rewrite.get(n)]
        if square:
            axes = {n: -2 if n.endswith(".W_O") else -1 for n in changed}
            return found, self._widen(axes, max(spread(f, r) for f, r in pairs))
        return found, self._widen(dict.fromkeys(changed), max(relative_spread(f, r) for f, r in pairs))

    def _shared(self, found: SharedRotation, state: Mapping, cfg: Config, widened: Config):
        """What makes a rewrite with ``found`` widen the bound of each tensor it rotates (its
        ``axes`` in a model of config ``widened``: a part of a model fits ``Q`` for every part) by
        the :func:`column_spreads` of ``Q`` and ``Q'`` (and their :func:`spread`), ``Q'`` re-fitted
        to ``found``'s rewrite of ``state`` rounded, on the tensors ``Q`` was fitted on."""
        if not self.half:
            return _unchanged
        refit = found.refit(state, rounded(found.rewrite(state, cfg), self.dtype), cfg).matrix
        return self._widen(found.axes(widened), spread(found.matrix, refit), column_spreads(found.matrix, refit))

    def _widen(self, axes: Mapping[str, int | None], coefficient: float, columns: torch.Tensor | None = None):
        """``widen(rewrite)``: ``rewrite`` recording, for each tensor of ``axes`` it replaces, the
        replaced tensor's terms carried along and ``Term(axis, coefficient, columns)``: rotated along
        ``axis``, or (``None``) scaled channel by channel along axes :func:`_scaling` finds."""
        def widen(rewrite):
            def widened(state_dict, cfg):
                out, out_cfg = rewrite(state_dict, cfg)
                for name, axis in axes.items():
                    new, old = out.get(name), state_dict.get(name)
                    if new is not None and new is not old:
                        terms = self.of(old)
                        if axis is None and terms:
                            scaling = _scaling(old, new)
                            terms = [t.scaled(scaling) for t in terms]
                        elif axis is not None:
                            terms = [t.rotated(axis) for t in terms]
                        self._by_id[id(new)] = (new, [*terms, Term(axis, coefficient, None if axis is None else columns)])
                return out, out_cfg
            return widened
        return widen

    def forget(self) -> None:
        """Drops every tensor recorded (a streamed replay's part, once compared)."""
        self._by_id.clear()

    def of(self, tensor) -> list[Term]:
        """The :class:`Term` list by which ``tensor``'s certificate widens (``[]``: none)."""
        hit = self._by_id.get(id(tensor))
        return list(hit[1]) if hit is not None and hit[0] is tensor else []

    def of_names(self, state: Mapping, names) -> dict[str, list[Term]]:
        """:meth:`of` each tensor ``names`` of ``state``."""
        return {name: self.of(state.get(name)) for name in names}


def _scaling(old: torch.Tensor | None, new: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """``(axis, v)`` (``axis`` negative, ``v`` ``[n]`` float64) with ``new = diag(v) old`` along
    ``axis`` to the rounding of ``new``'s dtype (each slice along the other axes ``v_i`` times the
    old one: the least-squares ratio, checked on every entry), the last axis first; ``None`` when
    ``new`` is no such scaling of ``old``."""
    if old is None or old.shape != new.shape or not new.ndim:
        return None
    for axis in range(-1, -new.ndim - 1, -1):
        a, b = old.double().movedim(axis, 0), new.double().to(old.device).movedim(axis, 0)
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        den = (a * a).sum(1)
        v = torch.where(den > 0, (a * b).sum(1) / den.clamp_min(torch.finfo(torch.float64).tiny), 1.0)
        scale = float(b.abs().max()) if b.numel() else 0.0
        if float((b - v[:, None] * a).abs().max()) <= 4 * torch.finfo(new.dtype).eps * scale:
            return axis, v.cpu()
    return None


def _unchanged(rewrite):
    return rewrite
