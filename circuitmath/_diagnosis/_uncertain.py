"""The certificate of a tensor rewritten with a recovered rotation, in half precision: the bound
widened by the recovered parameter's own uncertainty.

A rotation ``Q`` (``[d, d]``) recovered by orthogonal Procrustes from tensors rounded to bfloat16
is known to about ``1e-3`` per entry, while the certificate asks each entry for one unit in the
last place. Rewritten with ``Q^ = Q + E``, a tensor ``x`` whose vectors along the rotated axis are
``x_i`` (``[d]``: the rows of a writer ``[..., d_model]``, the columns of a reader ``[..., d_model,
n]``, a head's ``d_head`` vectors for a per-head ``R``) is off by ``x_i E`` (the replay runs in
float32: its own rounding is within the certificate's floor), so by Cauchy-Schwarz, entry by entry,

    |after_ij - rewrite_ij| <= CERTIFICATE_ULPS ulp(rewrite_ij) + floor * scale + |x_i|_2 |E|_2 .

``|E|_2`` is estimated by re-fitting: the rewrite with ``Q^``, rounded to the model's dtype, is a
model processed exactly by ``Q^`` and rounded as ``after`` was; the same recovery from it gives
``Q'``, and ``Q' - Q^`` is a draw of the recovery's error from that rounding. :data:`SPREAD`
``|Q' - Q^|_2`` stands for ``|E|_2`` (the spectral norm of a random matrix varies little from draw
to draw; for one rotation per head, ``[..., d_head, d_head]``, the largest over the heads). Only in
half precision: in float32 the recovery is exact to the certificate's bound.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .._config import Config
from .._processing.rotation import residual_readers, residual_writers, rotated_tensors
from ._recover import best_rotation
from ._tensors import _MANTISSA_BITS, CERTIFICATE_ULPS, Thresholds

__all__ = ["SPREAD", "Widenings", "rounded", "spread", "widened_certificate", "widened_ratios"]

#: The re-fitted error's multiple taken for the recovered parameter's error.
SPREAD = 2.0

def spread(found: torch.Tensor, refit: torch.Tensor) -> float:
    """:data:`SPREAD` ``|refit - found|_2``, the largest over leading axes (``[..., d, d]``: one
    rotation per head)."""
    difference = (refit.double().cpu() - found.double().cpu()).reshape(-1, *found.shape[-2:])
    return SPREAD * float(torch.linalg.matrix_norm(difference, 2).max()) if difference.numel() else 0.0


def rounded(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state``'s tensors rounded to ``dtype`` (the model's: the replay runs in float32)."""
    return {name: tensor.to(dtype) for name, tensor in state.items()}


def widened_certificate(got: torch.Tensor, expected: torch.Tensor, scale: float, thresholds: Thresholds,
                        widening: list[tuple[int, float]]) -> float:
    """The largest of :func:`widened_ratios`: at most 1 when ``got`` is certified."""
    ratio = widened_ratios(got, expected, scale, thresholds, widening)
    return float(ratio.max()) if ratio.numel() else 0.0


def widened_ratios(got: torch.Tensor, expected: torch.Tensor, scale: float, thresholds: Thresholds,
                   widening: list[tuple[int, float]]) -> torch.Tensor:
    """``|got - expected|`` over the certificate's bound (``CERTIFICATE_ULPS ulp(e) + floor *
    scale``) plus, for each ``(axis, c)`` of ``widening``, ``c |expected_i|_2`` with
    ``expected_i`` the vector along ``axis`` through the entry; entry by entry (``got``'s
    shape), in float64."""
    x, e = got.double(), expected.double().to(got.device)
    _mantissa, exponent = torch.frexp(e)
    bits = _MANTISSA_BITS.get(thresholds.dtype, 52)
    unit = torch.where(e == 0, 0.0, torch.ldexp(torch.ones_like(e), exponent - 1 - bits))
    bound = CERTIFICATE_ULPS * unit + thresholds.floor * scale
    for axis, coefficient in widening:
        if e.ndim:
            bound = bound + coefficient * torch.linalg.vector_norm(e, dim=axis, keepdim=True)
    return (x - e).abs() / bound.clamp_min(torch.finfo(torch.float64).tiny)


