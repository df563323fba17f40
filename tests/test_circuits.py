"""The public circuits API: factored matrices, circuits, patterns, path and score terms, scores."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

import circuitmath as cm
from circuitmath import circuits
from circuitmath.circuits import FactoredMatrix, Path
from circuitmath.strategies import models, tokens

from support import wide

PATH_MODELS = dict(attn_only=True, positional_embedding_types=("standard", "rotary", "shortformer", "shortformer_tables"),
                   max_layers=2)
FLOAT64 = torch.float64


def test_public_names():
    for name in circuits.__all__:
        obj = getattr(circuits, name)
        assert obj.__doc__ and obj.__doc__.strip(), name


# -- FactoredMatrix ---------------------------------------------------------------------------

factor_shapes = st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 6), st.integers(0, 2), st.integers(0, 2**31))


def _factors(sizes):
    m, k, n, batch, seed = sizes
    g = torch.Generator().manual_seed(seed)
    lead = (2,) * batch
    return torch.randn(*lead, m, k, generator=g, dtype=FLOAT64), torch.randn(*lead, k, n, generator=g, dtype=FLOAT64)


@given(factor_shapes)
def test_factored_matrix_agrees_with_the_materialised_product(sizes):
    left, right = _factors(sizes)
    M = FactoredMatrix(left, right)
    AB = left @ right
    assert M.shape == tuple(AB.shape) and M.inner == left.shape[-1]
    torch.testing.assert_close(M.AB, AB)
    torch.testing.assert_close(M.T.AB, AB.transpose(-1, -2))
    torch.testing.assert_close(M.norm(), torch.linalg.matrix_norm(AB))
    U, S, Vh = M.svd()
    r = min(M.shape[-2:] + (M.inner,))
    assert U.shape[-1] == S.shape[-1] == Vh.shape[-2] == r
    torch.testing.assert_close(U @ torch.diag_embed(S) @ Vh, AB)
    torch.testing.assert_close(S, torch.linalg.svdvals(AB)[..., :r])
    torch.testing.assert_close(U.transpose(-1, -2) @ U, torch.eye(r, dtype=FLOAT64).expand_as(U.transpose(-1, -2) @ U))
    assert bool((M.rank() <= M.inner).all())


@given(st.integers(1, 3), st.integers(2, 6), st.integers(0, 2**31))
def test_eigenvalues_from_the_small_side_are_the_nonzero_eigenvalues(k, m, seed):
    g = torch.Generator().manual_seed(seed)
    left, right = torch.randn(m, k, generator=g, dtype=FLOAT64), torch.randn(k, m, generator=g, dtype=FLOAT64)
    few = FactoredMatrix(left, right).eigenvalues()
    assert few.shape == (min(m, k),)
    many = torch.linalg.eigvals(left @ right)
    for value in few:  # each small-side eigenvalue is an eigenvalue of the big product
        assert float((many - value).abs().min()) < 1e-8 * max(1.0, float(value.abs()))
    # and the big product has no other nonzero eigenvalue: sum of all equals the trace of BA
    torch.testing.assert_close(many.sum(), few.sum())


def test_factored_matrix_products_and_indexing():
    g = torch.Generator().manual_seed(0)
    left, right = torch.randn(3, 5, 2, generator=g, dtype=FLOAT64), torch.randn(3, 2, 5, generator=g, dtype=FLOAT64)
    M = FactoredMatrix(left, right)
    other = torch.randn(5, 4, generator=g, dtype=FLOAT64)
    torch.testing.assert_close((M @ other).AB, M.AB @ other)
    torch.testing.assert_close((other.T @ M).AB, other.T @ M.AB)
    torch.testing.assert_close((M @ M).AB, M.AB @ M.AB)
    assert (M @ M).inner == 2
    torch.testing.assert_close(M[1].AB, M.AB[1])
    torch.testing.assert_close(M.BA, right @ left)
    with pytest.raises(IndexError):
        M[0][0]
    with pytest.raises(ValueError, match="inner sizes differ"):
        FactoredMatrix(left, right.transpose(-1, -2))
    with pytest.raises(ValueError, match="square"):
        FactoredMatrix(torch.ones(3, 2), torch.ones(2, 4)).eigenvalues()


# -- circuits of a model ----------------------------------------------------------------------


@given(models(**wide(dtype=FLOAT64, min_layers=1, positional_embedding_types=("standard", "shortformer"))))
def test_circuits_match_their_definitions(model):
    cfg, sd = model
    ov, qk, full = circuits.ov_circuits(sd, cfg), circuits.qk_circuits(sd, cfg), circuits.full_ov_circuits(sd, cfg)
    repeat = cfg.n_heads // (cfg.n_key_value_heads or cfg.n_heads)
    v_name = "_W_V" if cfg.n_key_value_heads else "W_V"
    k_name = "_W_K" if cfg.n_key_value_heads else "W_K"
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        for head in range(cfg.n_heads):
            W_V, W_K = sd[f"{p}.{v_name}"][head // repeat], sd[f"{p}.{k_name}"][head // repeat]
            torch.testing.assert_close(ov.AB[layer, head], W_V @ sd[f"{p}.W_O"][head])
            torch.testing.assert_close(qk.AB[layer, head], sd[f"{p}.W_Q"][head] @ W_K.T)
            torch.testing.assert_close(full.AB[layer, head], sd["embed.W_E"] @ W_V @ sd[f"{p}.W_O"][head] @ sd["unembed.W_U"])
    assert ov.inner == qk.inner == full.inner == cfg.d_head
    torch.testing.assert_close(circuits.bigram_table(sd, cfg), sd["embed.W_E"] @ sd["unembed.W_U"])


def test_qk_circuits_and_qk_composition_refuse_rotary_models():
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, positional_embedding_type="rotary")
    sd = cm.random_state_dict(cfg, seed=0)
    with pytest.raises(cm.PreconditionError, match="offset"):
        circuits.qk_circuits(sd, cfg)
    with pytest.raises(cm.PreconditionError):
        circuits.composition_scores(sd, cfg)
    assert set(circuits.composition_scores(sd, cfg, kinds=("v",))) == {"v"}
    with pytest.raises(ValueError, match="unknown composition kinds"):
        circuits.composition_scores(sd, cfg, kinds=("x",))


def test_virtual_weights_meet_every_writer_with_every_reader():
    g = torch.Generator().manual_seed(0)
    writer, reader = torch.randn(3, 2, 8, generator=g), torch.randn(4, 8, 5, generator=g)
    out = circuits.virtual_weights(writer, reader)
    assert out.shape == (3, 4, 2, 5)
    torch.testing.assert_close(out[1, 2], writer[1] @ reader[2])
    with pytest.raises(ValueError, match="output axis"):
        circuits.virtual_weights(writer, reader.transpose(-1, -2))


# -- composition and copying scores -----------------------------------------------------------


@given(models(**wide(dtype=FLOAT64, min_layers=2, max_layers=3, positional_embedding_types=("standard",))),
       st.floats(0.1, 10.0), st.floats(0.1, 10.0))
def test_composition_scores_lie_in_the_unit_interval_and_ignore_positive_and_negative_rescaling(model, a, b):
    cfg, sd = model
    scores = circuits.composition_scores(sd, cfg)
    scaled = dict(sd)
    for layer in range(cfg.n_layers):
        scaled[f"blocks.{layer}.attn.W_O"] = sd[f"blocks.{layer}.attn.W_O"] * a
        scaled[f"blocks.{layer}.attn.W_Q"] = sd[f"blocks.{layer}.attn.W_Q"] * -b
    rescaled = circuits.composition_scores(scaled, cfg)
    earlier = torch.arange(cfg.n_layers)[:, None, None, None] < torch.arange(cfg.n_layers)[None, None, :, None]
    for kind, values in scores.items():
        assert values.shape == (cfg.n_layers, cfg.n_heads) * 2
        defined = earlier.expand_as(values)
        assert torch.isnan(values[~defined]).all() and not torch.isnan(values[defined]).any()
        assert (values[defined] >= 0).all() and (values[defined] <= 1 + 1e-12).all()
        torch.testing.assert_close(rescaled[kind], values, equal_nan=True)


@given(models(**wide(dtype=FLOAT64, min_layers=1, positional_embedding_types=("standard", "rotary"))), st.floats(0.1, 10.0))
def test_copying_scores_lie_in_minus_one_one_and_follow_the_sign_of_a_rescaling(model, factor):
    cfg, sd = model
    scores = circuits.copying_scores(sd, cfg)
    assert scores.shape == (cfg.n_layers, cfg.n_heads)
    assert (scores.abs() <= 1 + 1e-12).all()
    for sign in (1, -1):
        scaled = {k: (v * sign * factor if k.endswith("W_O") else v) for k, v in sd.items()}
        torch.testing.assert_close(circuits.copying_scores(scaled, cfg), sign * scores)


def test_copying_score_of_a_copying_head_is_one():
    """A head whose full OV circuit is a positive multiple of a projection copies: score 1."""
    cfg = cm.Config(n_layers=1, d_model=6, n_heads=1, d_head=3, d_vocab=6, n_ctx=4)
    sd = cm.random_state_dict(cfg, seed=0, dtype=FLOAT64)
    sd["embed.W_E"] = torch.eye(6, dtype=FLOAT64)
    sd["unembed.W_U"] = torch.eye(6, dtype=FLOAT64)
    sd["blocks.0.attn.W_V"] = torch.eye(6, 3, dtype=FLOAT64)[None]
    sd["blocks.0.attn.W_O"] = 2 * torch.eye(3, 6, dtype=FLOAT64)[None]
    assert math.isclose(float(circuits.copying_scores(sd, cfg)), 1.0)
    sd["blocks.0.attn.W_O"] = -sd["blocks.0.attn.W_O"]
    assert math.isclose(float(circuits.copying_scores(sd, cfg)), -1.0)


# -- attention patterns, path terms, score terms ---------------------------------------------


@given(st.data())
def test_patterns_are_causal_and_row_stochastic(data):
    cfg, sd = data.draw(models(**wide(dtype=FLOAT64, min_layers=1, **PATH_MODELS)))
    toks = data.draw(tokens(cfg))
    patterns = circuits.attention_patterns(sd, cfg, toks)
    assert patterns.shape == (cfg.n_layers, toks.shape[0], cfg.n_heads, toks.shape[1], toks.shape[1])
    torch.testing.assert_close(patterns.sum(-1), torch.ones_like(patterns[..., 0]))
    assert (patterns.triu(diagonal=1) == 0).all()


@given(st.data())
def test_path_terms_sum_to_the_logits_and_are_named_by_their_heads(data):
    cfg, sd = data.draw(models(**wide(dtype=FLOAT64, **PATH_MODELS)))
    toks = data.draw(tokens(cfg))
    terms = circuits.path_terms(sd, cfg, toks)
    total = sum(terms.values())
    torch.testing.assert_close(total, cm.forward(sd, cfg, toks), rtol=1e-9, atol=1e-9)
    embed_paths = [p for p in terms if p.source == "embed"]
    assert len(embed_paths) == (cfg.n_heads + 1) ** cfg.n_layers
    assert all(list(p.heads) == sorted(p.heads) and len({l for l, _ in p.heads}) == p.order for p in terms)
    assert str(Path("embed", ((0, 1), (1, 0)))) == "embed → L0H1 → L1H0"


@given(st.data())
def test_score_terms_rebuild_every_layers_pattern(data):
    cfg, sd = data.draw(models(**wide(dtype=FLOAT64, min_layers=1, **PATH_MODELS)))
    toks = data.draw(tokens(cfg))
    patterns = circuits.attention_patterns(sd, cfg, toks)
    for layer in range(cfg.n_layers):
        terms = circuits.score_terms(sd, cfg, toks, layer)
        assert set(terms) == set(circuits.SCORE_TERMS)
        rebuilt = circuits.pattern_from_scores(sum(terms.values()), cfg)
        torch.testing.assert_close(rebuilt, patterns[layer])
        if layer == 0:  # nothing composes in the first layer
            for group in ("q_composition", "k_composition", "qk_composition"):
                assert not terms[group].any()


@pytest.mark.parametrize("options, precondition", [
    (dict(n_layers=1, d_mlp=8), "attention-only"),
    (dict(n_layers=1, norm_position="post"), "pre-norm"),
])
def test_path_expansion_refuses_what_it_cannot_expand(options, precondition):
    cfg = cm.Config(**{**dict(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6), **options})
    sd = cm.random_state_dict(cfg, seed=0)
    with pytest.raises(cm.PreconditionError) as info:
        circuits.path_terms(sd, cfg, torch.tensor([[1, 2, 3]]))
    assert info.value.precondition == precondition


def test_path_terms_bound_their_number_and_check_tokens():
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=3, d_head=4, d_vocab=10, n_ctx=6)
    sd = cm.random_state_dict(cfg, seed=0)
    with pytest.raises(ValueError, match="max_paths"):
        circuits.path_terms(sd, cfg, torch.tensor([[1, 2]]), max_paths=10)
    with pytest.raises(ValueError, match="token ids"):
        circuits.path_terms(sd, cfg, torch.tensor([[1, 20]]))
    with pytest.raises(ValueError, match="layer must lie"):
        circuits.score_terms(sd, cfg, torch.tensor([[1, 2]]), 2)


def test_small_composition_scores_keep_their_float32_accuracy():
    # A reader nearly orthogonal to a writer: its score (below 1e-3) squared is far below float32's
    # rounding of the Gram inner products, so it must come from the d_head core (the recomputation
    # of small scores); from the Gram matrices alone its error was 5e-6.
    cfg = cm.Config(n_layers=2, d_model=64, n_heads=2, d_head=16, d_vocab=10, n_ctx=6)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    W_O = sd["blocks.0.attn.W_O"][0].double()  # [d_head, d_model]
    Q, _ = torch.linalg.qr(W_O.T, mode="complete")
    away = Q[:, cfg.d_head:] @ Q[:, cfg.d_head:].T  # projects away from the writer's rows
    W_Q = sd["blocks.1.attn.W_Q"].clone()
    W_Q[0] = (away @ W_Q[0].double() + 1e-4 * W_Q[0].double()).float()
    sd["blocks.1.attn.W_Q"] = W_Q
    exact = circuits.composition_scores({k: v.double() for k, v in sd.items()}, cfg)["q"][0, 0, 1, 0]
    computed = circuits.composition_scores(sd, cfg)["q"][0, 0, 1, 0]
    assert float(exact) < 1e-3
    assert abs(float(computed) - float(exact)) < 1e-7
