"""LayerNorm folding and reading-weight centering on random weights with realistic structure."""

import pytest
import torch
from hypothesis import given, strategies as st
from hypothesis.errors import InvalidArgument

import circuitmath as cm
from circuitmath.strategies import configs, models, state_dicts, tokens
from circuitmath.testing import compare_log_probs, default_tokens
from support import VISIBLE, assert_caught, same, snapshot, wide

FOLDABLE = dict(normalization_types=("LN",), gated_mlp=(False,))
LN_FOLD = cm.get_identity("fold_layer_norm")
CENTER = cm.get_identity("center_reading_weights")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@given(data=st.data())
def test_fold_preserves_log_probs(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **FOLDABLE)))
    toks = data.draw(tokens(cfg))
    result = LN_FOLD.check(sd, cfg, toks)
    assert result.passed, result


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@given(data=st.data())
def test_centering_reading_weights_preserves_log_probs(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **FOLDABLE)))
    toks = data.draw(tokens(cfg))
    result = CENTER.check(sd, cfg, toks)
    assert result.passed, result
    folded, folded_cfg = cm.fold_layer_norm(sd, cfg, center_reading_weights=True)
    for name in ("unembed.W_U",):
        assert folded[name].mean(dim=0).abs().max() <= 64 * torch.finfo(dtype).eps * folded[name].abs().max()
    assert folded_cfg.applied[-2:] == ("fold_layer_norm", "center_reading_weights")


# The wrong folds differ from the right one only where gains are not all 1 and biases not 0.
DISCRIMINATING = dict(min_gain_spread=0.3, min_bias_scale=0.5)


@given(models(**wide(weights=DISCRIMINATING, **FOLDABLE)), st.sampled_from(list(LN_FOLD.wrong_everywhere)))
def test_negative_control_wrong_fold_is_caught(model, wrong_name):
    cfg, sd = model
    toks = default_tokens(cfg)
    assert_caught(LN_FOLD, wrong_name, sd, cfg, toks, wrong_name, weights=VISIBLE)


# Centering W_U over the vocabulary is harmless (softmax is shift invariant), so the wrong-axis
# centering only shows in a model with at least one layer.
@given(models(**wide(weights=DISCRIMINATING, min_layers=1, **FOLDABLE)), st.sampled_from(list(CENTER.wrong_everywhere)))
def test_negative_control_wrong_centering_is_caught(model, wrong_name):
    cfg, sd = model
    toks = default_tokens(cfg)
    assert_caught(CENTER, wrong_name, sd, cfg, toks, wrong_name, weights=VISIBLE)


@given(models(**wide(dtype=torch.float32, **FOLDABLE)), st.booleans())
def test_fold_is_pure_and_keeps_dtypes(model, center):
    cfg, sd = model
    before = snapshot(sd)
    folded, folded_cfg = cm.fold_layer_norm(sd, cfg, center_reading_weights=center)
    assert same(sd, before), "the input state dict was modified"
    assert cfg.normalization_type == "LN" and cfg.applied == ()
    assert {t.dtype for t in folded.values()} == {torch.float32}
    assert not any(k.endswith((".w", ".b")) and ".ln" in k or k.startswith("ln_final") for k in folded)
    cm.validate_state_dict(folded, folded_cfg)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fold_keeps_float64_and_bfloat16(dtype):
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=4, d_mlp=8)
    sd = cm.random_state_dict(cfg, seed=3, dtype=dtype)
    folded, _ = cm.fold_layer_norm(sd, cfg, center_reading_weights=True)
    assert {t.dtype for t in folded.values()} == {dtype}


@given(models(**wide(**FOLDABLE)))
def test_double_application_is_refused(model):
    cfg, sd = model
    folded, folded_cfg = cm.fold_layer_norm(sd, cfg, center_reading_weights=True)
    with pytest.raises(cm.AlreadyAppliedError, match="fold_layer_norm"):
        cm.fold_layer_norm(folded, folded_cfg.replace(normalization_type="LN"))
    with pytest.raises(cm.AlreadyAppliedError, match="center_reading_weights"):
        cm.center_reading_weights(folded, folded_cfg)


REFUSALS = [
    (dict(normalization_types=("LN",), norm_positions=("post",), positional_embedding_types=("standard", "rotary")),
     "fold_layer_norm", "pre-norm"),
    (dict(normalization_types=("RMS", "RMSPre", "LNPre", None), positional_embedding_types=("standard", "rotary")),
     "fold_layer_norm", "normalization_type is LN"),
]


