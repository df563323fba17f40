"""RMSNorm folding, LayerNorm to RMSNorm, the centering projection and scale invariance."""

import re

import pytest
import torch
from hypothesis import given, strategies as st

import circuitmath as cm
from circuitmath._identities.norms import with_explicit_eps
from circuitmath._processing import writers
from circuitmath.strategies import models, tokens
from circuitmath.testing import compare_log_probs, default_tokens
from support import VISIBLE, assert_caught, same, snapshot, wide

RMS_FOLD = cm.get_identity("fold_rms_norm")
LN_TO_RMS = cm.get_identity("layer_norm_to_rms_norm")
PROJECTION = cm.get_identity("centering_projection")
SCALE = cm.get_identity("rescale_residual_stream")
RMS_FOLDABLE = dict(normalization_types=("RMS",), positional_embedding_types=("standard", "rotary"))
DISCRIMINATING = dict(min_gain_spread=0.3, min_bias_scale=0.5)
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
OUR_IDENTITIES = ("centering_projection", "rescale_residual_stream", "layer_norm_to_rms_norm", "fold_rms_norm")


# A LayerNorm model must be foldable to reach LNPre: no gated MLP (W_gate has no bias to absorb
# ln2.b) and no shortformer W_pos behind ln1. An LNPre model can be anything.
LAYER_NORM_MODELS = dict(
    LN=dict(normalization_types=("LN",), gated_mlp=(False,), positional_embedding_types=("standard", "rotary")),
    LNPre=dict(normalization_types=("LNPre",)),
)


def _layer_norm_models(**options):
    return st.one_of(*(models(**wide(**kind, **options)) for kind in LAYER_NORM_MODELS.values()))


def _eps_free(model):
    cfg, state_dict = model
    return cfg.replace(eps=0.0), state_dict


# -- RMSNorm folding ---------------------------------------------------------------------------


@DTYPES
@given(data=st.data())
def test_rms_fold_preserves_log_probs(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **RMS_FOLDABLE)))
    result = RMS_FOLD.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, result
    folded, folded_cfg = cm.fold_rms_norm(sd, cfg)
    assert folded_cfg.normalization_type == "RMSPre" and folded_cfg.applied == ("fold_rms_norm",)
    assert not any(".ln" in k or k.startswith("ln_final") for k in folded)
    cm.validate_state_dict(folded, folded_cfg)


# A forgotten gain in W_gate shows where the gate is active: relu gates can all be shut (zero in
# both models), gelu gates never are.
@given(models(**wide(gated_mlp=(True,), attn_only=False, min_layers=1, act_fns=("gelu", "gelu_new"), weights=DISCRIMINATING,
              **RMS_FOLDABLE)))
def test_rms_fold_reaches_W_gate(model):
    cfg, sd = model
    toks = default_tokens(cfg)
    assert RMS_FOLD.check(sd, cfg, toks).passed
    assert_caught(RMS_FOLD, "forget_W_gate", sd, cfg, toks, "a fold that forgets W_gate", weights=VISIBLE)


@given(models(**wide(weights=DISCRIMINATING, **RMS_FOLDABLE)))
def test_negative_control_centering_behind_rms_norm_is_caught(model):
    cfg, sd = model
    toks = default_tokens(cfg)
    assert_caught(RMS_FOLD, "center_reading_weights", sd, cfg, toks, "centering readers behind RMSNorm", weights=VISIBLE)


RMS_FOLD_REFUSALS = [
    (dict(normalization_types=("LN", "LNPre", "RMSPre", None), positional_embedding_types=("standard", "rotary")),
     "normalization_type is RMS"),
    (dict(normalization_types=("RMS",), norm_positions=("post",), positional_embedding_types=("standard", "rotary")),
     "pre-norm"),
    (dict(normalization_types=("RMS",), positional_embedding_types=("shortformer",), min_layers=1),
     "norm output read only by linear maps"),
]


@pytest.mark.parametrize("options, precondition", RMS_FOLD_REFUSALS, ids=["not-RMS", "post-norm", "shortformer"])
@given(data=st.data())
def test_rms_fold_refuses_what_it_cannot_rewrite_exactly(options, precondition, data):
    cfg, sd = data.draw(models(**wide(**options)))
    before = snapshot(sd)
    with pytest.raises(cm.PreconditionError) as info:
        cm.fold_rms_norm(sd, cfg)
    assert info.value.identity == "fold_rms_norm" and info.value.precondition == precondition
    assert same(sd, before)


# -- LayerNorm to RMSNorm ---------------------------------------------------------------------


