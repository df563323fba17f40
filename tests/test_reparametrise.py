"""Reparametrising W_Q, W_K and W_V, W_O: any change of basis, and the balanced SVD choice."""

import pytest
import torch
from hypothesis import given, strategies as st
from sympy import Inverse, MatMul, MatrixSymbol, Symbol, Transpose

import circuitmath as cm
from circuitmath._algebra import IllTyped, is_zero, normal_form
from circuitmath.circuits import change_head_bases
from circuitmath.circuits._bases import change_bases
from circuitmath.strategies import models, tokens
from circuitmath.testing import compare_log_probs, default_tokens
from support import DISCRIMINATING_WEIGHTS, VISIBLE, assert_caught, same, snapshot, wide

REFACTOR = cm.get_identity("refactor_factored_attn_matrices")
UNROTATED = dict(norm_positions=("pre", "post"), positional_embedding_types=("standard", "shortformer"))

def _groups(cfg):
    kv_heads = cfg.n_key_value_heads or cfg.n_heads
    size = cfg.n_heads // kv_heads
    return [list(range(j * size, (j + 1) * size)) for j in range(kv_heads)]


def _names(cfg, side):
    grouped = side != "Q" and cfg.n_key_value_heads
    return ("_W_" if grouped else "W_") + side, ("_b_" if grouped else "b_") + side


def _extended(sd, cfg, p, side, head):
    """``[W; b]`` of one head, float64: its map on the input ``(x, 1)``."""
    weight, bias = _names(cfg, side)
    return torch.cat([sd[f"{p}.{weight}"][head], sd[f"{p}.{bias}"][head][None]]).double()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@given(data=st.data())
def test_refactor_preserves_log_probs(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **UNROTATED)))
    result = REFACTOR.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, result


@given(models(**wide(**UNROTATED)))
def test_refactor_keeps_every_product_and_balances_the_factors(model):
    cfg, sd = model
    out, _ = cm.refactor_factored_attn_matrices(sd, cfg)
    close = dict(rtol=1e-9, atol=1e-9)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        for j, heads in enumerate(_groups(cfg)):
            keys_before, keys_after = _extended(sd, cfg, p, "K", j), _extended(out, cfg, p, "K", j)
            queries_after = torch.cat([_extended(out, cfg, p, "Q", h) for h in heads])
            for h in heads:
                assert torch.allclose(_extended(sd, cfg, p, "Q", h) @ keys_before.T,
                                      _extended(out, cfg, p, "Q", h) @ keys_after.T, **close)
            # Balanced: orthogonal columns, the i-th of the same norm for queries and keys.
            gram_q, gram_k = queries_after.T @ queries_after, keys_after.T @ keys_after
            assert torch.allclose(gram_q, torch.diag(gram_q.diagonal()), **close)
            assert torch.allclose(gram_q, gram_k, **close)
            values_before, values_after = _extended(sd, cfg, p, "V", j), _extended(out, cfg, p, "V", j)
            W_O_before = torch.cat([sd[f"{p}.W_O"][h] for h in heads], dim=1).double()
            W_O_after = torch.cat([out[f"{p}.W_O"][h] for h in heads], dim=1).double()
            assert torch.allclose(values_before @ W_O_before, values_after @ W_O_after, **close)
            # W_O's rows (side by side across the group) are orthonormal, or zero where the
            # product has fewer than d_head directions.
            gram_o = W_O_after @ W_O_after.T
            assert torch.allclose(gram_o, torch.diag(gram_o.diagonal()), **close)
            assert all(abs(v - 1) < 1e-9 or abs(v) < 1e-9 for v in gram_o.diagonal().tolist())
            gram_v = values_after.T @ values_after
            assert torch.allclose(gram_v, torch.diag(gram_v.diagonal()), **close)


