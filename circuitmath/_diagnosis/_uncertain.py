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

from ._tensors import _MANTISSA_BITS, CERTIFICATE_ULPS, _Thresholds

__all__ = ["SPREAD", "Allowance", "record", "rounded", "spread", "widened_certificate", "widened_ratios"]

#: The re-fitted error's multiple taken for the recovered parameter's error.
SPREAD = 2.0

#: ``name -> [(axis, coefficient)]``: each recovered rotation that rewrote the tensor, the axis
#: it rotated and ``SPREAD |Q' - Q^|_2`` (see the module's docstring).
Allowance = dict[str, list[tuple[int, float]]]


def spread(found: torch.Tensor, refit: torch.Tensor) -> float:
    """:data:`SPREAD` ``|refit - found|_2``, the largest over leading axes (``[..., d, d]``: one
    rotation per head)."""
    difference = (refit.double().cpu() - found.double().cpu()).reshape(-1, *found.shape[-2:])
    return SPREAD * float(torch.linalg.matrix_norm(difference, 2).max()) if difference.numel() else 0.0


def rounded(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state``'s tensors rounded to ``dtype`` (the model's: the replay runs in float32)."""
    return {name: tensor.to(dtype) for name, tensor in state.items()}


def widened_certificate(got: torch.Tensor, expected: torch.Tensor, scale: float, thresholds: _Thresholds,
                        widening: list[tuple[int, float]]) -> float:
    """The largest of :func:`widened_ratios`: at most 1 when ``got`` is certified."""
    ratio = widened_ratios(got, expected, scale, thresholds, widening)
    return float(ratio.max()) if ratio.numel() else 0.0


def widened_ratios(got: torch.Tensor, expected: torch.Tensor, scale: float, thresholds: _Thresholds,
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


def record(allowance: Allowance, touched: Mapping[str, int], coefficient: float) -> None:
    """Add ``coefficient`` on each touched tensor's rotated axis (``name -> axis``)."""
    for name, axis in touched.items():
        entries = allowance.setdefault(name, [])
        if (axis, coefficient) not in entries:
            entries.append((axis, coefficient))