@DTYPES
@given(data=st.data())
def test_layer_norm_to_rms_norm_preserves_log_probs_once_writes_are_centered(dtype, data):
    cfg, sd = data.draw(_layer_norm_models(dtype=dtype))
    result = LN_TO_RMS.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, result
    centered, centered_cfg = LN_TO_RMS.prepare(sd, cfg)
    switched, switched_cfg = cm.layer_norm_to_rms_norm(centered, centered_cfg)
    assert switched_cfg.normalization_type == "RMSPre" and switched_cfg.eps == cfg.eps
    assert switched_cfg.applied[-1] == "layer_norm_to_rms_norm"
    assert all(switched[k] is centered[k] for k in centered), "the weights must not change"


@given(_layer_norm_models())
def test_negative_control_rms_norm_with_another_eps_is_caught(model):
    cfg, sd = model
    toks = default_tokens(cfg)
    # no weight changes, only eps: its effect, about eps / mean(x^2) of each normed stream, must
    # reach the logits
    assert_caught(LN_TO_RMS, "other_eps", sd, cfg, toks, "switching eps", logits=VISIBLE)


@given(models(**wide(normalization_types=("LNPre",), weights=dict(max_outlier_dims=0))))
def test_layer_norm_to_rms_norm_refuses_uncentered_writes(model):
    cfg, sd = model
    before = snapshot(sd)
    with pytest.raises(cm.PreconditionError) as info:
        cm.layer_norm_to_rms_norm(sd, cfg)
    assert info.value.precondition == "every write to the residual stream is centered"
    assert "center_writing_weights" in info.value.detail
    assert same(sd, before)


def test_switching_uncentered_writes_is_not_a_formality():
    """Switching LNPre to RMSPre without centering the writes really does change the model."""
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=16, normalization_type="LNPre")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    result = compare_log_probs(sd, cfg, sd, cfg.replace(normalization_type="RMSPre"))
    assert result.max_abs_error > 1e3 * result.tolerance


@pytest.mark.parametrize("normalization, precondition", [
    ("LN", "normalization_type is LNPre"), ("RMS", "normalization_type is LNPre"),
    ("RMSPre", "normalization_type is LNPre"), (None, "normalization_type is LNPre"),
])
def test_layer_norm_to_rms_norm_needs_lnpre(normalization, precondition):
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, normalization_type=normalization)
    with pytest.raises(cm.PreconditionError) as info:
        cm.layer_norm_to_rms_norm(cm.random_state_dict(cfg, seed=0), cfg)
    assert info.value.precondition == precondition
    assert ("fold_layer_norm" in info.value.detail) == (normalization == "LN")


def test_layer_norm_to_rms_norm_refuses_post_norm():
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, normalization_type="LNPre",
                    norm_position="post")
    with pytest.raises(cm.PreconditionError, match="pre-norm"):
        cm.layer_norm_to_rms_norm(cm.random_state_dict(cfg, seed=0), cfg)


# -- the centering projection -------------------------------------------------------------------


@given(models(**wide(weights=DISCRIMINATING, normalization_types=("LN", "LNPre"))))
def test_projection_licenses_centering_writes_and_the_notes_slip_is_caught(model):
    cfg, sd = model
    toks = default_tokens(cfg)
    assert PROJECTION.check(sd, cfg, toks).passed
    assert_caught(PROJECTION, "keep_only_the_mean", sd, cfg, toks, "keeping only the mean", weights=VISIBLE)


# -- scale invariance --------------------------------------------------------------------------

SCALABLE = dict(normalization_types=("LN", "LNPre", "RMS", "RMSPre"))


@DTYPES
@given(data=st.data(), scale=st.floats(1e-3, 1e3))
def test_rescaling_the_stream_preserves_log_probs_when_eps_is_zero(dtype, data, scale):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **SCALABLE)).map(_eps_free))
    toks = data.draw(tokens(cfg))
    assert SCALE.check(sd, cfg, toks).passed
    scaled, scaled_cfg = cm.rescale_residual_stream(sd, cfg, scale=scale)
    result = compare_log_probs(sd, cfg, scaled, scaled_cfg, toks)
    assert result.passed, result
    assert scaled_cfg.applied == ("rescale_residual_stream",)
    assert all(scaled[k] is sd[k] for k in sd if k not in writers(cfg))


# Over two dimensions LNPre keeps only a sign, so a flipped stream can end on the same side; from
# three dimensions on the flip shows.
@given(models(**wide(**SCALABLE)).map(_eps_free).filter(lambda model: model[0].d_model >= 3))
def test_negative_control_negative_scale_is_caught(model):
    cfg, sd = model
    toks = default_tokens(cfg)
    # the writers always change sign; the flip must reach the logits (LNPre is odd, not even)
    assert_caught(SCALE, "negative_scale", sd, cfg, toks, "a sign flip of the stream", logits=VISIBLE)


