"""``certified``: whether a tensor passes its certificate, decided from a float32 upper bound of
every entry's ratio where that shows it (a float64 rewrite rounded once: no float64 pass), else
by the certificate itself; always the certificate's decision."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from circuitmath._diagnosis import _tensors
from circuitmath._diagnosis._tensors import Thresholds, certified
from test_certificate import CFG, DTYPES, float64_certificate, nearby, values


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), got_dtype=st.sampled_from(DTYPES),
       expected_dtype=st.sampled_from(DTYPES + [torch.float64]), target=st.sampled_from(DTYPES + [torch.float64]),
       finite=st.booleans(), near=st.booleans(), scale_kind=st.sampled_from(["largest", "tiny", "huge", "subnormal"]))
def test_certified_is_the_certificates_decision(seed, got_dtype, expected_dtype, target, finite, near, scale_kind):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 300, (), generator=g))
    expected = values(g, n, expected_dtype)
    if near:  # ordinary values, as processing gives, the tensor the rewrite rounded and a unit off here and there
        expected = (torch.randn(n, generator=g, dtype=torch.float64) * 2.0**float(torch.randint(-10, 10, (), generator=g)))
        expected = expected.to(expected_dtype)
    if finite:
        expected = torch.where(expected.isfinite(), expected, torch.ones_like(expected))
    got = expected.to(got_dtype) if near and seed % 2 else nearby(g, expected, got_dtype, finite)
    thresholds = Thresholds.of(target, CFG)
    largest = max(float(t.double().abs().nan_to_num(0, 0, 0).max()) for t in (got, expected))
    scale = {"largest": largest, "tiny": 1e-35, "huge": 1e38,
             "subnormal": 2.0 ** float(torch.empty(()).uniform_(-150, -99, generator=g)) / thresholds.floor}[scale_kind]
    old = float64_certificate(got, expected, scale, thresholds)
    assert certified(got, expected, scale, thresholds) == (old <= 1), (old, scale)


def test_a_float64_rewrite_rounded_once_is_certified_in_float32(monkeypatch):
    """No float64 pass for a rewrite rounded once (a spy on the certificate); one entry two units
    of bfloat16 off, beyond the floor, is refused (the control), by the certificate."""
    calls = []
    real = _tensors.certificate
    monkeypatch.setattr(_tensors, "certificate", lambda *a: calls.append(a) or real(*a))
    g = torch.Generator().manual_seed(0)
    expected = torch.randn(700_000, generator=g, dtype=torch.float64) * 0.05
    for dtype in (torch.float32, torch.bfloat16):
        thresholds = Thresholds.of(dtype, CFG)
        got = expected.to(dtype)
        scale = float(expected.abs().max())
        assert certified(got, expected, scale, thresholds) and not calls
        far = got.clone()
        at = int(expected.abs().argmax())
        unit = 2.0 ** (math.floor(math.log2(abs(float(expected[at])))) - _tensors._MANTISSA_BITS[dtype])
        far[at] += 2 * unit + 2 * thresholds.floor * scale
        assert not certified(far, expected, scale, thresholds) and len(calls) == 1
        calls.clear()
