"""The tensor certificate's float32 screen gives the float64 computation's number, bit for bit.

``certificate`` screens each chunk in float32 and computes in float64 only the entries near the
chunk's largest ratio; :func:`float64_certificate` below is the computation it replaces (every
entry in float64, the unit in the last place from ``frexp``/``ldexp``), kept here as the
reference. Drawn: every pairing of float32/bfloat16/float16 tensors, values over the whole range
(zeros of both signs, subnormals, the smallest normals, the largest finite values, NaN and
infinities), entries equal, a few units apart, far apart or of the other sign, and scales from
zero to beyond float32's range (the screen declines where it cannot be trusted).
"""

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from circuitmath import Config
from circuitmath._diagnosis import _tensors
from circuitmath._diagnosis._tensors import (
    _MANTISSA_BITS, CERTIFICATE_ULPS, certificate, Thresholds,
)

CFG = Config(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=50, n_ctx=4, d_mlp=32)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def float64_certificate(got, expected, scale, thresholds, chunk=1 << 20) -> float:
    """The certificate as computed before the screen (float64, every entry)."""
    bits = _MANTISSA_BITS.get(thresholds.dtype, 52)
    floor = thresholds.floor * scale
    worst = 0.0
    a, b = got.reshape(-1), expected.reshape(-1)
    for start in range(0, a.numel(), chunk):
        ratio = reference_ratios(a[start:start + chunk], b[start:start + chunk], bits, floor)
        worst = max(worst, float(ratio.max())) if ratio.numel() else worst
    return worst


def reference_ratios(x, e, bits, floor) -> torch.Tensor:
    """Each entry's ratio in float64, the unit in the last place from ``frexp``/``ldexp``."""
    x, e = x.double(), e.double()
    _mantissa, exponent = torch.frexp(e)
    unit = torch.ldexp(torch.ones_like(e), exponent - 1 - bits)
    bound = CERTIFICATE_ULPS * torch.where(e == 0, 0.0, unit) + floor
    return (x - e).abs() / bound.clamp_min(torch.finfo(torch.float64).tiny)


