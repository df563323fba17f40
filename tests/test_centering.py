"""Centering the writing weights and the unembed, on random weights with realistic structure."""

import pytest
import torch
from hypothesis import given, strategies as st

import circuitmath as cm
from circuitmath._processing import writers
from circuitmath.strategies import models, tokens
from circuitmath.testing import compare_log_probs, default_tokens, logprob_tolerance
from support import VISIBLE, assert_caught, same, snapshot, wide

WRITING = cm.get_identity("center_writing_weights")
UNEMBED = cm.get_identity("center_unembed")
CENTERING_NORMS = dict(normalization_types=("LN", "LNPre"))
# A wrong transform only shows where gains are not all 1 and biases not 0.
DISCRIMINATING = dict(min_gain_spread=0.3, min_bias_scale=0.5)
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])


def _distinct_tokens(cfg):
    """One sequence of ``n_ctx`` tokens, neighbours distinct: position-free values then differ."""
    return (torch.arange(cfg.n_ctx) % cfg.d_vocab)[None, :]


def _mean_is_zero(tensor, dim):
    scale = max(float(tensor.double().abs().max()), 1.0)
    return float(tensor.double().mean(dim=dim).abs().max()) <= 8 * tensor.shape[dim] * torch.finfo(tensor.dtype).eps * scale


# -- writing weights ---------------------------------------------------------------------------


@DTYPES
@given(data=st.data())
def test_centering_writing_weights_preserves_log_probs(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **CENTERING_NORMS)))
    result = WRITING.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, result
    centered, centered_cfg = cm.center_writing_weights(sd, cfg)
    assert centered_cfg.applied == ("center_writing_weights",)
    names = writers(cfg)
    assert all(_mean_is_zero(centered[name], -1) for name in names)
    assert all(centered[k] is sd[k] for k in sd if k not in names), "only the writers may change"
    if cfg.positional_embedding_type == "shortformer":
        assert "pos_embed.W_pos" not in names and centered["pos_embed.W_pos"] is sd["pos_embed.W_pos"]


@given(models(**wide(weights=DISCRIMINATING, min_layers=1, **CENTERING_NORMS)))
def test_negative_control_W_O_centered_over_d_head_is_caught(model):
    cfg, sd = model
    toks = default_tokens(cfg)
    assert_caught(WRITING, "W_O_over_d_head", sd, cfg, toks, "centering W_O over d_head", weights=VISIBLE)


# Centering a shortformer W_pos moves queries and keys; it shows when a query has two keys with
# different values to choose between: two positions holding different tokens, and d_model >= 3
# (over two dimensions LNPre keeps only a sign, which two tokens may share). Outlier directions
# in W_pos are left out: they make scores so large that the pattern is one-hot in float64
# before and after, and the change, though real, leaves no trace.
UNSATURATED = dict(min_gain_spread=0.3, max_gain_spread=0.5, min_bias_scale=0.5, max_bias_scale=1.0, max_outlier_dims=0)


@given(
    models(**wide(weights=UNSATURATED, min_layers=1, positional_embedding_types=("shortformer",), **CENTERING_NORMS))
    .filter(lambda model: model[0].n_ctx >= 2 and model[0].d_model >= 3)
)
def test_negative_control_centering_shortformer_W_pos_is_caught(model):
    cfg, sd = model
    toks = _distinct_tokens(cfg)
    assert_caught(WRITING, "shortformer_W_pos", sd, cfg, toks, "centering the shortformer W_pos", pattern=VISIBLE)


WRITING_REFUSALS = [
    (dict(normalization_types=("RMS", "RMSPre", None)), "every reader sits behind a centering norm"),
    (dict(normalization_types=("LN",), norm_positions=("post",)), "pre-norm"),
]


@pytest.mark.parametrize("options, precondition", WRITING_REFUSALS, ids=["not-centering-norm", "post-norm"])
@given(data=st.data())
def test_centering_writing_weights_refuses_what_it_cannot_rewrite_exactly(options, precondition, data):
    cfg, sd = data.draw(models(**wide(**options)))
    before = snapshot(sd)
    with pytest.raises(cm.PreconditionError) as info:
        cm.center_writing_weights(sd, cfg)
    assert info.value.identity == "center_writing_weights" and info.value.precondition == precondition
    assert precondition in str(info.value)
    assert same(sd, before)


