"""The reference forward pass against independent computations and its defining properties."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

import circuitmath as cm
from circuitmath._reference import normalize
from circuitmath.strategies import models

from support import wide

TINY = dict(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6)


def test_layer_norm_matches_torch():
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    expected = torch.nn.functional.layer_norm(x, (8,), w, b, eps=1e-5)
    assert torch.allclose(normalize(x, "LN", w, b, 1e-5), expected, atol=1e-12)
    rms = torch.nn.functional.rms_norm(x, (8,), w, eps=1e-5)
    assert torch.allclose(normalize(x, "RMS", w, None, 1e-5), rms, atol=1e-12)
    assert not torch.allclose(normalize(x, "RMS", w, None, 1e-5), expected, atol=1e-3)


def test_zero_layer_model_is_a_bigram_table():
    cfg = cm.Config(**{**TINY, "n_layers": 0})
    sd = cm.random_state_dict(cfg, seed=1, dtype=torch.float64)
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    resid = sd["embed.W_E"][tokens] + sd["pos_embed.W_pos"][:5]
    expected = torch.nn.functional.layer_norm(resid, (8,), sd["ln_final.w"], sd["ln_final.b"], 1e-5) @ sd["unembed.W_U"] + sd["unembed.b_U"]
    assert torch.allclose(cm.forward(sd, cfg, tokens), expected, atol=1e-12)


def _loop_attention(sd, cfg, x):
    """One attention layer written with explicit loops over heads and positions."""
    out = torch.zeros_like(x)
    n = x.shape[0]
    for h in range(cfg.n_heads):
        q = x @ sd["blocks.0.attn.W_Q"][h] + sd["blocks.0.attn.b_Q"][h]
        k = x @ sd["blocks.0.attn.W_K"][h] + sd["blocks.0.attn.b_K"][h]
        v = x @ sd["blocks.0.attn.W_V"][h] + sd["blocks.0.attn.b_V"][h]
        for i in range(n):
            scores = torch.stack([q[i] @ k[j] / math.sqrt(cfg.d_head) for j in range(i + 1)])
            weights = torch.softmax(scores, dim=0)
            z = sum(weights[j] * v[j] for j in range(i + 1))
            out[i] += z @ sd["blocks.0.attn.W_O"][h]
    return out + sd["blocks.0.attn.b_O"]


def test_attention_matches_a_loop_over_heads_and_positions():
    cfg = cm.Config(**TINY, d_mlp=16, act_fn="relu")
    sd = cm.random_state_dict(cfg, seed=2, dtype=torch.float64)
    tokens = torch.tensor([[0, 7, 2, 9, 2, 5]])
    x = sd["embed.W_E"][tokens[0]] + sd["pos_embed.W_pos"]
    ln = lambda name, v: torch.nn.functional.layer_norm(v, (8,), sd[f"{name}.w"], sd[f"{name}.b"], 1e-5)
    x = x + _loop_attention(sd, cfg, ln("blocks.0.ln1", x))
    x = x + torch.relu(ln("blocks.0.ln2", x) @ sd["blocks.0.mlp.W_in"] + sd["blocks.0.mlp.b_in"]) @ sd["blocks.0.mlp.W_out"] + sd["blocks.0.mlp.b_out"]
    expected = ln("ln_final", x) @ sd["unembed.W_U"] + sd["unembed.b_U"]
    assert torch.allclose(cm.forward(sd, cfg, tokens)[0], expected, atol=1e-10)


@given(models(**wide(min_layers=1)), st.data())
def test_causal_models_do_not_see_the_future(model, data):
    cfg, sd = model
    if cfg.n_ctx < 2:
        return
    tokens = torch.randint(0, cfg.d_vocab, (1, cfg.n_ctx), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % cfg.d_vocab
    before, after = cm.forward(sd, cfg, tokens), cm.forward(sd, cfg, changed)
    assert torch.equal(before[:, :-1], after[:, :-1])


def test_shortformer_values_and_mlps_are_position_free():
    """Moving W_pos to the residual stream (standard) changes the model; shortformer keeps it out."""
    cfg = cm.Config(**TINY, d_mlp=16, positional_embedding_type="shortformer")
    sd = cm.random_state_dict(cfg, seed=4, dtype=torch.float64)
    tokens = torch.tensor([[1, 1, 1, 1]])
    # With every query identical and W_Q, W_K zeroed, positions reach nothing: all rows equal.
    flat = dict(sd)
    flat["blocks.0.attn.W_Q"] = torch.zeros_like(sd["blocks.0.attn.W_Q"])
    flat["blocks.0.attn.W_K"] = torch.zeros_like(sd["blocks.0.attn.W_K"])
    out = cm.forward(flat, cfg, tokens)
    assert torch.allclose(out, out[:, :1].expand_as(out), atol=1e-12)
    standard = cm.forward(flat, cfg.replace(positional_embedding_type="standard"), tokens)
    assert not torch.allclose(standard, standard[:, :1].expand_as(standard), atol=1e-3)


def test_rotary_scores_depend_on_relative_position_only():
    cfg = cm.Config(**{**TINY, "n_ctx": 8}, positional_embedding_type="rotary")
    sd = cm.random_state_dict(cfg, seed=5, dtype=torch.float64)
    # One repeated token: with a zeroed b_O the attention output at position i depends on the
    # pattern over i + 1 equal values, so compare scores directly through the rotation.
    from circuitmath._reference import rotate

    q = torch.randn(1, 8, 1, 4, dtype=torch.float64)
    same = q[:, :1].expand(1, 8, 1, 4)
    rq = rotate(same, cfg)
    scores = torch.einsum("bqhe,bkhe->bqk", rq, rq)[0]
    for shift in range(1, 4):
        diagonal = torch.diagonal(scores, offset=shift)
        assert torch.allclose(diagonal, diagonal[:1].expand_as(diagonal), atol=1e-12)
    assert not torch.allclose(scores[0, 1], scores[0, 2])


def test_post_norm_block_normalises_the_stream():
    cfg = cm.Config(**TINY, d_mlp=16, norm_position="post")
    sd = cm.random_state_dict(cfg, seed=6, dtype=torch.float64)
    assert "ln_final.w" not in sd
    logits = cm.forward(sd, cfg, torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 10) and torch.isfinite(logits).all()


@pytest.mark.parametrize("tokens, message", [
    (torch.tensor([[1.0, 2.0]]), "integer tensor"),
    (torch.tensor([1, 2]), "integer tensor"),
    (torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), "n_ctx"),
    (torch.tensor([[1, 10]]), "d_vocab"),
])
def test_bad_tokens_are_refused(tokens, message):
    cfg = cm.Config(**TINY)
    sd = cm.random_state_dict(cfg, seed=0)
    with pytest.raises(ValueError, match=message):
        cm.forward(sd, cfg, tokens)


def test_grouped_query_attention_equals_repeated_key_value_heads():
    cfg = cm.Config(**{**TINY, "n_heads": 4}, n_key_value_heads=2, d_mlp=16)
    sd = cm.random_state_dict(cfg, seed=7, dtype=torch.float64)
    full_cfg = cfg.replace(n_key_value_heads=None)
    full = {k.replace("attn._", "attn."): v for k, v in sd.items()}
    for name in ("W_K", "W_V", "b_K", "b_V"):
        full[f"blocks.0.attn.{name}"] = sd[f"blocks.0.attn._{name}"].repeat_interleave(2, dim=0)
    tokens = torch.tensor([[1, 2, 3, 4]])
    assert torch.allclose(cm.forward(sd, cfg, tokens), cm.forward(full, full_cfg, tokens), atol=1e-12)
    wrong = dict(full)
    wrong["blocks.0.attn.W_K"] = sd["blocks.0.attn._W_K"].repeat(2, 1, 1)  # heads grouped wrongly
    assert not torch.allclose(cm.forward(sd, cfg, tokens), cm.forward(wrong, full_cfg, tokens), atol=1e-3)


def test_parallel_and_gated_blocks_match_their_formulas():
    cfg = cm.Config(**TINY, d_mlp=16, act_fn="relu", parallel_attn_mlp=True, gated_mlp=True, normalization_type="RMS")
    sd = cm.random_state_dict(cfg, seed=8, dtype=torch.float64)
    tokens = torch.tensor([[0, 7, 2, 9]])
    x = sd["embed.W_E"][tokens[0]] + sd["pos_embed.W_pos"][:4]
    rms = lambda name, v: torch.nn.functional.rms_norm(v, (8,), sd[f"{name}.w"], eps=1e-5)
    h = rms("blocks.0.ln2", x)
    mlp = (torch.relu(h @ sd["blocks.0.mlp.W_gate"]) * (h @ sd["blocks.0.mlp.W_in"] + sd["blocks.0.mlp.b_in"])) @ sd["blocks.0.mlp.W_out"] + sd["blocks.0.mlp.b_out"]
    x = x + _loop_attention(sd, cfg, rms("blocks.0.ln1", x)) + mlp
    expected = rms("ln_final", x) @ sd["unembed.W_U"] + sd["unembed.b_U"]
    assert torch.allclose(cm.forward(sd, cfg, tokens)[0], expected, atol=1e-10)