@pytest.mark.parametrize("options, identity, precondition", REFUSALS, ids=["post-norm", "not-LN"])
@given(data=st.data())
def test_fold_refuses_what_it_cannot_rewrite_exactly(options, identity, precondition, data):
    cfg, sd = data.draw(models(**wide(**options)))
    before = snapshot(sd)
    with pytest.raises(cm.PreconditionError) as info:
        cm.fold_layer_norm(sd, cfg)
    assert info.value.identity == identity and info.value.precondition == precondition
    assert identity in str(info.value) and precondition in str(info.value)
    assert same(sd, before)


@given(models(**wide(normalization_types=("LN", "RMS", "RMSPre", None), positional_embedding_types=("standard", "rotary", "shortformer_tables"))))
def test_centering_refuses_readers_whose_input_is_not_centered(model):
    cfg, sd = model
    with pytest.raises(cm.PreconditionError) as info:
        cm.center_reading_weights(sd, cfg)
    assert info.value.identity == "center_reading_weights"
    if cfg.normalization_type == "LN":
        assert "fold the LayerNorm first" in info.value.detail


@given(models(**wide(normalization_types=("LN",), positional_embedding_types=("standard",), gated_mlp=(True,),
              attn_only=False, min_layers=1)))
def test_gated_mlp_fold_is_exact_without_ln2_bias_and_refused_with_it(model):
    cfg, sd = model
    with pytest.raises(cm.PreconditionError, match="W_gate has no bias"):
        cm.fold_layer_norm(sd, cfg)
    unbiased = {k: (torch.zeros_like(v) if k.endswith("ln2.b") else v) for k, v in sd.items()}
    folded, folded_cfg = cm.fold_layer_norm(unbiased, cfg)
    assert compare_log_probs(unbiased, cfg, folded, folded_cfg).passed


def test_shortformer_naive_fold_changes_the_model_and_ours_does_not():
    """Folding ln1's gain into W_Q also scales W_pos, added after ln1: the naive fold is wrong."""
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=None,
                    positional_embedding_type="shortformer")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    naive, naive_cfg = cm.fold_layer_norm(sd, cfg.replace(positional_embedding_type="standard"))
    naive_cfg = naive_cfg.replace(positional_embedding_type="shortformer")
    result = compare_log_probs(sd, cfg, naive, naive_cfg)
    assert result.max_abs_error > 1e3 * result.tolerance
    folded, folded_cfg = cm.fold_layer_norm(sd, cfg, center_reading_weights=True)
    assert folded_cfg.applied == ("shortformer_to_tables", "fold_layer_norm", "center_reading_weights")
    assert compare_log_probs(sd, cfg, folded, folded_cfg).passed


@given(data=st.data())
def test_state_dicts_honour_the_structure_options(data):
    cfg = data.draw(configs(**wide(normalization_types=("LN",), min_layers=1)))
    sd = data.draw(state_dicts(cfg, min_gain_spread=0.5, min_bias_scale=1.0))
    gains = torch.cat([v for k, v in sd.items() if k.endswith(".w")])
    assert not torch.all(gains == 1)
    flat = data.draw(state_dicts(cfg, max_gain_spread=0.0, max_outlier_dims=0))
    assert torch.all(torch.cat([v for k, v in flat.items() if k.endswith(".w")]).abs() == 1)


@pytest.mark.parametrize("call", [
    lambda: configs(min_layers=3, max_layers=1),
    lambda: configs(normalization_types=("BatchNorm",)),
    lambda: configs(normalization_types=()),
    lambda: state_dicts("not a config"),
    lambda: state_dicts(cm.Config(n_layers=0, d_model=2, n_heads=1, d_head=1, d_vocab=2, n_ctx=1), dtype=torch.int64),
    lambda: models(weights={"min_gain_spread": 2.0, "max_gain_spread": 1.0}),
    lambda: state_dicts(cm.Config(n_layers=0, d_model=2, n_heads=1, d_head=1, d_vocab=2, n_ctx=1), min_bias_scale=-1.0),
    lambda: state_dicts(cm.Config(n_layers=0, d_model=2, n_heads=1, d_head=1, d_vocab=2, n_ctx=1),
                        max_bias_scale=float("nan")),
    lambda: configs(max_layers=1.5),
])
def test_strategies_validate_arguments_when_called(call):
    with pytest.raises(InvalidArgument):
        call()