@pytest.mark.parametrize("normalization", ["RMS", "RMSPre", None])
def test_refusal_is_not_a_formality(normalization):
    """Centering the writes of a model whose norm does not center really does change it."""
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=16,
                    normalization_type=normalization)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    names = writers(cfg)
    naive = {k: v - v.mean(dim=-1, keepdim=True) if k in names else v for k, v in sd.items()}
    result = compare_log_probs(sd, cfg, naive, cfg)
    assert result.max_abs_error > 1e3 * result.tolerance


# -- unembed ---------------------------------------------------------------------------------


@DTYPES
@given(data=st.data())
def test_centering_unembed_preserves_log_probs_in_every_architecture(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, norm_positions=("pre", "post"))))
    result = UNEMBED.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, result
    centered, centered_cfg = cm.center_unembed(sd, cfg)
    assert _mean_is_zero(centered["unembed.W_U"], -1) and _mean_is_zero(centered["unembed.b_U"], -1)
    assert centered_cfg.applied == ("center_unembed",)


def _shift_spread(before, before_cfg, after, after_cfg, toks):
    """How far ``logits_after - logits_before`` is from ``-mean(logits_before)`` at each position, and the tolerance."""
    logits = cm.forward(before, before_cfg, toks).double()
    shift = cm.forward(after, after_cfg, toks).double() - logits
    error = float((shift + logits.mean(dim=-1, keepdim=True)).abs().max())
    dtype = next(iter(before.values())).dtype
    return error, logprob_tolerance(before_cfg, dtype, float(logits.abs().max()))


@DTYPES
@given(data=st.data())
def test_raw_logits_shift_by_minus_their_mean_at_each_position(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, norm_positions=("pre", "post"))))
    toks = data.draw(tokens(cfg))
    centered, centered_cfg = cm.center_unembed(sd, cfg)
    error, tolerance = _shift_spread(sd, cfg, centered, centered_cfg, toks)
    assert error <= tolerance, (error, tolerance)


# Centering W_U over d_model is harmless when the final norm's output is centered (LNPre), so the
# wrong axis only shows behind a norm whose output is not: LN with its gain and bias, RMS, none.
NOT_CENTERED_OUTPUT = dict(normalization_types=("LN", "RMS", "RMSPre", None), norm_positions=("pre", "post"))


@given(models(**wide(weights=DISCRIMINATING, **NOT_CENTERED_OUTPUT)))
def test_negative_control_unembed_centered_over_d_model_is_caught(model):
    cfg, sd = model
    toks = default_tokens(cfg)
    # what the wrong centering subtracts, mean_d(x) * mean_d(W_U), differs between tokens
    assert_caught(UNEMBED, "over_d_model", sd, cfg, toks, "centering W_U over d_model", logits=VISIBLE)
    wrong, wrong_cfg = UNEMBED.wrong_everywhere["over_d_model"](sd, cfg)
    error, tolerance = _shift_spread(sd, cfg, wrong, wrong_cfg, toks)
    assert error > tolerance, "the logit-shift property did not notice a shift that is not constant"


@pytest.mark.parametrize("transform", [cm.center_writing_weights, cm.center_unembed])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transforms_are_pure_keep_dtypes_and_refuse_a_second_application(transform, dtype):
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=16,
                    normalization_type="LNPre", gated_mlp=True)
    sd = cm.random_state_dict(cfg, seed=1, dtype=dtype)
    before = snapshot(sd)
    out, out_cfg = transform(sd, cfg)
    assert same(sd, before) and cfg.applied == ()
    assert {t.dtype for t in out.values()} == {dtype}
    cm.validate_state_dict(out, out_cfg)
    name = out_cfg.applied[-1]
    with pytest.raises(cm.AlreadyAppliedError, match=name):
        transform(out, out_cfg)


def test_bad_state_dicts_are_refused_before_anything_is_computed():
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=16, normalization_type="LNPre")
    sd = cm.random_state_dict(cfg, seed=0)
    del sd["blocks.0.attn.W_O"]
    for transform in (cm.center_writing_weights, cm.center_unembed):
        with pytest.raises(cm.StateDictError, match="missing keys"):
            transform(sd, cfg)


def test_proofs_use_symbolic_dimensions():
    for identity in (WRITING, UNEMBED):
        assert identity.proof.symbolic_dims, identity.name