@given(models(**wide(**SCALABLE)), st.floats(1e-6, 1e-2))
def test_rescaling_refuses_eps_above_zero(model, eps):
    cfg, sd = model
    with pytest.raises(cm.PreconditionError) as info:
        cm.rescale_residual_stream(sd, cfg.replace(eps=eps), scale=2.0)
    assert info.value.identity == "rescale_residual_stream" and info.value.precondition == "eps == 0"


def test_eps_above_zero_really_breaks_scale_invariance():
    """The same rescale of a model with eps > 0 changes its log-probs: the refusal protects."""
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=16)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    scaled, scaled_cfg = cm.rescale_residual_stream(sd, cfg.replace(eps=0.0), scale=1e-2)
    result = compare_log_probs(sd, cfg, scaled, scaled_cfg.replace(eps=cfg.eps))
    assert result.max_abs_error > 1e3 * result.tolerance


@pytest.mark.parametrize("scale", [0.0, -2.0, -0.0])
def test_rescaling_refuses_a_scale_that_is_not_positive(scale):
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, eps=0.0)
    with pytest.raises(cm.PreconditionError, match="the norms are odd") as info:
        cm.rescale_residual_stream(cm.random_state_dict(cfg, seed=0), cfg, scale=scale)
    assert (info.value.identity, info.value.precondition) == ("rescale_residual_stream", "scale > 0")


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), float("-inf"), "2", True, None])
def test_rescaling_refuses_a_scale_that_is_not_a_finite_number(scale):
    """Not a precondition of the identity but a bad argument, named as such: an infinite scale
    passes ``scale > 0`` and would write Inf into every writer, a NaN fails it for the wrong reason."""
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, eps=0.0)
    message = rf"^scale must be a finite number, got {re.escape(repr(scale))}$"
    with pytest.raises(cm.InputError, match=message) as info:
        cm.rescale_residual_stream(cm.random_state_dict(cfg, seed=0), cfg, scale=scale)
    assert not isinstance(info.value, cm.PreconditionError)


@pytest.mark.parametrize("options, precondition", [
    (dict(normalization_type=None), "every reader sits behind a norm"),
    (dict(norm_position="post"), "pre-norm"),
])
def test_rescaling_refuses_readers_without_a_norm(options, precondition):
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, eps=0.0, **options)
    with pytest.raises(cm.PreconditionError) as info:
        cm.rescale_residual_stream(cm.random_state_dict(cfg, seed=0), cfg, scale=2.0)
    assert info.value.precondition == precondition


# -- symbolic ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fold_layer_norm", "fold_rms_norm"])
def test_folds_stay_exact_with_eps_written_out(name):
    """The folds hold for any normaliser, so also for (q/d + eps)^(-1/2) with eps > 0."""
    proof = with_explicit_eps(cm.get_identity(name).proof)
    assert any("varepsilon" in d.latex() for d in (*proof.definitions, *proof.facts)), "eps was not written out"
    report = proof.verify(name)
    assert report.ok and report.symbolic_dims, report.as_dict()


def test_scale_invariance_twin_with_eps_is_the_rejected_one():
    report = SCALE.prove()
    twins = {t.name: t for t in report.twins}
    assert twins["with_eps"].rejected and twins["negative_scale"].rejected


def test_proofs_use_symbolic_dimensions():
    for name in OUR_IDENTITIES:
        assert cm.get_identity(name).proof.symbolic_dims, name


@pytest.mark.parametrize("transform", [
    cm.fold_rms_norm, cm.layer_norm_to_rms_norm, lambda sd, cfg: cm.rescale_residual_stream(sd, cfg, scale=3.0),
], ids=["fold_rms_norm", "layer_norm_to_rms_norm", "rescale_residual_stream"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transforms_are_pure_keep_dtypes_and_refuse_a_second_application(transform, dtype):
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=16,
                    gated_mlp=True, normalization_type="RMS", eps=0.0)
    sd = cm.random_state_dict(cfg, seed=1, dtype=dtype)
    if transform is cm.layer_norm_to_rms_norm:
        cfg = cfg.replace(normalization_type="LNPre")
        sd, cfg = cm.center_writing_weights(cm.random_state_dict(cfg, seed=1, dtype=dtype), cfg)
    before = snapshot(sd)
    out, out_cfg = transform(sd, cfg)
    assert same(sd, before)
    assert {t.dtype for t in out.values()} == {dtype}
    cm.validate_state_dict(out, out_cfg)
    with pytest.raises(cm.AlreadyAppliedError, match=out_cfg.applied[-1]):
        transform(out, out_cfg)