class Widenings:
    """The tensors a replay in ``dtype`` rewrote with a recovered rotation, and how each one's
    bound widens: ``[(axis, coefficient)]``, one per recovered rotation that rewrote it (each
    rewrite of a tensor inherits the widening of the tensor it replaces). Nothing in float32."""

    def __init__(self, dtype: torch.dtype):
        self.half = dtype in (torch.bfloat16, torch.float16)
        self.dtype = dtype
        self._by_id: dict = {}  # id(tensor) -> (tensor, widening)

    def rotation(self, state: Mapping, after: Mapping, cfg: Config):
        """``(Q, widen)``: :func:`best_rotation` from ``state`` to ``after``, and what makes a
        rewrite with it widen the bound of each tensor it rotates (writers on their last axis,
        readers on their second to last) by ``spread(Q, Q')``, ``Q'`` re-fitted to the rewrite."""
        Q = best_rotation(state, after, cfg)
        if not self.half:
            return Q, _unchanged
        rewrite = rounded(dict(state) | rotated_tensors(state, cfg, Q), self.dtype)
        readers = set(residual_readers(cfg))
        axes = {n: -2 if n in readers else -1 for n in [*residual_writers(cfg), *readers]}
        return Q, self._widen(axes, spread(Q, best_rotation(state, rewrite, cfg)))

    def recovered(self, identity, state: Mapping, after: Mapping, cfg: Config):
        """``(parameter, widen)``: ``identity.recover(state, after, cfg)``, and, where it recovers
        rotations (square ``[..., d_head, d_head]`` matrices), what makes a rewrite with them widen
        the bound of each tensor it changes, on the ``d_head`` axis (``W_O``'s second to last)."""
        found = identity.recover(state, after, cfg)
        if not self.half or not isinstance(found, dict) or not all(
                v.ndim >= 2 and v.shape[-1] == v.shape[-2] for v in found.values()):
            return found, _unchanged
        try:
            rewrite = identity.with_parameters(state, cfg, found)[0]
            refit = identity.recover(state, rounded(rewrite, self.dtype), cfg)
        except Exception:  # noqa: BLE001 - as a wrong rewrite's: the parameter does not fit this model
            return found, _unchanged
        if refit is None or set(refit) != set(found):
            return found, _unchanged
        changed = [n for n in set(state) | set(rewrite) if state.get(n) is not rewrite.get(n)]
        axes = {n: -2 if n.endswith(".W_O") else -1 for n in changed}
        return found, self._widen(axes, max(spread(found[k], refit[k]) for k in found))

    def _widen(self, axes: Mapping[str, int], coefficient: float):
        """``widen(rewrite)``: ``rewrite`` recording, for each tensor of ``axes`` it replaces, the
        replaced tensor's widening and ``(axis, coefficient)``."""
        def widen(rewrite):
            def widened(state_dict, cfg):
                out, out_cfg = rewrite(state_dict, cfg)
                for name, axis in axes.items():
                    new, old = out.get(name), state_dict.get(name)
                    if new is not None and new is not old:
                        self._by_id[id(new)] = (new, [*self.of(old), (axis, coefficient)])
                return out, out_cfg
            return widened
        return widen

    def of(self, tensor) -> list[tuple[int, float]]:
        """The ``(axis, coefficient)`` by which ``tensor``'s certificate widens (``[]``: none)."""
        hit = self._by_id.get(id(tensor))
        return list(hit[1]) if hit is not None and hit[0] is tensor else []

    def of_names(self, state: Mapping, names) -> dict[str, list[tuple[int, float]]]:
        """:meth:`of` each tensor ``names`` of ``state``."""
        return {name: self.of(state.get(name)) for name in names}


def _unchanged(rewrite):
    return rewrite
