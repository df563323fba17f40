"""The diagnosis's recognition threshold (``Thresholds.recognise``) sits in the gap its docstring
states, pinned where mutation testing (``make mutate``) found its value unpinned: a rewrite
computed another way stays orders of magnitude inside it, every wrong rewrite misses it by orders
of magnitude."""

import pytest
import torch

import circuitmath as cm
from circuitmath._diagnosis import weight_identities
from circuitmath._diagnosis._tensors import Thresholds, _relative_difference

MODELS = {
    "LN": cm.Config(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=23, n_ctx=8, d_mlp=64),
    "LLaMA": cm.Config(n_layers=2, d_model=16, n_heads=4, d_head=4, d_vocab=23, n_ctx=8, d_mlp=32,
                       normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True, act_fn="silu",
                       n_key_value_heads=2),
}
GAP = 100  # two orders of magnitude on each side


def _miss(exact: dict, other: dict) -> float:
    """The largest relative difference (the replay's measure) over the tensors both hold."""
    return max((_relative_difference(exact[n], other[n].to(exact[n].dtype))[1] for n in exact
                if n in other and other[n].shape == exact[n].shape), default=0.0)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_float32_recognition_lies_two_orders_of_magnitude_from_rounding_and_from_every_wrong_rewrite(model):
    """On a float32 model, each weight identity's rewrite computed in float64 and rounded once is
    within a hundredth of ``recognise`` of the float32 one; each registered wrong rewrite that
    applies either is that rewrite on this model (within a hundredth: the wrong step changes
    nothing here, e.g. one value bias per key-value head without grouped queries) or misses it by
    a hundred times ``recognise`` at least (the closest, a centering over the wrong axis or behind
    RMSNorm, by about 0.17 of the largest entry). At least a dozen wrong rewrites are tried."""
    cfg = MODELS[model]
    state_dict = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    recognise = Thresholds.of(torch.float32, cfg).recognise
    rounding, missed, same = [], [], []
    for identity in weight_identities(symmetries=True):
        try:
            state, state_cfg = identity.prepared(state_dict, cfg)
            exact, _ = identity.transform(state, state_cfg)
            in_float64, _ = identity.transform({n: t.double() for n, t in state.items()}, state_cfg)
        except cm.PreconditionError:
            continue
        rounding.append(_miss(exact, in_float64))
        for name, wrong in identity.wrong_rewrites.items():
            try:
                miss = _miss(exact, wrong.function(state, state_cfg)[0])
            except Exception:  # noqa: BLE001 - a wrong rewrite of a feature this model lacks may not run at all
                continue
            if miss > 0:
                (same if miss <= recognise / GAP else missed).append((f"{identity.name}.{name}", miss))
    assert max(rounding) <= recognise / GAP
    assert len(missed) >= 12
    assert [(name, miss) for name, miss in missed if miss < GAP * recognise] == []


def test_a_permutation_is_recovered_among_slices_all_within_the_threshold_of_one_another():
    """80 slices alike to 1e-6 of their largest entry, permuted: every pair passes the screen
    (6400 pairs, more than one chunk of the entrywise comparison), and the exact permutation is
    still the one recovered (each slice is nearest its own image). Control: the identity order
    is no permutation (None)."""
    from circuitmath._diagnosis._recover import slice_permutation

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(1, 16, generator=generator, dtype=torch.float64)
    ours = base + 1e-6 * torch.randn(80, 16, generator=generator, dtype=torch.float64)
    perm = torch.randperm(80, generator=generator)
    assert slice_permutation(ours, ours[perm], 0, 1e-3) == tuple(perm.tolist())
    assert slice_permutation(ours, ours.clone(), 0, 1e-3) is None


