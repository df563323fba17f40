"""Folding value biases into the output bias, on every architecture the reference pass runs."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

import circuitmath as cm
from circuitmath.strategies import models, tokens
from circuitmath.testing import default_tokens
from support import DISCRIMINATING_WEIGHTS, VISIBLE, assert_caught, discrimination, same, snapshot, wide

FOLD = cm.get_identity("fold_value_biases")
# Values never see positions and b_O sits inside the attention layer, so the fold is exact
# whatever the norm, its position, the positional embedding or the grouping of key/value heads.
EVERY_ARCHITECTURE = dict(norm_positions=("pre", "post"), positional_embedding_types=("standard", "shortformer", "rotary"))

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@given(data=st.data())
def test_fold_preserves_log_probs(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **EVERY_ARCHITECTURE)))
    result = FOLD.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, result


@given(models(**wide(dtype=torch.float32, **EVERY_ARCHITECTURE)))
def test_fold_moves_each_value_bias_through_every_query_head_that_reads_it(model):
    cfg, sd = model
    before = snapshot(sd)
    folded, folded_cfg = cm.fold_value_biases(sd, cfg)
    assert same(sd, before), "the input state dict was modified"
    assert folded_cfg.applied == ("fold_value_biases",) and cfg.applied == ()
    assert {t.dtype for t in folded.values()} == {torch.float32}
    cm.validate_state_dict(folded, folded_cfg)
    bias = "_b_V" if cfg.n_key_value_heads else "b_V"
    group = cfg.n_heads // (cfg.n_key_value_heads or cfg.n_heads)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        assert torch.equal(folded[f"{p}.{bias}"], torch.zeros_like(sd[f"{p}.{bias}"]))
        expected = sd[f"{p}.b_O"].double() + sum(
            sd[f"{p}.{bias}"][h // group].double() @ sd[f"{p}.W_O"][h].double() for h in range(cfg.n_heads)
        )
        assert torch.allclose(folded[f"{p}.b_O"].double(), expected, rtol=1e-6, atol=1e-5)
    untouched = [k for k in sd if not k.endswith((".b_O", "b_V"))]
    assert all(folded[k] is sd[k] for k in untouched), "tensors the fold does not change must be shared"


# Each wrong fold differs from the right one only on some models: with at least one layer and
# sizeable biases; dropping all heads but the first needs two heads; folding a shared value bias
# through one query head needs a group of two. d_model >= 3, because behind a LayerNorm over two
# dimensions the residual stream only keeps its sign, which a small error in b_O may not flip.
DISCRIMINATING = {
    "no_sum_over_heads": lambda cfg: cfg.n_heads >= 2,
    "once_per_key_value_head": lambda cfg: cfg.n_heads // (cfg.n_key_value_heads or cfg.n_heads) >= 2,
    "drop_value_biases": lambda cfg: True,
}


def test_every_numeric_twin_has_a_discriminating_strategy():
    assert set(DISCRIMINATING) == set(FOLD.wrong_everywhere)


@pytest.mark.parametrize("wrong_name", sorted(DISCRIMINATING))
@given(data=st.data())
def test_negative_control_wrong_fold_is_caught(wrong_name, data):
    grouped = (True,) if wrong_name == "once_per_key_value_head" else (False, True)
    cfg, sd = data.draw(
        models(min_layers=1, grouped_query=grouped, weights=DISCRIMINATING_WEIGHTS, **EVERY_ARCHITECTURE).filter(
            lambda model: model[0].d_model >= 3 and DISCRIMINATING[wrong_name](model[0])
        )
    )
    toks = default_tokens(cfg)
    assert_caught(FOLD, wrong_name, sd, cfg, toks, wrong_name, weights=VISIBLE)


@given(models(**wide(**EVERY_ARCHITECTURE)))
def test_double_application_is_refused(model):
    cfg, sd = model
    folded, folded_cfg = cm.fold_value_biases(sd, cfg)
    with pytest.raises(cm.AlreadyAppliedError, match="fold_value_biases"):
        cm.fold_value_biases(folded, folded_cfg)


@pytest.mark.parametrize("seed", range(3))
def test_fold_is_exact_with_bidirectional_attention(seed):
    """Without a causal mask every row sees every key, and still sums to 1 (BERT-like layout)."""
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=5, d_mlp=8,
                    causal=False, norm_position="post")
    sd = cm.random_state_dict(cfg, seed=seed, dtype=torch.float64)
    toks = default_tokens(cfg)
    assert FOLD.check(sd, cfg, toks).passed
    assert discrimination(FOLD, "drop_value_biases", sd, cfg, toks).weights > VISIBLE
    assert not FOLD.check_wrong_rewrite("drop_value_biases", sd, cfg, toks).passed


def test_fold_keeps_bfloat16():
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=4, d_head=2, d_vocab=10, n_ctx=4, n_key_value_heads=2)
    sd = cm.random_state_dict(cfg, seed=3, dtype=torch.bfloat16)
    folded, _ = cm.fold_value_biases(sd, cfg)
    assert {t.dtype for t in folded.values()} == {torch.bfloat16}


# -- fully masked rows -----------------------------------------------------------------------
# The reference pass masks causally: query i always sees key i, so no row of a pattern is empty.
# Padding masks can empty a row. What the identity then does depends on how the row is handled.


def _layer_output(scores, mask, values, W_O, b_O, fill, empty_rows_to_zero=False):
    """One head: ``softmax(scores masked with fill) @ values @ W_O + b_O`` for ``[n, n]`` scores."""
    pattern = torch.softmax(scores.masked_fill(~mask, fill), dim=-1)
    if empty_rows_to_zero:
        pattern = torch.where(mask.any(dim=-1, keepdim=True), pattern, torch.zeros_like(pattern))
    return pattern @ values @ W_O + b_O


def _head(seed=0, n=4, d=3, e=2):
    g = torch.Generator().manual_seed(seed)
    x, W_V, W_O = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((n, d), (d, e), (e, d)))
    b_V, b_O, scores = torch.randn(e, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64), torch.randn(n, n, generator=g, dtype=torch.float64)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    mask[0] = False  # query 0 is padding: it may attend to nothing
    return x, W_V, b_V, W_O, b_O, scores, mask


def test_softmax_of_a_fully_masked_row_is_nan():
    row = torch.full((5,), -math.inf, dtype=torch.float64)
    assert torch.isnan(torch.softmax(row, dim=-1)).all()  # exp(-inf - (-inf)) = exp(nan)


def test_fold_fails_on_a_fully_masked_row_and_holds_elsewhere():
    x, W_V, b_V, W_O, b_O, scores, mask = _head()
    folded_b_O = b_O + b_V @ W_O

    def both(**handling):
        original = _layer_output(scores, mask, x @ W_V + b_V, W_O, b_O, **handling)
        folded = _layer_output(scores, mask, x @ W_V, W_O, folded_b_O, **handling)
        return original, folded

    # -inf mask: the empty row is NaN before and after; NaN equals nothing, so the identity fails.
    original, folded = both(fill=-math.inf)
    assert torch.isnan(original[0]).all() and torch.isnan(folded[0]).all()
    assert torch.allclose(original[1:], folded[1:], rtol=0, atol=1e-12)
    # Empty rows set to zero (what padding-aware code often does): the row sums to 0, not 1, so the
    # folded model adds b_V W_O there that the original never did.
    original, folded = both(fill=-math.inf, empty_rows_to_zero=True)
    assert torch.allclose(folded[0] - original[0], b_V @ W_O, rtol=0, atol=1e-12)
    assert (folded[0] - original[0]).abs().max() > 1e-3
    assert torch.allclose(original[1:], folded[1:], rtol=0, atol=1e-12)
    # A finite mask value: the empty row becomes uniform, sums to 1, and the identity holds.
    original, folded = both(fill=torch.finfo(torch.float64).min)
    assert torch.allclose(original, folded, rtol=0, atol=1e-12)


@pytest.mark.parametrize("stacked", [False, True], ids=["one layer", "stacked layers"])
def test_zero_value_biases_give_zero_without_the_einsum_and_any_other_bias_does_not(stacked):
    """value_bias_through_output skips the float64 einsum for biases that are all zero (on the
    CPU): the same zeros as the einsum; one nonzero entry, however small, takes the einsum."""
    from circuitmath._processing.attention import value_bias_through_output

    generator = torch.Generator().manual_seed(0)
    lead = (3,) if stacked else ()
    W_O = torch.randn(*lead, 4, 5, 6, generator=generator)
    b_V = torch.zeros(*lead, 2, 5)  # grouped: 2 key/value heads for 4 query heads

    def einsum(b_V):
        return torch.einsum("...he,...hed->...d", b_V.double().repeat_interleave(2, dim=-2), W_O.double())

    skipped, full = value_bias_through_output(b_V, W_O), einsum(b_V)
    assert skipped.dtype == torch.float64 and skipped.shape == full.shape == (*lead, 6)
    assert torch.equal(skipped, full) and not skipped.signbit().any()
    b_V[..., 1, 3] = 1e-30  # negative control: not all zero, so the einsum must run
    through = value_bias_through_output(b_V, W_O)
    assert not torch.equal(through, skipped)
    assert torch.equal(through, einsum(b_V))