def values(g: torch.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` values of ``dtype`` from all over its range."""
    info = torch.finfo(dtype)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    magnitudes = torch.exp2(torch.empty(n, dtype=wide).uniform_(math.log2(info.smallest_normal) - 12, math.log2(info.max), generator=g))
    out = magnitudes * torch.randn(n, generator=g).sign()
    special = torch.tensor([0.0, -0.0, info.max, -info.max, info.smallest_normal, -info.smallest_normal,
                            info.smallest_normal * 2.0**-3, info.smallest_normal * info.eps, 1.0, -1.0,
                            math.inf, -math.inf, math.nan], dtype=wide)
    pick = torch.randint(0, 3, (n,), generator=g) == 0
    out[pick] = special[torch.randint(0, len(special), (int(pick.sum()),), generator=g)]
    return out.to(dtype)


def nearby(g: torch.Generator, e: torch.Tensor, dtype: torch.dtype, finite: bool) -> torch.Tensor:
    """Entries equal to ``e``, a few units in the last place of ``dtype`` from it, or anything."""
    x = e.to(dtype)
    steps = torch.randint(-3, 4, e.shape, generator=g)
    for _ in range(3):
        toward = torch.where(steps > 0, math.inf, -math.inf).to(dtype)
        x = torch.where(steps != 0, torch.nextafter(x, toward), x)
        steps = steps - steps.sign()
    kind = torch.randint(0, 6, e.shape, generator=g)
    x = torch.where(kind == 0, e.to(dtype), x)
    x = torch.where(kind == 1, values(g, e.numel(), dtype).reshape(e.shape), x)
    x = torch.where(kind == 2, -x, x)
    if finite:
        x = torch.where(x.isfinite(), x, torch.zeros_like(x))
    return x


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), got_dtype=st.sampled_from(DTYPES),
       expected_dtype=st.sampled_from(DTYPES + [torch.float64]),
       target=st.sampled_from(DTYPES + [torch.float64]), finite=st.booleans(), size=st.sampled_from(["any", "ordinary", "tiny"]),
       scale_kind=st.sampled_from(["largest", "zero", "tiny", "huge", "random", "subnormal floor", "float64 subnormal floor"]),
       chunk=st.sampled_from([7, 64, 1 << 20]), piece=st.sampled_from([3, 1 << 18]))
def test_screen_gives_the_float64_number(seed, got_dtype, expected_dtype, target, finite, size, scale_kind, chunk,
                                         piece):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(0, 300, (), generator=g))
    expected = values(g, n, expected_dtype)
    if finite:
        expected = torch.where(expected.isfinite(), expected, torch.ones_like(expected))
    if size != "any":  # values near one another, as processing gives: ordinary ones, or around float32's subnormals
        low, high = ((-1070, -1000) if expected_dtype == torch.float64 else (-140, -110)) if size == "tiny" else (-10, 10)
        expected = (torch.randn(n, generator=g, dtype=torch.float64) * 2.0**float(torch.randint(low, high, (), generator=g))).to(expected_dtype)
    got = nearby(g, expected, got_dtype, finite)
    largest = max((float(t.float().abs().max()) if t.numel() else 0.0) for t in (got, expected))
    thresholds = Thresholds.of(target, CFG)
    scale = {"largest": largest, "zero": 0.0, "tiny": 1e-35, "huge": 1e38,
             "random": 10.0 ** float(torch.empty(()).uniform_(-40, 40, generator=g)),
             # a bound (floor) among float32's subnormals and smallest normals
             "subnormal floor": 2.0 ** float(torch.empty(()).uniform_(-150, -99, generator=g)) / thresholds.floor,
             # a floor among float64's subnormals and smallest normals, where the unit is taken from frexp
             "float64 subnormal floor": 2.0 ** float(torch.empty(()).uniform_(-1074, -960, generator=g)) / thresholds.floor,
             }[scale_kind]
    for thresholds in (thresholds, Thresholds(1e-3, 1e-4, 1e-4, target)):  # the second: floor 0
        with mock.patch.object(_tensors, "_SCREEN_PIECE", piece):  # a chunk screened in pieces, or whole
            new = certificate(got, expected, scale, thresholds, chunk)
        old = float64_certificate(got, expected, scale, thresholds, chunk)
        assert new == old or math.isnan(new) and math.isnan(old), (new.hex(), old.hex())


@pytest.mark.parametrize("dtype", DTYPES)
def test_screen_on_a_rounded_rewrite(dtype, monkeypatch):
    """Processing-like tensors (a float32 rewrite against its rounding, a unit off here and
    there, a few entries far off): many chunks, the screen taken in every one (a spy counts the
    chunks it decides, and the entries left to float64 are a few per chunk)."""
    import circuitmath._diagnosis._tensors as tensors

    decided, in_float64 = [], []
    real_screen, real_ratios = tensors._screen, tensors._ratios_float64
    monkeypatch.setattr(tensors, "_screen", lambda *a: decided.append(r := real_screen(*a)) or r)
    monkeypatch.setattr(tensors, "_ratios_float64", lambda x, *a: in_float64.append(x.numel()) or real_ratios(x, *a))
    g = torch.Generator().manual_seed(0)
    expected = torch.randn(300_000, generator=g) * 0.05
    got = expected.to(dtype, copy=True)
    off = torch.randint(0, got.numel(), (50,), generator=g)
    got[off] = torch.nextafter(got[off], torch.full_like(got[off], math.inf))
    got[off[:3]] = got[off[:3]] * 1.01
    scale = float(expected.abs().max())
    thresholds = Thresholds.of(dtype, CFG)
    new = certificate(got, expected, scale, thresholds, chunk=1 << 14)
    chunks = -(-got.numel() // (1 << 14))
    assert len(decided) == chunks and None not in decided  # the screen decided every chunk
    assert sum(in_float64) < chunks * 100  # a few entries per chunk in float64, not 16384
    assert new == float64_certificate(got, expected, scale, thresholds, chunk=1 << 14)
    assert new > 1  # the 1 % change leaves the bound


@pytest.mark.parametrize("floor", [2.0**-135, 2.0**-140, 2.0**-149], ids=["2**-135", "2**-140", "2**-149"])
def test_screen_declines_a_floor_below_which_float32_loses_a_unit(floor):
    """The screen takes an entry's unit in the last place as zero below ``2**-127`` (a float32
    ``e`` under ``2**(bits - 126)``); with a floor that small, such an entry one unit off screens
    far above its true ratio (``2**-133 / floor`` against ``2**-133 / (2**-133 + floor)``, under
    1), is the only one computed in float64, and the chunk's true largest ratio, an
    ordinary entry two units off (2), is never looked at: the certificate would read under 1 and
    certify a tensor that fails it. ``_SCREEN_FLOOR`` sends such floors to float64. The random
    draws above reach this only by chance (tiny entries, a floor among float32's subnormals
    and the two entries in one chunk); here every ingredient is placed."""
    thresholds = Thresholds(1e-3, 1e-4, 1e-4, torch.float32, floor=1.0)  # floor * scale = floor
    # 2**-110: unit 2**-133; the entries equal to the rewrite keep the chunk from being declined
    # for having too many near ties (two entries alone go to float64 whatever the floor)
    expected = torch.tensor([2.0**-110, 1.0] + [0.5] * 20, dtype=torch.float32)
    got = expected.clone()
    got[0] += 2.0**-133  # one unit off: a ratio under 1
    got[1] += 2.0**-22  # two units off: a ratio of 2
    old = float64_certificate(got, expected, floor, thresholds)
    assert 1.99 < old <= 2.0
    assert certificate(got, expected, floor, thresholds) == old


def test_screen_where_float32_misorders_the_ratios():
    """Two entries whose ratios float32 orders the other way from float64 (bounds from different
    binades: a bfloat16 unit in the last place plus a float32 floor, each rounded): the
    certificate still gives the float64 number (the screen's margin keeps both)."""
    g = torch.Generator().manual_seed(0)
    thresholds = Thresholds.of(torch.bfloat16, CFG)
    n = 200_000
    expected = torch.exp2(torch.randint(-20, 20, (n,), generator=g).float()) * (1 + torch.rand(n, generator=g))
    unit = torch.exp2(torch.floor(torch.log2(expected.double())) - 7)
    floor = thresholds.floor * 1.0
    got = (expected.double() + (0.5 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)) * (unit + floor)).float()
    exact = (got.double() - expected.double()).abs() / (unit + floor)
    estimate = (got - expected).abs() / (unit.float() + floor)
    order = exact.argsort()
    reversed_ = (estimate[order[1:]] < estimate[order[:-1]]).nonzero().flatten()
    assert reversed_.numel()  # the draw discriminates
    pair = order[reversed_[:1] + torch.tensor([0, 1])]  # exact ratios ascending, estimates descending
    # among entries equal to the rewrite (a chunk the screen is taken on)
    got, expected = torch.cat([got[pair], expected[:1000]]), torch.cat([expected[pair], expected[:1000]])
    assert certificate(got, expected, 1.0, thresholds) == float64_certificate(got, expected, 1.0, thresholds)


@pytest.mark.parametrize("bits", [7, 10, 23, 52])
@pytest.mark.parametrize("floor", [0.0, 2.0**-1074, 2.0**-1030, 2.0**-1000, 2.0**-970, 2.0**-969, 2.0**-900, 1e-5])
def test_ratios_in_float64_give_the_frexp_number(bits, floor):
    """``_ratios_float64`` reads the unit in the last place from the exponent bits, and from
    ``frexp`` where the floor is positive and below ``2**-969``: there a unit below float64's
    smallest normal (of an entry under ``2**(bits - 1022)``) still moves the bound. Every entry's
    ratio is the reference's, bit for bit, over float64's whole range."""
    e = torch.tensor([0.0, -0.0, 2.0**-1074, 2.0**-1030, 2.0**-1022, 2.0**-1020, -3 * 2.0**-1021, 2.0**-1015,
                      2.0**-1000, 1.0, -1.5, 2.0**1000, math.inf, -math.inf, math.nan], dtype=torch.float64)
    for x in (torch.zeros_like(e), torch.nextafter(e, torch.full_like(e, math.inf)), e * 1.01):
        reference = reference_ratios(x, e, bits, floor)
        got = _tensors._ratios_float64(x, e, bits, floor)
        assert torch.equal(got.isnan(), reference.isnan())
        assert torch.equal(got.nan_to_num(0.0), reference.nan_to_num(0.0)), (got - reference)