def test_a_recovered_scaling_is_the_float64_least_squares_ratio_of_half_precision_tensors():
    """A bfloat16 tensor's columns scaled by s and rounded to bfloat16: _scaling finds the last
    axis and, per column, the least-squares ratio sum(old new) / sum(old old) of the tensors'
    values computed in float64 (to 1e-12 relative), within bfloat16's rounding of s. Control: a
    tensor not so scaled (a column mixed into another) gives None."""
    from circuitmath._diagnosis._uncertain import _scaling

    generator = torch.Generator().manual_seed(0)
    old = torch.randn(64, 4, generator=generator).to(torch.bfloat16)
    s = torch.tensor([0.5, 2.0, 3.0, 1.25], dtype=torch.float64)
    new = (old.double() * s).to(torch.bfloat16)
    axis, v = _scaling(old, new)
    a, b = old.double(), new.double()
    assert axis == -1 and v.dtype == torch.float64
    assert torch.allclose(v, (a * b).sum(0) / (a * a).sum(0), rtol=1e-12, atol=0)
    assert torch.allclose(v, s, rtol=2 ** -8, atol=0)
    mixed = new.clone()
    mixed[:, 0] += new[:, 1]
    assert _scaling(old, mixed) is None


def test_a_certificate_ratio_is_computed_in_float64_whatever_the_dtypes_compared():
    """widened_ratios of float32 tensors with no widening: |got - e| over ulp(e) (2**(floor(log2
    |e|) - 23)) plus floor times the scale, entry by entry as float64 computes it from the float32
    values (to 1e-12 relative; float32 would round the bound at 6e-8). Control: an entry moved by
    two units has a ratio above 1."""
    from circuitmath._diagnosis._uncertain import widened_ratios

    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=23, n_ctx=5, d_mlp=16)
    thresholds = Thresholds.of(torch.float32, cfg)  # floor 8 eps sqrt(23): no float32 number
    generator = torch.Generator().manual_seed(0)
    expected = torch.randn(200, generator=generator) * 3.0
    got = expected + torch.randn(200, generator=generator) * 1e-7
    scale = float(expected.abs().max())
    e = expected.double()
    unit = torch.ldexp(torch.ones_like(e), torch.frexp(e)[1] - 1 - 23)
    exact = (got.double() - e).abs() / (unit + thresholds.floor * scale)
    ratios = widened_ratios(got, expected, scale, thresholds, [])
    assert ratios.dtype == torch.float64
    assert torch.allclose(ratios, exact, rtol=1e-12, atol=0)
    moved = expected.clone()
    moved[0] = expected[0] + 2 * float(unit[0]) + 2 * thresholds.floor * scale
    assert float(widened_ratios(moved, expected, scale, thresholds, [])[0]) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_change_is_measured_in_units_of_the_certificates_bound(dtype):
    """changes_of a tensor with entries up to about 300 against its rewrite moved by a few units
    of rounding (a tensor's scale far from 1, where the floor's share of the bound, floor times
    the largest entry, shows): its worst ratio is the certificate's, whose bound is at most 1
    where the tensor is certified. Control: an entry moved by 1 % is far beyond 1."""
    from circuitmath._diagnosis._tensors import certificate
    from circuitmath._diagnosis._unexplained import changes_of

    cfg = MODELS["LN"]
    thresholds = Thresholds.of(dtype, cfg)
    generator = torch.Generator().manual_seed(0)
    rewrite = (torch.randn(32, 16, generator=generator) * 100).to(dtype)
    after = (rewrite.float() * (1 + 4 * torch.finfo(dtype).eps * torch.randn(32, 16, generator=generator))).to(dtype)
    scale = max(float(rewrite.float().abs().max()), float(after.float().abs().max()))
    (change,) = changes_of(["W"], {"W": after}, {"W": rewrite}, thresholds)
    assert change.worst == pytest.approx(certificate(after, rewrite, scale, thresholds), rel=1e-9)
    moved = after.clone()
    moved[0, 0] = rewrite[0, 0] * 1.01 + 1
    (far,) = changes_of(["W"], {"W": moved}, {"W": rewrite}, thresholds)
    assert far.worst > 10 and far.worst == pytest.approx(certificate(moved, rewrite, scale, thresholds), rel=1e-9)
