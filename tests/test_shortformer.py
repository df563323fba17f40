"""Shortformer: positions reach only queries and keys; moving them into tables is exact."""

import pytest
import torch
from hypothesis import given, strategies as st

import circuitmath as cm
from circuitmath.strategies import models, tokens
from circuitmath.testing import compare_log_probs, default_tokens
from support import VISIBLE, assert_caught, wide

SHORTFORMER = dict(positional_embedding_types=("shortformer",), gated_mlp=(False,))
IDENTITY = cm.get_identity("shortformer_to_tables")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@given(data=st.data())
def test_tables_preserve_log_probs(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **SHORTFORMER)))
    result = IDENTITY.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, result


@given(models(**wide(normalization_types=("LN",), **SHORTFORMER)), st.booleans())
def test_layer_norm_folds_exactly_in_shortformer_models(model, center):
    cfg, sd = model
    before = {k: v.clone() for k, v in sd.items()}
    folded, folded_cfg = cm.fold_layer_norm(sd, cfg, center_reading_weights=center)
    assert folded_cfg.positional_embedding_type == "shortformer_tables"
    assert folded_cfg.applied[:2] == ("shortformer_to_tables", "fold_layer_norm")
    assert compare_log_probs(sd, cfg, folded, folded_cfg).passed
    assert all(torch.equal(sd[k], before[k]) for k in sd)


# Positions only matter with at least two of them to attend between, and only while softmax is
# not saturated (huge outlier positions give one-hot patterns that no change of scores moves).
DISCRIMINATING = dict(min_layers=1, min_ctx=2, min_d_model=4, normalization_types=("LN",),
                      weights=dict(min_gain_spread=0.3, max_outlier_scale=3.0))


@given(models(**wide(**DISCRIMINATING, **SHORTFORMER)),
       st.sampled_from(sorted(IDENTITY.wrong_everywhere)))
def test_negative_control_naive_fold_and_older_reading_are_caught(model, wrong_name):
    cfg, sd = model
    toks = default_tokens(cfg)
    assert_caught(IDENTITY, wrong_name, sd, cfg, toks, wrong_name, pattern=VISIBLE)


def test_values_and_mlps_never_see_positions():
    """Only the query and key tables carry positions once W_pos is moved."""
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=16,
                    positional_embedding_type="shortformer")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    tables, tables_cfg = cm.shortformer_to_tables(sd, cfg)
    assert "pos_embed.W_pos" not in tables
    assert sorted(k for k in tables if ".pos_" in k) == [
        f"blocks.{l}.attn.pos_{n}" for l in range(2) for n in "KQ"
    ]
    expected = torch.einsum("pd,hde->phe", sd["pos_embed.W_pos"], sd["blocks.1.attn.W_K"])
    assert torch.equal(tables["blocks.1.attn.pos_K"], expected)


def test_grouped_query_key_tables_have_key_value_heads():
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=4, d_head=2, d_vocab=10, n_ctx=5,
                    positional_embedding_type="shortformer", n_key_value_heads=2)
    sd = cm.random_state_dict(cfg, seed=1, dtype=torch.float64)
    tables, tables_cfg = cm.shortformer_to_tables(sd, cfg)
    assert tables["blocks.0.attn.pos_K"].shape == (5, 2, 2) and tables["blocks.0.attn.pos_Q"].shape == (5, 4, 2)
    assert compare_log_probs(sd, cfg, tables, tables_cfg).passed


@given(models(**wide(positional_embedding_types=("standard", "rotary", "shortformer_tables"))))
def test_only_shortformer_models_are_converted(model):
    cfg, sd = model
    with pytest.raises(cm.PreconditionError, match="shortformer_to_tables: precondition 'positional_embedding_type is shortformer'"):
        cm.shortformer_to_tables(sd, cfg)


def test_conversion_is_refused_twice():
    cfg = cm.Config(n_layers=1, d_model=4, n_heads=1, d_head=2, d_vocab=5, n_ctx=3, positional_embedding_type="shortformer")
    tables, tables_cfg = cm.shortformer_to_tables(cm.random_state_dict(cfg, seed=0), cfg)
    with pytest.raises(cm.AlreadyAppliedError):
        cm.shortformer_to_tables(tables, tables_cfg.replace(positional_embedding_type="shortformer"))