@given(models(**wide(dtype=torch.float32, **UNROTATED)))
def test_refactor_is_pure_keeps_dtypes_and_refuses_a_second_application(model):
    cfg, sd = model
    before = snapshot(sd)
    out, out_cfg = cm.refactor_factored_attn_matrices(sd, cfg)
    assert same(sd, before), "the input state dict was modified"
    assert out_cfg.applied == ("refactor_factored_attn_matrices",) and cfg.applied == ()
    assert {t.dtype for t in out.values()} == {torch.float32}
    assert all(out[k] is sd[k] for k in sd if ".attn." not in k or k.endswith("b_O"))
    cm.validate_state_dict(out, out_cfg)
    with pytest.raises(cm.AlreadyAppliedError, match="refactor_factored_attn_matrices"):
        cm.refactor_factored_attn_matrices(out, out_cfg)


def test_refactor_keeps_bfloat16():
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=4, d_head=2, d_vocab=10, n_ctx=4, n_key_value_heads=2)
    sd = cm.random_state_dict(cfg, seed=3, dtype=torch.bfloat16)
    out, _ = cm.refactor_factored_attn_matrices(sd, cfg)
    assert {t.dtype for t in out.values()} == {torch.bfloat16}


@given(models(**wide(**UNROTATED)))
def test_zero_biases_stay_exactly_zero(model):
    cfg, sd = model
    folded, folded_cfg = cm.remove_key_biases(*cm.fold_value_biases(sd, cfg))
    out, _ = cm.refactor_factored_attn_matrices(folded, folded_cfg)
    for layer in range(cfg.n_layers):
        for side in "KV":
            assert not out[f"blocks.{layer}.attn.{_names(cfg, side)[1]}"].any()


def _random_basis(generator, size):
    """A random invertible ``[size, size]`` matrix with condition number at most e^2."""
    left, _ = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    scales = torch.exp(torch.rand(size, generator=generator, dtype=torch.float64) * 2 - 1)
    return left @ torch.diag(scales) @ right


@given(models(**wide(**UNROTATED)), st.integers(0, 2**32 - 1))
def test_any_change_of_basis_preserves_log_probs(model, seed):
    """The identity itself, beyond the SVD choice: W_Q N, W_K N^-T, W_V M, M^-1 W_O, biases alike."""
    cfg, sd = model
    generator = torch.Generator().manual_seed(seed)
    kv_heads = cfg.n_key_value_heads or cfg.n_heads
    shape = (cfg.n_layers, kv_heads, cfg.d_head, cfg.d_head)
    device = sd["embed.W_E"].device
    bases = {kind: torch.stack([_random_basis(generator, cfg.d_head) for _ in range(cfg.n_layers * kv_heads)]).reshape(shape).to(device)
             if cfg.n_layers else torch.empty(shape, dtype=torch.float64, device=device) for kind in "NM"}
    out = change_head_bases(sd, cfg, query_key=bases["N"], value=bases["M"])
    # W_V M and M^-1 W_O are each rounded: their product moves by up to cond(M) times what rounding
    # the weights alone does, the part of the tolerance measured by the rounding sensitivity.
    result = compare_log_probs(sd, cfg, out, cfg)
    conditioning = max((float(c) for basis in bases.values() for c in torch.linalg.cond(basis).flatten()), default=1.0)
    assert result.max_abs_error <= conditioning * result.tolerance, (result, conditioning)


@given(models(**wide(positional_embedding_types=("rotary",))))
def test_rotary_models_are_refused(model):
    cfg, sd = model
    before = snapshot(sd)
    with pytest.raises(cm.PreconditionError) as info:
        cm.refactor_factored_attn_matrices(sd, cfg)
    assert info.value.identity == "refactor_factored_attn_matrices"
    assert info.value.precondition == "keys and queries are not rotated by position"
    assert same(sd, before)


