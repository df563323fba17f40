"""circuitmath's pipeline against TransformerLens 4.3.0's ``ProcessWeights.process_weights``.

Needs the ``peers`` extra, which ``make test`` installs: no test here is skipped. Both processed
models run through circuitmath's reference forward pass (TransformerLens keeps a folded norm
with gain 1 and bias 0, so its result runs with the original config). Where both are valid they
agree within :mod:`circuitmath.testing`'s tolerance; every known divergence has a test that
asserts it, as measured, so a TransformerLens release that fixes one fails it (then update it).
"""

import importlib.metadata

import pytest
import torch
from hypothesis import given, strategies as st

import circuitmath as cm
from circuitmath.peers import transformer_lens_config, transformer_lens_process_weights
from circuitmath.strategies import models, tokens

from support import wide
from circuitmath.testing import compare_log_probs
from transformer_lens.weight_processing import ProcessWeights


# The shapes TransformerLens reads a weight's axes from are ambiguous when two sizes are equal
# (see test_square_reader_is_folded_along_the_wrong_axis); agreement is tested away from that.
def _unambiguous(cfg: cm.Config) -> bool:
    return cfg.d_model not in (cfg.d_vocab, cfg.d_mlp)


# Where both libraries are valid: pre-norm, no shortformer, no LayerNorm bias in front of a W_gate.
BOTH_VALID = dict(positional_embedding_types=("standard", "rotary"))


def _both_valid(model) -> bool:
    cfg, sd = model
    ln_gate_bias = cfg.normalization_type == "LN" and cfg.gated_mlp
    return _unambiguous(cfg) and not ln_gate_bias


def test_the_peer_is_the_version_these_divergences_were_measured_on():
    assert importlib.metadata.version("transformer-lens") == "4.3.0"


@given(data=st.data())
def test_we_agree_with_transformer_lens_where_both_are_valid(data):
    cfg, sd = data.draw(models(**wide(dtype=torch.float32, **BOTH_VALID)).filter(_both_valid))
    toks = data.draw(tokens(cfg))
    ours, ours_cfg = cm.process_weights(sd, cfg, **dict.fromkeys(
        ["fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases"]))
    theirs = transformer_lens_process_weights(sd, cfg)
    assert theirs.keys() == sd.keys()
    for before, before_cfg, after, after_cfg in (
        (sd, cfg, ours, ours_cfg), (sd, cfg, theirs, cfg), (theirs, cfg, ours, ours_cfg)
    ):
        result = compare_log_probs(before, before_cfg, after, after_cfg, toks)
        assert result.passed, result


@given(models(**wide(dtype=torch.float32, normalization_types=("LN",), gated_mlp=(False,), **BOTH_VALID))
       .filter(_both_valid))
def test_on_layer_norm_models_both_reach_the_same_weights(model):
    """Same steps, same canonical form: every tensor agrees to float32 rounding."""
    cfg, sd = model
    ours, _ = cm.process_weights(sd, cfg)
    theirs = transformer_lens_process_weights(sd, cfg)
    scale = max(float(t.abs().max()) for t in ours.values())
    for name, tensor in ours.items():
        assert torch.allclose(tensor, theirs[name], rtol=0, atol=1e-4 * scale), name
    assert all(theirs[k].eq(1).all() for k in theirs if k.endswith(".w") and k not in ours)
    assert all(theirs[k].eq(0).all() for k in theirs if k.endswith(".b") and k not in ours)


@pytest.mark.parametrize("seed", range(3))
def test_refactoring_agrees_on_a_gpt2_layout(seed):
    cfg = cm.Config(n_layers=2, d_model=16, n_heads=4, d_head=4, d_vocab=20, n_ctx=8, d_mlp=32)
    sd = cm.random_state_dict(cfg, seed=seed)
    ours, ours_cfg = cm.process_weights(sd, cfg, refactor_factored_attn_matrices=True)
    theirs = transformer_lens_process_weights(sd, cfg, refactor_factored_attn_matrices=True)
    assert compare_log_probs(sd, cfg, theirs, cfg).passed
    assert compare_log_probs(theirs, cfg, ours, ours_cfg).passed


# -- divergences, each as measured on 4.3.0 ----------------------------------------------------

SMALL = cm.Config(n_layers=2, d_model=16, n_heads=4, d_head=4, d_vocab=20, n_ctx=8, d_mlp=32)


@pytest.mark.parametrize("seed", range(3))
def test_float64_is_processed_in_float32(seed):
    """TransformerLens casts every tensor that is not float32 to float32 and back: float64
    weights come back float64 but with float32 rounding (~1e-7 in log-probs, not ~1e-15)."""
    sd = cm.random_state_dict(SMALL, seed=seed, dtype=torch.float64)
    theirs = transformer_lens_process_weights(sd, SMALL)
    assert {t.dtype for t in theirs.values()} == {torch.float64}
    theirs_error = compare_log_probs(sd, SMALL, theirs, SMALL)
    ours_error = compare_log_probs(sd, SMALL, *cm.process_weights(sd, SMALL))
    assert ours_error.passed and ours_error.max_abs_error < 1e-13
    assert not theirs_error.passed and 1e-8 < theirs_error.max_abs_error < 1e-5, theirs_error


