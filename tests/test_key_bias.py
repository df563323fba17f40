"""Removing key biases: exact without rotary embeddings, refused (and really wrong) with them."""

import pytest
import torch
from hypothesis import given, strategies as st

import circuitmath as cm
from circuitmath._identities.attention_biases import key_bias_scores_proof
from circuitmath.strategies import models, tokens
from circuitmath.testing import compare_log_probs, default_tokens
from support import DISCRIMINATING_WEIGHTS, VISIBLE, assert_caught, discrimination, same, snapshot, wide

REMOVE = cm.get_identity("remove_key_biases")
UNROTATED = dict(norm_positions=("pre", "post"), positional_embedding_types=("standard", "shortformer"))

def _key_bias(cfg):
    return "_b_K" if cfg.n_key_value_heads else "b_K"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@given(data=st.data())
def test_removal_preserves_log_probs(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **UNROTATED)))
    result = REMOVE.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, result


@given(models(**wide(dtype=torch.float32, **UNROTATED)))
def test_removal_zeroes_key_biases_only_and_is_pure(model):
    cfg, sd = model
    before = snapshot(sd)
    out, out_cfg = cm.remove_key_biases(sd, cfg)
    assert same(sd, before), "the input state dict was modified"
    assert out_cfg.applied == ("remove_key_biases",) and cfg.applied == ()
    for key, value in out.items():
        if key.endswith(f".{_key_bias(cfg)}"):
            assert value.dtype == torch.float32 and not value.any()
        else:
            assert value is sd[key]
    with pytest.raises(cm.AlreadyAppliedError, match="remove_key_biases"):
        cm.remove_key_biases(out, out_cfg)


@pytest.mark.parametrize("seed", range(3))
def test_removal_is_exact_with_bidirectional_attention(seed):
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=5, d_mlp=8,
                    causal=False, norm_position="post")
    sd = cm.random_state_dict(cfg, seed=seed, dtype=torch.float64)
    toks = default_tokens(cfg)
    assert REMOVE.check(sd, cfg, toks).passed
    assert discrimination(REMOVE, "drop_query_biases", sd, cfg, toks).pattern > VISIBLE
    assert not REMOVE.check_wrong_rewrite("drop_query_biases", sd, cfg, toks).passed


@given(models(**wide(positional_embedding_types=("rotary",))))
def test_rotary_models_are_refused(model):
    cfg, sd = model
    before = snapshot(sd)
    with pytest.raises(cm.PreconditionError) as info:
        cm.remove_key_biases(sd, cfg)
    assert info.value.identity == "remove_key_biases"
    assert info.value.precondition == "keys and queries are not rotated by position"
    assert "rotary" in info.value.detail
    assert same(sd, before)


@pytest.mark.parametrize("n_key_value_heads", [None, 1])
def test_rotary_refusal_is_not_a_formality(n_key_value_heads):
    """Dropping b_K from a rotary model changes it: the rotated bias differs from key to key."""
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=None,
                    positional_embedding_type="rotary", n_key_value_heads=n_key_value_heads)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    bias = f"blocks.0.attn.{_key_bias(cfg)}"
    naive = {**sd, bias: torch.zeros_like(sd[bias])}
    result = compare_log_probs(sd, cfg, naive, cfg)
    assert result.max_abs_error > 1e3 * result.tolerance, result


# Dropping the query bias instead moves each score by b_Q . k_j / sqrt(d_head), which differs
# from key to key; it shows only with a layer, at least two positions (a single key is always
# attended to with weight 1) and d_model >= 3 (see test_value_biases.py), and only where the
# pattern is not saturated: a model without a norm can have a one-hot softmax (an off-diagonal
# weight of 7e-26) that no change of scores moves. So the draw must first show that the wrong
# rewrite moves some attention weight.
@given(models(**wide(min_layers=1, weights=DISCRIMINATING_WEIGHTS, **UNROTATED)).filter(
    lambda model: model[0].d_model >= 3 and model[0].n_ctx >= 2))
def test_negative_control_dropping_query_biases_is_caught(model):
    cfg, sd = model
    toks = default_tokens(cfg)
    assert_caught(REMOVE, "drop_query_biases", sd, cfg, toks, "drop_query_biases", weights=VISIBLE, pattern=VISIBLE)


def test_score_lemma_is_proved_with_symbolic_dims_and_its_twin_rejected():
    report = key_bias_scores_proof().verify("key_bias_scores")
    assert report.ok and report.symbolic_dims and report.concrete_check
    assert [t.name for t in report.twins] == ["drop_query_bias_too"]
    assert REMOVE.proof.symbolic_dims