def test_rotary_refusal_is_not_a_formality():
    """A change of basis N of queries and keys does not commute with the rotation between them."""
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=None,
                    positional_embedding_type="rotary")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    N = _random_basis(generator, cfg.d_head)
    N = N.expand(cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_head)
    with pytest.raises(cm.PreconditionError, match="keys and queries are not rotated by position"):
        change_head_bases(sd, cfg, query_key=N)  # the public change refuses; the private one shows why
    changed = change_bases(sd, cfg, query=N, key=torch.linalg.inv(N).transpose(-1, -2))
    result = compare_log_probs(sd, cfg, changed, cfg)
    assert result.max_abs_error > 1e3 * result.tolerance, result
    unrotated = cfg.replace(positional_embedding_type="standard")
    sd_standard = {**sd, "pos_embed.W_pos": torch.zeros(cfg.n_ctx, cfg.d_model, dtype=torch.float64)}
    changed_standard = {**changed, "pos_embed.W_pos": sd_standard["pos_embed.W_pos"]}
    assert compare_log_probs(sd_standard, unrotated, changed_standard, unrotated).passed


# Each wrong refactor shows only on some models: with a layer, two positions (a single key gets
# weight 1), d_model >= 3 (see test_value_biases.py), sizeable biases, and
DISCRIMINATING = {
    # d_head >= 2: in one dimension N^-1 and N^-T are the same number
    "key_inverse_not_transposed": lambda cfg: cfg.d_head >= 2,
    "biases_left_behind": lambda cfg: True,
    # a group of at least two query heads sharing a key/value head
    "one_svd_per_query_head": lambda cfg: cfg.n_heads // (cfg.n_key_value_heads or cfg.n_heads) >= 2,
}


def test_every_numeric_twin_has_a_discriminating_strategy():
    assert set(DISCRIMINATING) == set(REFACTOR.wrong_everywhere)


@pytest.mark.parametrize("wrong_name", sorted(DISCRIMINATING))
@given(data=st.data())
def test_negative_control_wrong_refactor_is_caught(wrong_name, data):
    grouped = (True,) if wrong_name == "one_svd_per_query_head" else (False, True)
    cfg, sd = data.draw(
        models(min_layers=1, grouped_query=grouped, weights=DISCRIMINATING_WEIGHTS, **UNROTATED).filter(
            lambda model: model[0].d_model >= 3 and model[0].n_ctx >= 2 and DISCRIMINATING[wrong_name](model[0])
        )
    )
    toks = default_tokens(cfg)
    assert_caught(REFACTOR, wrong_name, sd, cfg, toks, wrong_name, weights=VISIBLE)


def test_algebra_cancels_inverses_and_transposed_inverses():
    e, d = Symbol("e", positive=True, integer=True), Symbol("d", positive=True, integer=True)
    N, B = MatrixSymbol("N", e, e), MatrixSymbol("B", d, e)
    assert normal_form(MatMul(N, Inverse(N)), invertible=(N,)) == {(): 1}
    assert normal_form(MatMul(Inverse(N), N), invertible=(N,)) == {(): 1}
    assert is_zero(MatMul(N, Transpose(MatMul(B, Transpose(Inverse(N))))) - Transpose(B), invertible=(N,))
    assert not is_zero(MatMul(N, Transpose(MatMul(B, Inverse(N)))) - Transpose(B), invertible=(N,))
    with pytest.raises(IllTyped, match="no fact declares invertible"):  # an inverse must be declared
        normal_form(MatMul(N, Inverse(N)))


def test_change_head_bases_names_a_wrong_shape():
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=None)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    with pytest.raises(cm.InputError, match=r"value must be a tensor of shape \[2, 2, 4, 4\]"):
        change_head_bases(sd, cfg, value=torch.eye(4))


def test_change_head_bases_names_a_basis_on_another_device():
    cfg = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=None)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    basis = torch.eye(4, dtype=torch.float64, device="meta").expand(2, 2, 4, 4)
    with pytest.raises(cm.InputError, match="query_key is on meta, the weights on cpu"):
        change_head_bases(sd, cfg, query_key=basis)
