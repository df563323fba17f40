"""Numeric checks of the circuits identities and their negative controls.

Each identity's check compares the computation it licenses (logits along a route, a quantity
from factors) with the reference (the forward pass, the materialised quantity). The negative
controls run the same check on a wrong computation, on models where it really differs
(GENERIC and DISCRIMINATING): a reversed product of patterns needs two layers, a wrong stacking
order of ``W_O`` two heads of width two, a norm taken over positions a norm, and so on.
"""

from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

import circuitmath as cm
from circuitmath.strategies import configs, models, state_dicts, tokens
from circuitmath.testing import default_tokens
from support import VISIBLE, assume_discriminates, wide

POSITIONS = ("standard", "rotary", "shortformer", "shortformer_tables")
ROUTE = dict(attn_only=True, positional_embedding_types=POSITIONS, max_layers=2)
NORMED = ("LN", "LNPre", "RMS", "RMSPre")

# identity -> options for models it applies to
CHECKS = {
    "tensor_product_action": dict(ROUTE, min_layers=1),
    "tensor_mixed_product": ROUTE,
    "kronecker_vec": dict(ROUTE, min_layers=1, max_d_model=8, max_ctx=4),
    "row_column_convention": dict(ROUTE, min_layers=1),
    "attention_head_tensor_form": dict(ROUTE, min_layers=1),
    "multi_head_sum": dict(ROUTE, min_layers=1),
    "only_attention_mixes_positions": ROUTE,
    "zero_layer_bigram": dict(ROUTE, max_layers=0),
    "one_layer_path_expansion": dict(ROUTE, min_layers=1, max_layers=1),
    "two_layer_path_expansion": dict(ROUTE, min_layers=2),
    "qk_composition_terms": dict(ROUTE, min_layers=2),
    "virtual_weights": ROUTE,
    "factored_svd": dict(min_layers=1),
    "eigenvalues_ab_ba": dict(min_layers=1),
    "composition_scores_from_factors": dict(min_layers=1, max_layers=3),
    "composition_score_invariance": dict(min_layers=1, max_layers=3, positional_embedding_types=("standard", "shortformer", "rotary")),
    "copying_score_invariance": dict(min_layers=1),
}

# identity -> (extra model options, a test on the drawn config) where its wrong rewrites differ, on
# top of GENERIC: in a residual stream of two dimensions behind a LayerNorm (one after centering),
# with one position or a width-one head, wrong variants can coincide with right ones; and with
# huge outliers and biases the patterns saturate to permutations, which commute, and small score
# terms stop moving them (TAME weights).
def GENERIC(cfg):
    return cfg.d_model >= 4 and cfg.d_vocab >= 3 and cfg.n_ctx >= 3 and cfg.d_head >= 2


TAME = dict(max_outlier_scale=3.0, max_bias_scale=0.5)


DISCRIMINATING = {
    "tensor_mixed_product": (dict(min_layers=2), lambda cfg: True),
    "multi_head_sum": ({}, lambda cfg: cfg.n_heads >= 2),
    "only_attention_mixes_positions": (dict(normalization_types=NORMED), lambda cfg: True),
    "virtual_weights": (dict(min_layers=1), lambda cfg: True),
    # K-composition must move the pattern: no saturating shortformer positions
    "qk_composition_terms": (dict(positional_embedding_types=("standard", "rotary")), lambda cfg: True),
    "composition_scores_from_factors": (dict(min_layers=2, positional_embedding_types=("standard", "shortformer")), lambda cfg: True),
    "composition_score_invariance": (dict(min_layers=2, positional_embedding_types=("standard", "shortformer")), lambda cfg: True),
}


def test_every_circuits_identity_is_checked_here():
    ours = {"notation", "attention", "paths", "composition"}
    registered = [i.name for i in cm.identities() if i.build_proof.__module__.rsplit(".", 1)[-1] in ours]
    assert sorted(registered) == sorted(CHECKS)


# Identities with a ``compare`` whose wrong rewrites run in another module, by the test named:
# tests/test_weight_identities.py skips every identity with a ``compare``, and the controls above
# run a computation on a model, while rms_norm_rotation's takes the final residual stream.
CHECKED_ELSEWHERE = {
    "rms_norm_rotation": "test_rotation.py::test_rms_norm_rotation_rejects_each_wrong_rewrite",
}


