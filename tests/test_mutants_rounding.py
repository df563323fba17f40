"""Roundings that mutation testing (``make mutate``) found unpinned: results stated to be
computed in float64 (and rounded once, for a transform's) held to a float64 reference, with a
computation in the model's own dtype as the control that the bound separates."""

import pytest
import torch

import circuitmath as cm
from circuitmath._reference import normalize
from circuitmath.io import family


def _units_off(got: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest ``|got - reference|`` in units of ``eps |reference|`` of ``got``'s dtype: at
    most 0.5 (the unit roundoff) where ``got`` is ``reference`` rounded once to nearest."""
    eps = torch.finfo(got.dtype).eps
    return float(((got.double() - reference).abs() / (eps * reference.abs())).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_bloom_embedding_norm_folds_into_w_e_rounded_once(dtype):
    """BLOOM's embedding LayerNorm folded into ``W_E`` (``W_E := LN(W_E)``) is the float64 value
    rounded once: within half a unit of the float64 LayerNorm, on embeddings sharing a large
    component (100 plus unit noise, so the mean and the centering cancel). Control: the same
    LayerNorm with its mean and variance taken in the model's dtype is thousands of units off."""
    cfg = family("BLOOM").cfg
    sd = cm.random_state_dict(cfg, seed=0, dtype=dtype)
    noise = torch.randn(sd["embed.W_E"].shape, generator=torch.Generator().manual_seed(1))
    sd["embed.W_E"] = (100 + noise).to(dtype)
    W_E, w, b = sd["embed.W_E"], sd["embed.ln.w"], sd["embed.ln.b"]
    reference = normalize(W_E.double(), "LN", w.double(), b.double(), cfg.eps)
    folded = cm.fold_layer_norm(sd, cfg)[0]["embed.W_E"]
    assert folded.dtype == dtype
    assert _units_off(folded, reference) <= 0.5 * (1 + 1e-6)
    in_own_dtype = normalize(W_E, "LN", w, b, cfg.eps)
    assert _units_off(in_own_dtype, reference) > 1000


def test_a_diagnosis_measures_the_log_prob_difference_in_float64():
    """A float32 processing whose W_U is then scaled 50-fold (log-probs near 0 against some near
    -200): the before -> after row's |Δ log-prob| is the largest float64 difference of the two
    models' float32 log-probs, exactly (their float32 difference would round it)."""
    from circuitmath._compare import default_tokens
    from circuitmath.testing import diagnose

    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    before = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    after, after_cfg = cm.process_weights(before, cfg)
    after = dict(after, **{"unembed.W_U": after["unembed.W_U"] * 50})
    (row,) = [f for f in diagnose(before, after, cfg, after_cfg=after_cfg).findings if f.kind == "equivalence"]
    tokens = default_tokens(cfg)
    difference = cm.log_probs(before, cfg, tokens).double() - cm.log_probs(after, after_cfg, tokens).double()
    assert row.status == "violated" and row.max_abs_error == float(difference.abs().max()) > 100
