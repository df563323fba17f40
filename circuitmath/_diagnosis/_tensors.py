"""Comparing the processed model's tensors with a rewrite's: thresholds, differences, and where.

A :class:`ParameterMismatch` names a tensor (layer, heads) and how far it is from what it
should be; :class:`Thresholds` says when two tensors count as the same rewrite.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .._compare import compute_dtype, recognition_threshold
from .._config import Config

__all__ = ["ParameterMismatch"]

_HEAD_AXIS = {"W_Q": 0, "W_K": 0, "W_V": 0, "_W_K": 0, "_W_V": 0, "W_O": 0, "b_Q": 0, "b_K": 0, "b_V": 0,
              "_b_K": 0, "_b_V": 0, "pos_Q": 1, "pos_K": 1}


@dataclass(frozen=True)
class ParameterMismatch:
    """Where one tensor of the processed model differs from what it should be, and by how much.

    ``layer`` is the block index (``None`` outside the blocks), ``heads`` the attention heads
    whose slice differs (per-head tensors only), ``max_abs_error`` the largest absolute difference
    and ``relative_error`` that over the largest entry of the tensors compared. ``problem`` is set
    when the tensor is missing, unexpected or of another shape; ``written_by`` names the identity
    whose rewrite last produced the expected tensor (``None``: no identity rewrites it).
    """

    name: str
    layer: int | None
    heads: tuple[int, ...]
    max_abs_error: float
    relative_error: float
    problem: str | None = None
    written_by: str | None = None
    #: The index of the largest difference (the first, in order; ``()`` when none was measured).
    at: tuple[int, ...] = ()
    #: The rows that differ beyond rounding (indices along ``row_axis``), as ``(first, last)`` ranges.
    rows: tuple[tuple[int, int], ...] = ()
    #: The axis ``rows`` index (axis 1 of a per-head tensor, whose axis 0 is the head), its length,
    #: and what its indices are called (``"entries"`` of a vector).
    row_axis: int = 0
    row_count: int = 0
    row_word: str = "rows"

    def __str__(self) -> str:
        where = [f"layer {self.layer}"] if self.layer is not None else []
        if self.heads:
            where.append(("head " if len(self.heads) == 1 else "heads ") + ", ".join(map(str, self.heads)))
        place = f"{self.name} ({', '.join(where)})" if where else self.name
        if self.problem:
            return f"{place}: {self.problem}"
        at = f", the largest at {self._at()}" if self.at else ""
        rows = f"; {self._rows()} differ" if self.rows else ""
        return f"{place}: max |Δ| {self.max_abs_error:.3g} ({self.relative_error:.2g} of its largest entry{at}){rows}"

    def _at(self) -> str:
        return f"[{', '.join(map(str, self.at))}]"

    def _rows(self) -> str:
        """``rows 12–15, 40 (5 of 3072)`` (``entries`` of a vector): the first :data:`SHOWN_RANGES` ranges."""
        shown = [str(a) if a == b else f"{a}–{b}" for a, b in self.rows[:SHOWN_RANGES]]
        if len(self.rows) > SHOWN_RANGES:
            shown.append(f"… ({len(self.rows) - SHOWN_RANGES} more ranges)")
        differing = sum(b - a + 1 for a, b in self.rows)
        return f"{self.row_word} {', '.join(shown)} ({differing} of {self.row_count})"

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "layer": self.layer,
            "heads": list(self.heads),
            "max_abs_error": _json_number(self.max_abs_error),
            "relative_error": _json_number(self.relative_error),
            "problem": self.problem,
            "written_by": self.written_by,
            "at": list(self.at),
            "rows": [list(r) for r in self.rows],
            "row_axis": self.row_axis,
            "row_count": self.row_count,
        }


def _json_number(value: float | None):
    return None if value is None or not math.isfinite(value) else value


#: Ranges of rows a diagnosis shows (all of them are in :meth:`ParameterMismatch.as_dict`).
SHOWN_RANGES = 6


#: Bits of the significand stored by each dtype (the unit in the last place of ``x`` is
#: ``2**(floor(log2|x|) - bits)``).
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}

#: The certificate's bound, in units in the last place of the model's dtype (see :class:`Thresholds`).
CERTIFICATE_ULPS = 1


@dataclass(frozen=True)
class Thresholds:
    """When two tensors count as the same.

    ``recognise``: the same rewrite (used to tell which rewrite was applied; wrong rewrites miss
    it by orders of magnitude, while rewrites computed another way, in float32 or with another
    summation order, stay well inside). ``exact``: equal up to rounding in the model's dtype, as a
    fraction of a tensor's largest entry (a coarse summary, used to say which heads differ).

    The **certificate** decides whether a processed tensor is the exact rewrite, entry by entry
    (:func:`certificate`): each entry of the processed tensor must lie within
    :data:`CERTIFICATE_ULPS` units in the last place of ``dtype`` of the rewrite computed in
    :func:`~circuitmath.testing.compute_dtype` of ``dtype`` (float32 for half precision), plus ``floor`` times the tensor's
    largest entry: the error of computing the rewrite in the compute dtype (its entries made by
    cancellation, a centered weight's, carry the rounding of the terms, not of the result). A
    processing rounded once to bfloat16 is within half a unit; a 1 % change of a bfloat16 tensor
    moves its entries by 1.3 to 2.6 units, so some entry of any tensor of more than a few entries
    leaves the bound.
    """

    recognise: float
    exact: float
    float32_rounding: float
    dtype: torch.dtype = torch.float64
    floor: float = 0.0

    @classmethod
    def of(cls, dtype: torch.dtype, cfg: Config) -> "Thresholds":
        root_k = math.sqrt(max(cfg.d_model, cfg.d_mlp or 0, cfg.d_vocab))
        recognise = recognition_threshold(dtype)
        return cls(
            recognise=recognise,
            exact=min(recognise, 8 * torch.finfo(dtype).eps * root_k),
            float32_rounding=8 * torch.finfo(torch.float32).eps * root_k,
            dtype=dtype,
            floor=8 * torch.finfo(compute_dtype(dtype)).eps * root_k,
        )


def certificate(got: torch.Tensor, expected: torch.Tensor, scale: float, thresholds: Thresholds,
                 chunk: int = 1 << 20) -> float:
    """The largest ``|got - expected|`` over its bound (see :class:`Thresholds`): at most 1 when
    ``got`` is certified as ``expected`` rounded to ``thresholds.dtype``. ``scale``: the largest
    |entry| of the tensors compared. ``chunk`` entries at a time, each chunk's largest ratio
    that of :func:`_ratios_float64` (NaN, from non-finite entries, counts as no ratio).

    Where both tensors are in float32 or half precision, on the CPU, a chunk is first screened in
    float32 (:func:`_screen`) and only the entries within a relative ``2**-14`` of its largest
    screened ratio are computed in float64: the same number, to the last bit, at a fraction of
    the cost. On another device the screen's synchronisations would cost more than it saves."""
    bits = _MANTISSA_BITS[thresholds.dtype]
    floor = thresholds.floor * scale
    screened = (got.dtype in _SCREENED and expected.dtype in _SCREENED and _SCREEN_FLOOR <= floor <= 2.0**100
                and got.device.type == "cpu")
    if got.device.type != "cpu":  # few large chunks, unscreened: each chunk costs a synchronisation there
        chunk = max(chunk, 1 << 24)
    worst = 0.0
    a, b = got.reshape(-1), expected.reshape(-1)
    for start in range(0, a.numel(), chunk):
        x, e = a[start:start + chunk], b[start:start + chunk]
        if not x.numel():
            continue
        largest = _screen(x, e, bits, floor) if screened else None
        if largest is None:
            largest = float(_ratios_float64(x, e, bits, floor).max())
        worst = max(worst, largest)
    return worst


def certified(got: torch.Tensor, expected: torch.Tensor, scale: float, thresholds: Thresholds) -> bool:
    """Whether ``certificate(got, expected, scale, thresholds) <= 1``, decided in float32 where
    an upper bound of every entry's ratio shows it, and by :func:`certificate` otherwise.

    ``got`` in float32 or half precision on the CPU, ``expected`` in one of those or float64
    (a float64 rewrite: then ``e32``, ``expected`` rounded to float32, is within ``h``, half a
    float32 unit in the last place of ``e32`` and at least ``2**-126``, of it, and ``e``'s unit
    in the last place is ``e32``'s or half of it). Each entry's ratio is at most ``(|x - e32| +
    h) / (unit(e32) / 2 + floor)`` (``h = 0`` and the whole unit for the other dtypes; a unit
    below ``2**-127`` taken as zero, which only lowers the bound), computed with four roundings
    of float32 (within ``2**-21``: bounds of at least :data:`_SCREEN_FLOOR` stay normal) and
    raised by ``2**-20``. Where every bound is at most 1, so is the certificate; a larger bound,
    or a non-finite one, leaves the decision to :func:`certificate`. A rewrite rounded once
    from float64 is decided here without a float64 pass."""
    floor = thresholds.floor * scale
    if not (got.dtype in _SCREENED and expected.dtype in (*_SCREENED, torch.float64) and got.device.type == "cpu"
            and _SCREEN_FLOOR <= floor <= 2.0**100):
        return certificate(got, expected, scale, thresholds) <= 1
    bits = _MANTISSA_BITS[thresholds.dtype]
    rounded = expected.dtype == torch.float64
    a, b = got.reshape(-1), expected.reshape(-1)
    for start in range(0, a.numel(), _SCREEN_PIECE):  # pieces that stay in the cache
        e32 = b[start:start + _SCREEN_PIECE].float()  # ``expected`` itself where it is float32: not written
        ratio = torch.sub(a[start:start + _SCREEN_PIECE].float(), e32).abs_()
        field = torch.bitwise_and(e32.view(torch.int32), 0x7F800000)
        if rounded:
            ratio.add_((field - (24 << 23)).clamp_min_(1 << 23).view(torch.float32))
        unit = field.sub_(bits << 23).clamp_min_(0).view(torch.float32)
        unit = unit.mul_(0.5) if rounded else unit
        ratio.div_((unit if CERTIFICATE_ULPS == 1 else unit.mul_(CERTIFICATE_ULPS)).add_(floor))
        if not float(ratio.max()) * (1 + 2.0**-20) <= 1:
            return certificate(got, expected, scale, thresholds) <= 1
    return True


#: Dtypes whose values float32 holds exactly (the screen of :func:`certificate` runs in float32).
_SCREENED = (torch.float32, torch.bfloat16, torch.float16)

#: Smallest ``floor`` (absolute) the float32 screen takes: every bound is at least this, so a
#: unit in the last place flushed to zero in float32 (at most 2**-127) moves it by under 2**-27.
_SCREEN_FLOOR = 2.0**-100

#: Entries the screen handles in one piece (1 MiB of float32).
_SCREEN_PIECE = 1 << 18


#: The bits of a float64's exponent field.
_EXPONENT_FIELD = 0x7FF0000000000000

#: Floors from which :func:`_ratios_float64` takes the unit in the last place from the exponent
#: bits (see there): a unit below float64's smallest normal, times :data:`CERTIFICATE_ULPS`, is
#: under half a unit in the last place of such a floor.
_BITS_FLOOR = CERTIFICATE_ULPS * 2.0**-969


def _ratios_float64(x: torch.Tensor, e: torch.Tensor, bits: int, floor: float) -> torch.Tensor:
    """``|x - e| / (CERTIFICATE_ULPS * ulp(e) + floor)`` entry by entry, in float64: ``ulp(e) =
    2**(floor(log2|e|) - bits)`` (0 for ``e == 0``), the bound kept above float64's smallest normal.

    ``ulp(e)`` is ``e``'s exponent field less ``bits``, read as a float64 (faster than ``frexp``
    and ``ldexp``), and taken as 0 where that field is not positive:
    ``|e| < 2**(bits - 1022)``, whose unit is below float64's smallest normal. That leaves the
    bound as it was wherever ``floor`` is 0 (the bound is then float64's smallest normal either
    way, :data:`CERTIFICATE_ULPS` being 1) or at least :data:`_BITS_FLOOR`; a floor in between
    takes the unit from ``frexp``. Infinities and NaN give the same ratios both ways (infinite
    or NaN)."""
    x, e = x.double(), e.double()
    if floor == 0 or floor >= _BITS_FLOOR:
        unit = (e.view(torch.int64) & _EXPONENT_FIELD).sub_(bits << 52).clamp_min_(0).view(torch.float64)
    else:
        _mantissa, exponent = torch.frexp(e)  # |e| = m 2**exponent, 0.5 <= m < 1
        unit = torch.where(e == 0, 0.0, torch.ldexp(torch.ones_like(e), exponent - 1 - bits))
    bound = (unit if CERTIFICATE_ULPS == 1 else unit.mul_(CERTIFICATE_ULPS)).add_(floor)
    return (x - e).abs_().div_(bound.clamp_min_(torch.finfo(torch.float64).tiny))


def _screen(x: torch.Tensor, e: torch.Tensor, bits: int, floor: float) -> float | None:
    """The largest of :func:`_ratios_float64` over a chunk, computed in float64 only where a
    float32 estimate is near its largest; ``None`` when the estimate cannot be trusted (a
    non-finite entry or estimate, or ratios so small that float32 loses them).

    In float32: ``|x - e|`` (exact for float32 and half-precision entries up to one rounding),
    ``ulp(e)`` from the exponent bits of ``e`` (the bits of ``e``'s exponent field minus
    ``bits``, zero where that is not positive: ``e`` zero, subnormal or below ``2**(bits - 126)``,
    where the unit is below ``2**-127``), the bound and the quotient: each within a relative
    ``2**-24`` of the exact value for bounds of at least :data:`_SCREEN_FLOOR` and quotients of
    at least ``2**-60``, so all together within ``2**-21``, as the float64 ratio is (within
    ``2**-51``). The entry of the largest float64 ratio then screens within ``2**-20`` of the
    largest screened value and is among those computed in float64.
    """
    x32, e32 = x.float(), e.float()  # exact for these dtypes
    ratio = torch.empty_like(x32)
    exponent = torch.empty(min(x32.numel(), _SCREEN_PIECE), dtype=torch.int32, device=x32.device)
    for start in range(0, x32.numel(), _SCREEN_PIECE):  # pieces that stay in the cache
        piece, e_piece = ratio[start:start + _SCREEN_PIECE], e32[start:start + _SCREEN_PIECE]
        torch.sub(x32[start:start + _SCREEN_PIECE], e_piece, out=piece).abs_()
        bits_of = torch.bitwise_and(e_piece.view(torch.int32), 0x7F800000, out=exponent[:piece.numel()])
        unit = bits_of.sub_(bits << 23).clamp_min_(0).view(torch.float32)  # 2**(floor(log2|e|) - bits), or 0
        piece.div_((unit if CERTIFICATE_ULPS == 1 else unit.mul_(CERTIFICATE_ULPS)).add_(floor))
    largest = float(ratio.max())
    if not math.isfinite(largest):
        return None
    if largest < 2.0**-60:
        return 0.0 if torch.equal(x32, e32) else None
    near = torch.nonzero(ratio >= largest * (1 - 2.0**-14)).flatten()
    if near.numel() > x.numel() // 4:  # many near ties: the float64 pass over the chunk is as cheap
        return None
    return float(_ratios_float64(x[near], e[near], bits, floor).max())


def _largest_entry(tensor: torch.Tensor) -> float:
    """The largest |entry| (NaN or Inf if the tensor has one; 0 when empty), from one pass of
    ``aminmax``: several times faster than ``vector_norm(ord=inf)``."""
    if not tensor.numel():
        return 0.0
    low, high = torch.aminmax(tensor)
    return float(torch.maximum(-low, high))


def _relative_difference(a: torch.Tensor, b: torch.Tensor, reference: torch.Tensor | None = None,
                         largest: Callable[[torch.Tensor], float] = _largest_entry) -> tuple[float, float]:
    """``(max |a - b|, that over the largest |entry| of a, b and reference)``; (0, 0) when equal.

    ``largest`` gives a tensor's largest |entry| (a caching version saves passes over big tensors).
    """
    if a is b or torch.equal(a, b):
        return 0.0, 0.0
    difference = _largest_difference(a, b)
    scale = max(largest(t) for t in (a, b) + ((reference,) if reference is not None else ()))
    return difference, (difference / scale if scale > 0 else math.inf)


def _largest_difference(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 18) -> float:
    """``_largest_entry(a - b)`` in the promoted dtype (NaN if any difference is), ``chunk``
    entries at a time where the shapes agree, on the CPU: no temporary the size of the tensors
    (on another device, one pass: a synchronisation per chunk would cost more there)."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    if a.shape != b.shape or a.device.type != "cpu":  # broadcast, or off the CPU
        return _largest_entry(a.to(dtype) - b.to(dtype))
    a, b = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for start in range(0, a.numel(), chunk):
        largest = _largest_entry(a[start:start + chunk].to(dtype) - b[start:start + chunk].to(dtype))
        if math.isnan(largest):
            return largest
        worst = max(worst, largest)
    return worst


def _natural_order(names: Iterable[str]) -> list[str]:
    """Names sorted with their numbers compared as numbers (blocks.2 before blocks.10)."""
    return sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def _location(name: str) -> tuple[int | None, int | None]:
    """``(layer, head axis)`` of a parameter name."""
    layer = re.match(r"blocks\.(\d+)\.", name)
    return (int(layer.group(1)) if layer else None), _HEAD_AXIS.get(name.rsplit(".", 1)[-1])


def _mismatch(name: str, got, expected, reference, threshold: float, written_by: str | None,
              expected_in: str = "the exact rewrite") -> ParameterMismatch:
    """``got`` (the processed model's tensor) against ``expected`` (``expected_in``'s); ``None``: absent."""
    layer, head_axis = _location(name)
    if got is None:
        problem = f"absent from the processed model, present in {expected_in}"
        return ParameterMismatch(name, layer, (), math.inf, math.inf, problem, written_by)
    if expected is None:
        problem = f"present in the processed model, absent from {expected_in}"
        return ParameterMismatch(name, layer, (), math.inf, math.inf, problem, written_by)
    if got.shape != expected.shape:
        problem = f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
        return ParameterMismatch(name, layer, (), math.inf, math.inf, problem, written_by)
    absolute, relative = _relative_difference(got, expected, reference)
    heads: tuple[int, ...] = ()
    if head_axis is not None and got.ndim > head_axis and relative > 0:
        dtype = torch.promote_types(got.dtype, expected.dtype)
        per_head = (got.to(dtype) - expected.to(dtype)).abs().movedim(head_axis, 0).flatten(1).amax(dim=1)
        heads = tuple(int(h) for h in torch.nonzero(per_head > threshold * (absolute / relative)).flatten())
    at = _largest_at(got, expected) if relative > 0 else ()
    row_axis = 1 if head_axis == 0 else 0
    if relative == 0 or got.ndim <= row_axis:
        return ParameterMismatch(name, layer, heads, absolute, relative, None, written_by, at)
    rows = _differing_rows(got, expected, row_axis, threshold * (absolute / relative))
    return ParameterMismatch(name, layer, heads, absolute, relative, None, written_by, at, rows, row_axis,
                             got.shape[row_axis], "rows" if got.ndim > row_axis + 1 else "entries")


def _differing_rows(got: torch.Tensor, expected: torch.Tensor, axis: int, bound: float,
                    chunk: int = 1 << 20) -> tuple[tuple[int, int], ...]:
    """The indices along ``axis`` where some entry of ``|got - expected|`` exceeds ``bound`` (or is
    NaN), as ``(first, last)`` ranges of consecutive indices; about ``chunk`` entries at a time."""
    dtype = torch.promote_types(got.dtype, expected.dtype)
    a, b = got.movedim(axis, 0), expected.movedim(axis, 0)
    per_row = max(1, a[0].numel())
    differs = []
    for start in range(0, a.shape[0], max(1, chunk // per_row)):
        stop = start + max(1, chunk // per_row)
        difference = (a[start:stop].to(dtype) - b[start:stop].to(dtype)).abs().nan_to_num(math.inf)
        differs.append(difference.reshape(difference.shape[0], -1).amax(dim=1) > bound)
    index = torch.nonzero(torch.cat(differs)).flatten().tolist()
    ranges: list[tuple[int, int]] = []
    for i in index:
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1] = (ranges[-1][0], i)
        else:
            ranges.append((i, i))
    return tuple(ranges)


def _largest_at(got: torch.Tensor, expected: torch.Tensor, chunk: int = 1 << 20) -> tuple[int, ...]:
    """The index of the largest ``|got - expected|`` (NaN counts as largest; the first, in order),
    a chunk of entries at a time (no temporary the size of the tensors)."""
    dtype = torch.promote_types(got.dtype, expected.dtype)
    a, b = got.reshape(-1), expected.reshape(-1)
    best, where = -1.0, 0
    for start in range(0, a.numel(), chunk):
        difference = (a[start:start + chunk].to(dtype) - b[start:start + chunk].to(dtype)).abs().nan_to_num(math.inf)
        index = int(difference.argmax())
        if float(difference[index]) > best:
            best, where = float(difference[index]), start + index
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(where, device="cpu"), tuple(got.shape)))