def test_every_identity_with_a_compare_has_its_wrong_rewrites_run_somewhere():
    """The guard above covers the circuits families only; this one covers the registry: an
    identity that licenses a computation is in CHECKS or names the test that runs its wrong rewrites."""
    computations = {i.name for i in cm.identities() if i.compare is not None}
    assert sorted(computations) == sorted(set(CHECKS) | set(CHECKED_ELSEWHERE))
    for where in CHECKED_ELSEWHERE.values():
        module, test = where.split("::")
        assert f"\ndef {test}(" in (Path(__file__).parent / module).read_text(), f"{where} is gone"


@pytest.mark.parametrize("name", sorted(CHECKS))
@given(data=st.data())
def test_check_passes_in_float64(name, data):
    identity = cm.get_identity(name)
    cfg, sd = data.draw(models(**wide(dtype=torch.float64, **CHECKS[name])))
    result = identity.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, (name, result)


@pytest.mark.parametrize("name", sorted(CHECKS))
@given(data=st.data())
def test_check_passes_in_float32(name, data):
    identity = cm.get_identity(name)
    cfg, sd = data.draw(models(**wide(dtype=torch.float32, **CHECKS[name])))
    result = identity.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, (name, result)


@pytest.mark.parametrize("name", sorted(CHECKS))
@given(data=st.data())
def test_negative_controls_are_caught(name, data):
    identity = cm.get_identity(name)
    extra, applies = DISCRIMINATING.get(name, ({}, lambda cfg: True))
    cfg = data.draw(configs(**wide(**{**CHECKS[name], **extra})).filter(lambda cfg: GENERIC(cfg) and applies(cfg)))
    sd = data.draw(state_dicts(cfg, dtype=torch.float64, **TAME))
    toks = default_tokens(cfg)
    for wrong_name in identity.wrong_rewrites_for(cfg):
        assume_discriminates(identity, wrong_name, sd, cfg, toks, result=VISIBLE)
    for wrong_name in identity.wrong_rewrites_for(cfg):
        result = identity.check_wrong_rewrite(wrong_name, sd, cfg, toks)
        assert not result.passed, f"{name}: {wrong_name} went unnoticed: {result} on {cfg}"


def test_float64_path_expansion_of_a_real_forward_pass_and_its_negative_control():
    """The issue's acceptance check, spelled out: float64, patterns frozen, drop one path."""
    cfg = cm.Config(n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=50, n_ctx=12, d_mlp=None)
    sd = cm.random_state_dict(cfg, seed=7, dtype=torch.float64)
    toks = torch.randint(0, cfg.d_vocab, (3, 12), generator=torch.Generator().manual_seed(0))
    terms = cm.circuits.path_terms(sd, cfg, toks)
    logits = cm.forward(sd, cfg, toks)
    assert (sum(terms.values()) - logits).abs().max() < 1e-10 * logits.abs().max()
    for dropped in (cm.circuits.Path("embed"), cm.circuits.Path("embed", ((0, 1),)), cm.circuits.Path("embed", ((0, 1), (1, 2)))):
        partial = sum(v for p, v in terms.items() if p != dropped)
        centered = lambda x: x - x.mean(dim=-1, keepdim=True)  # noqa: E731 (log-probs ignore shifts)
        assert (centered(partial) - centered(logits)).abs().max() > 1e-3, dropped


@pytest.mark.parametrize("name", ["zero_layer_bigram", "one_layer_path_expansion", "two_layer_path_expansion", "qk_composition_terms"])
def test_routes_refuse_models_of_the_wrong_depth(name):
    layers = {"zero_layer_bigram": 1, "one_layer_path_expansion": 2, "two_layer_path_expansion": 1, "qk_composition_terms": 1}[name]
    cfg = cm.Config(n_layers=layers, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6)
    with pytest.raises(cm.PreconditionError):
        cm.get_identity(name).check(cm.random_state_dict(cfg, seed=0), cfg)
