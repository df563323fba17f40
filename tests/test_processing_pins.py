"""What each weight transform writes, pinned on the weights themselves.

The log-prob checks cannot see a change the model is invariant to: a reader centered by ``d``
times its mean instead of its mean is as exact (``LNPre(x)`` is orthogonal to ``1``), but it is
not centered. These tests pin the promised weights, so such a slip fails.
"""

import pytest
import torch

from circuitmath import (
    Config,
    center_reading_weights,
    center_unembed,
    center_writing_weights,
    fold_layer_norm,
    random_state_dict,
)
from circuitmath._processing import readers, writers

CFG = Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
TOL = 1e-12


def _sd():
    return random_state_dict(CFG, seed=3, dtype=torch.float64)


@pytest.mark.parametrize("fused", [False, True])
def test_center_reading_weights_leaves_every_reader_with_mean_zero_over_d_model(fused):
    if fused:
        out, cfg = fold_layer_norm(_sd(), CFG, center_reading_weights=True)
    else:
        folded, folded_cfg = fold_layer_norm(_sd(), CFG)
        out, cfg = center_reading_weights(folded, folded_cfg)
    unfolded, _ = fold_layer_norm(_sd(), CFG)
    for _norm, pairs in readers(CFG):
        for weight, _bias in pairs:
            assert float(out[weight].mean(dim=-2).abs().max()) < TOL, weight
            expected = unfolded[weight] - unfolded[weight].mean(dim=-2, keepdim=True)
            assert torch.allclose(out[weight], expected, atol=TOL, rtol=0), weight
    assert "center_reading_weights" in cfg.applied


def test_center_writing_weights_subtracts_the_mean_over_d_model():
    sd = _sd()
    out, _ = center_writing_weights(sd, CFG)
    for name in writers(CFG):
        assert torch.allclose(out[name], sd[name] - sd[name].mean(dim=-1, keepdim=True), atol=TOL, rtol=0), name
    untouched = set(sd) - set(writers(CFG))
    assert all(out[name] is sd[name] or torch.equal(out[name], sd[name]) for name in untouched)


def test_center_unembed_subtracts_the_mean_over_the_vocabulary():
    sd = _sd()
    out, _ = center_unembed(sd, CFG)
    W_U, b_U = sd["unembed.W_U"], sd["unembed.b_U"]
    assert torch.allclose(out["unembed.W_U"], W_U - W_U.mean(dim=-1, keepdim=True), atol=TOL, rtol=0)
    assert torch.allclose(out["unembed.b_U"], b_U - b_U.mean(), atol=TOL, rtol=0)


def test_fold_layer_norm_writes_the_folded_readers_and_biases():
    sd = _sd()
    out, _ = fold_layer_norm(sd, CFG)
    w, b = sd["blocks.0.ln1.w"], sd["blocks.0.ln1.b"]
    W_Q, b_Q = sd["blocks.0.attn.W_Q"], sd["blocks.0.attn.b_Q"]
    assert torch.allclose(out["blocks.0.attn.W_Q"], W_Q * w[:, None], atol=TOL, rtol=0)
    assert torch.allclose(out["blocks.0.attn.b_Q"], b_Q + torch.einsum("d,hde->he", b, W_Q), atol=TOL, rtol=0)
    w, b = sd["ln_final.w"], sd["ln_final.b"]
    assert torch.allclose(out["unembed.b_U"], sd["unembed.b_U"] + b @ sd["unembed.W_U"], atol=TOL, rtol=0)
    assert not any(name.endswith((".ln1.w", ".ln1.b", "ln_final.w")) for name in out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_pipeline_equals_the_chain_of_transforms(dtype):
    """process_weights composes steps 1-4 in one pass; its weights are the chain's, to rounding
    (the model cannot tell: a per-row shift of W_U or of a reader is invisible to log-probs)."""
    from circuitmath import fold_value_biases, process_weights

    sd = random_state_dict(CFG, seed=4, dtype=dtype)
    fused, fused_cfg = process_weights(sd, CFG)
    chain, chain_cfg = fold_layer_norm(sd, CFG, center_reading_weights=True)
    for step in (fold_value_biases, center_writing_weights, center_unembed):
        chain, chain_cfg = step(chain, chain_cfg)
    assert fused_cfg.applied == chain_cfg.applied and set(fused) == set(chain)
    eps = torch.finfo(dtype).eps
    for name in chain:
        scale = max(1.0, float(chain[name].abs().max()))
        assert float((fused[name].double() - chain[name].double()).abs().max()) <= 64 * eps * scale, name


def test_rescale_multiplies_every_write_by_the_scale():
    """Dividing by the scale would be as invisible to an eps = 0 model; the transform multiplies."""
    from circuitmath import rescale_residual_stream

    cfg = CFG.replace(eps=0.0)
    sd = random_state_dict(cfg, seed=5, dtype=torch.float64)
    out, _ = rescale_residual_stream(sd, cfg, scale=3.0)
    for name in writers(cfg):
        assert torch.equal(out[name], sd[name] * 3.0), name
    for name in set(sd) - set(writers(cfg)):
        assert torch.equal(out[name], sd[name]), name