def test_the_mapping_passed_in_is_rewritten():
    """Not a tensor is modified, but entries of the mapping passed in are replaced: every one by a
    float32 copy for float64 weights, and the centered writers when the LayerNorm is not folded."""
    for dtype, flags, replaced in ((torch.float64, {}, len(cm.expected_shapes(SMALL))),
                                   (torch.float32, dict(fold_ln=False), len(cm._processing.writers(SMALL)))):
        sd = cm.random_state_dict(SMALL, seed=0, dtype=dtype)
        passed_in = dict(sd)
        ProcessWeights.process_weights(passed_in, transformer_lens_config(SMALL, dtype), **flags)
        assert sum(passed_in[k] is not sd[k] for k in sd) == replaced, (dtype, flags)
        assert all(torch.equal(v, cm.random_state_dict(SMALL, seed=0, dtype=dtype)[k]) for k, v in sd.items())
        if dtype == torch.float64:
            assert {t.dtype for t in passed_in.values()} == {torch.float32}


@pytest.mark.parametrize("seed", range(3))
def test_shortformer_outputs_change(seed):
    """W_pos is added after ln1, so folding ln1's gain into W_Q scales it too, and centering it
    changes the queries and keys: the outputs move by O(1). circuitmath moves W_pos into
    per-layer query and key tables first and leaves it uncentered."""
    cfg = SMALL.replace(positional_embedding_type="shortformer")
    sd = cm.random_state_dict(cfg, seed=seed, dtype=torch.float32)
    theirs = compare_log_probs(sd, cfg, transformer_lens_process_weights(sd, cfg), cfg)
    assert theirs.max_abs_error > 0.3, theirs
    assert compare_log_probs(sd, cfg, *cm.process_weights(sd, cfg)).passed


@pytest.mark.parametrize("layout", [dict(), dict(embedding_norm=True, causal=False)], ids=["post-ln", "bert"])
def test_post_norm_layer_norms_are_folded_anyway(layout):
    """TransformerLensConfig cannot say that a model is post-norm, and process_weights folds each
    LayerNorm into the next block's readers, which do not read it alone (the bridge switches
    fold_ln off for BERT's adapter, with a warning). circuitmath refuses the fold."""
    cfg = SMALL.replace(norm_position="post", **layout)
    sd = cm.random_state_dict(cfg, seed=0)
    theirs = compare_log_probs(sd, cfg, transformer_lens_process_weights(sd, cfg), cfg)
    assert theirs.max_abs_error > 0.3, theirs
    with pytest.raises(cm.PreconditionError, match="pre-norm"):
        cm.process_weights(sd, cfg, fold_ln=True, center_writing_weights=False)
    assert compare_log_probs(sd, cfg, *cm.process_weights(sd, cfg, fold_ln=None, center_writing_weights=None)).passed


@pytest.mark.parametrize("sizes", [dict(d_mlp=16), dict(d_vocab=16), dict(d_vocab=16, d_mlp=None)],
                         ids=["d_mlp=d_model", "d_vocab=d_model", "d_vocab=d_model-attn-only"])
def test_square_reader_is_folded_along_the_wrong_axis(sizes):
    """TransformerLens tells W_in [d_model, d_mlp] and W_U [d_model, d_vocab] from their
    transposes by their shapes; when d_mlp or d_vocab equals d_model it scales the output axis
    by the gain instead of the input axis."""
    cfg = SMALL.replace(**sizes)
    for normalization in ("LN", "RMS"):
        model_cfg = cfg.replace(normalization_type=normalization)
        sd = cm.random_state_dict(model_cfg, seed=0)
        theirs = compare_log_probs(sd, model_cfg, transformer_lens_process_weights(
            sd, model_cfg, center_writing_weights=normalization == "LN"), model_cfg)
        assert theirs.max_abs_error > 0.1, (normalization, theirs)
        ours = cm.process_weights(sd, model_cfg, center_writing_weights=None)
        assert compare_log_probs(sd, model_cfg, *ours).passed


def test_layer_norm_bias_in_front_of_W_gate_becomes_a_new_gate_bias():
    """A gated MLP has no gate bias to absorb ln2.b @ W_gate; TransformerLens adds one
    (mlp.b_gate), a parameter the architecture does not have. circuitmath refuses the fold."""
    cfg = SMALL.replace(gated_mlp=True)
    sd = cm.random_state_dict(cfg, seed=0)
    theirs = transformer_lens_process_weights(sd, cfg)
    added = sorted(set(theirs) - set(sd))
    assert added == [f"blocks.{layer}.mlp.b_gate" for layer in range(cfg.n_layers)]
    assert all(theirs[name].abs().max() > 0.1 for name in added)
    with pytest.raises(cm.PreconditionError, match="W_gate has no bias"):
        cm.process_weights(sd, cfg, fold_ln=True)
    assert "fold_layer_norm" not in cm.process_weights(sd, cfg)[1].applied  # by default: what is exact


def test_refactoring_a_grouped_query_model_is_an_error():
    """Its refactoring looks for W_K, not the shared _W_K, and stops; circuitmath refactors each
    group of query heads against its shared key and value head."""
    cfg = SMALL.replace(n_key_value_heads=2)
    sd = cm.random_state_dict(cfg, seed=0)
    with pytest.raises(ValueError, match="W_K' missing"):
        transformer_lens_process_weights(sd, cfg, refactor_factored_attn_matrices=True)
    assert compare_log_probs(sd, cfg, *cm.process_weights(sd, cfg, refactor_factored_attn_matrices=True)).passed
