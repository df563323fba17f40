"""The log-prob tolerance is pinned from both sides.

- Its formula is the documented one (``testing.logprob_tolerance``), constants included.
- It is tight: on models processed exactly, the worst measured rounding error is within
  ``LOOSENESS`` of the tolerance (so a tolerance scaled up tenfold fails this test), and a wrong
  transform whose error is just above the tolerance is rejected while one just below passes.
- In half precision, where the tolerance is wide, the tensor certificate catches what it cannot:
  a 1 % change of any single tensor.
- The measured sensitivity it adds is what it says: the forward pass's own rounding plus the
  effect of rounding the weights once more, the latter compared with an independent nudge (its
  third part, the LayerNorms' means rounded apart, is pinned in tests/test_rounding_sensitivity.py).
"""

import math

import pytest
import torch

import circuitmath as cm
from circuitmath import Config, process_weights, random_state_dict
from circuitmath._reference import log_probs
from circuitmath.testing import (
    NotEquivalentError, assert_equivalent, compare_log_probs, default_tokens, logprob_tolerance, rounding_sensitivity,
)

CONFIGS = [
    Config(n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=40, n_ctx=8, d_mlp=64),
    Config(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=20, n_ctx=6, d_mlp=32),
]
#: The tolerance may exceed the worst rounding error measured on CONFIGS (3 seeds each, the
#: whole pipeline applied) by at most this factor. Measured: 69 (float32), 109 (float64).
LOOSENESS = 200.0


@pytest.mark.parametrize(
    "dtype, u", [(torch.float64, 2.0**-53), (torch.float32, 2.0**-24), (torch.bfloat16, 2.0**-24)]
)
@pytest.mark.parametrize("scale", [0.25, 7.0])
def test_tolerance_is_the_documented_formula(dtype, u, scale):
    cfg = CONFIGS[0]
    sensitivity = 3e-7
    expected = 32.0 * u * (cfg.n_layers + 1) * math.sqrt(max(cfg.d_model, cfg.d_mlp, cfg.d_vocab)) * max(1.0, scale)
    expected += 4.0 * sensitivity
    assert logprob_tolerance(cfg, dtype, scale, sensitivity) == pytest.approx(expected, rel=1e-12)
    assert logprob_tolerance(cfg, dtype, scale) == pytest.approx(expected - 4.0 * sensitivity, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tolerance_is_within_a_stated_factor_of_measured_rounding(dtype):
    ratios = []
    for cfg in CONFIGS:
        for seed in range(3):
            sd = random_state_dict(cfg, seed=seed, dtype=dtype)
            after, after_cfg = process_weights(sd, cfg)
            result = compare_log_probs(sd, cfg, after, after_cfg)
            assert result.passed
            ratios.append(result.max_abs_error / result.tolerance)
    assert max(ratios) >= 1 / LOOSENESS, f"tolerance {1 / max(ratios):.0f}x the worst rounding measured"


def _logit_nudge(sd, cfg, tokens, token: int) -> float:
    """max |Δ log-prob| per unit added to b_U[token] (float64, linear for small steps)."""
    exact = {k: v.double() for k, v in sd.items()}
    step = dict(exact, **{"unembed.b_U": exact["unembed.b_U"].clone()})
    step["unembed.b_U"][token] += 1e-6
    return float((log_probs(step, cfg, tokens) - log_probs(exact, cfg, tokens)).abs().max()) / 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("times, passes", [(2.0, False), (0.5, True)])
def test_an_error_just_above_the_tolerance_fails_and_just_below_passes(dtype, times, passes):
    cfg = CONFIGS[0]
    sd = random_state_dict(cfg, seed=0, dtype=dtype)
    tokens = default_tokens(cfg)
    tolerance = compare_log_probs(sd, cfg, sd, cfg, tokens).tolerance
    wrong = dict(sd, **{"unembed.b_U": sd["unembed.b_U"].double().clone()})
    wrong["unembed.b_U"][3] += times * tolerance / _logit_nudge(sd, cfg, tokens, 3)
    wrong["unembed.b_U"] = wrong["unembed.b_U"].to(dtype)
    result = compare_log_probs(sd, cfg, wrong, cfg, tokens)
    assert result.passed is passes, (result.max_abs_error / result.tolerance)
    assert result.max_abs_error == pytest.approx(times * tolerance, rel=0.2)


def test_sensitivity_measures_the_forward_pass_and_the_weights():
    cfg = CONFIGS[0]
    sd = random_state_dict(cfg, seed=0, dtype=torch.float32)
    tokens = default_tokens(cfg)
    exact = {k: v.double() for k, v in sd.items()}
    reference = log_probs(exact, cfg, tokens)
    forward = float((log_probs(sd, cfg, tokens).double() - reference).abs().max())
    g = torch.Generator().manual_seed(12345)
    u = 2.0**-24
    nudges = []
    for _ in range(4):  # an independent nudge of the weights by u * N(0, 1), four draws
        nudged = {k: v * (1 + u * torch.randn(v.shape, generator=g, dtype=torch.float64)) for k, v in exact.items()}
        nudges.append(float((log_probs(nudged, cfg, tokens) - reference).abs().max()))
    sensitivity = rounding_sensitivity(sd, cfg, tokens, torch.float32)
    weights = sensitivity - forward
    assert forward > 0 and sensitivity >= forward
    assert 0.4 * min(nudges) <= weights <= 2.5 * max(nudges), (weights, nudges)
    # Given the exact log-probs as the computed ones, only the weights term is left, and it is
    # measured against float64 log-probs of the float64 weights (measured: 0.69e-6 against
    # nudges of 0.6e-6 to 1.0e-6; against float32 log-probs it would carry the forward pass's
    # 1.6e-6 of rounding as well).
    alone = rounding_sensitivity(sd, cfg, tokens, torch.float32, computed=reference)
    assert 0.4 * min(nudges) <= alone <= 1.6 * max(nudges), (alone, nudges)
    # float64 weights: no forward-pass term, the weights term at float64's roundoff.
    sensitivity64 = rounding_sensitivity(exact, cfg, tokens, torch.float64)
    assert 0 < sensitivity64 <= 1e-12


@pytest.mark.parametrize("zoo_name", ["attn_only_1l", "gelu_2l"])
def test_a_one_percent_change_of_any_bfloat16_tensor_fails_and_is_named(zoo_name):
    """In bfloat16 the log-prob tolerance is about a nat; the tensor certificate (1 unit in the
    last place of the replayed rewrite) still catches a 1 % change of each single tensor of a
    zoo model, and the diagnosis names that tensor and nothing else. The correct processing
    passes: the certificate is not stricter than processing in float32 and rounding once."""
    from circuitmath import zoo

    state_dict, cfg = zoo.load(zoo_name)
    half = {k: v.to(torch.bfloat16) for k, v in state_dict.items()}
    out, out_cfg = cm.process_weights(half, cfg)
    comparison = assert_equivalent(half, out, cfg, after_cfg=out_cfg)
    checked = 0
    for name, tensor in out.items():
        changed = (tensor.float() * 1.01).to(torch.bfloat16)
        if torch.equal(changed, tensor):
            continue  # all zero (a folded b_V): a 1 % change is no change
        checked += 1
        with pytest.raises(NotEquivalentError) as failed:
            assert_equivalent(half, dict(out, **{name: changed}), cfg, after_cfg=out_cfg)
        assert {p.name for p in failed.value.diagnosis.culprits()} == {name}
        assert "not the exact rewrite" in str(failed.value)
    assert checked >= len(out) - cfg.n_layers and comparison.tolerance > 0.3  # wide: the log-probs alone would pass
