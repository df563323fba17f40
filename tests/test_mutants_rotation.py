"""The residual rotation given a ``Q`` in the model's own precision, pinned where mutation
testing (``make mutate``) found it unpinned: a float32 ``Q`` that fixes the all-ones direction
rotates a float32 LNPre model exactly as its float64 original does, one that does not is
refused, and one off orthogonal is refused with its error measured in float64."""

import re

import pytest
import torch

import circuitmath as cm

CFG = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
TOKENS = torch.tensor([[1, 4, 2, 7, 3]])


@pytest.mark.parametrize("sign", [1, -1], ids=["Q1=1", "Q1=-1"])
def test_a_float32_q_fixing_the_ones_rotates_a_float32_layer_norm_model(sign):
    """A float32 LNPre model (its LayerNorms folded) rotated by a float32 Q with Q1 = ±1: accepted
    as layer_norm_rotation, its log-probs within 1e-5 of the model's; the rotated tensors are
    those the float32 Q gives in float64, rounded once. Control: a float32 Q moving 1 elsewhere
    is refused, naming the condition."""
    folded, cfg = cm.fold_layer_norm(cm.random_state_dict(CFG, seed=0, dtype=torch.float32), CFG)
    Q = (sign * cm.orthogonal_fixing_ones(CFG.d_model, seed=1)).float()
    rotated, rotated_cfg = cm.rotate_residual_stream(folded, cfg, Q)
    assert rotated_cfg.applied == ("fold_layer_norm", "layer_norm_rotation")
    assert rotated["embed.W_E"].dtype == torch.float32
    assert torch.equal(rotated["embed.W_E"], (folded["embed.W_E"].double() @ Q.double()).float())
    before = torch.log_softmax(cm.forward(folded, cfg, TOKENS).double(), -1)
    after = torch.log_softmax(cm.forward(rotated, rotated_cfg, TOKENS).double(), -1)
    assert (before - after).abs().max() < 1e-5
    with pytest.raises(cm.PreconditionError, match="Q 1 is neither 1 nor -1"):
        cm.rotate_residual_stream(folded, cfg, cm.random_orthogonal(CFG.d_model, seed=1).float())


@pytest.mark.parametrize("seed", [0, 1])
def test_a_float32_q_off_orthogonal_is_refused_with_its_error_measured_in_float64(seed):
    """A float32 Q scaled by 1 + 2.5e-6 (max |QᵀQ - I| about 5e-6, above the 3.8e-6 a float32
    model of d_model 8 allows): refused, the message giving max |QᵀQ - I| of Q's entries as
    float64 computes it (float32's own product is off in the second digit at this size).
    Control: the same Q unscaled is accepted."""
    rms = CFG.replace(normalization_type="RMS")
    model, cfg = cm.fold_rms_norm(cm.random_state_dict(rms, seed=0, dtype=torch.float32), rms)
    Q = cm.random_orthogonal(CFG.d_model, seed=seed)
    scaled = (Q * (1 + 2.5e-6)).float()
    error = float((scaled.double().T @ scaled.double() - torch.eye(CFG.d_model, dtype=torch.float64)).abs().max())
    with pytest.raises(cm.PreconditionError, match=re.escape(f"max |Q^T Q - I| is {error:.3g}, above")):
        cm.rotate_residual_stream(model, cfg, scaled)
    cm.rotate_residual_stream(model, cfg, Q.float())


def test_the_dense_form_of_any_q_is_float64_on_the_cpu():
    """as_dense of a float32 Q is that Q's values in float64 on the CPU, as a block-structured
    Q's dense form is."""
    from circuitmath._processing._orthogonal import as_dense, block_orthogonal

    Q = cm.random_orthogonal(CFG.d_model, seed=1).float()
    dense = as_dense(Q)
    assert dense.dtype == torch.float64 and dense.device.type == "cpu" and torch.equal(dense, Q.double())
    structured = block_orthogonal(32, seed=0)
    assert as_dense(structured).dtype == torch.float64 and torch.equal(as_dense(structured), structured.dense())


def test_a_rotation_behind_uneven_sandwich_norms_is_refused_naming_three_of_them():
    """Gemma 2 (RMSNorm gains folded) with all four sandwich norms' gains uneven: the rotation is
    refused naming the first three of them, not more; with every sandwich gain one number (the
    gains set to their first entry) the same rotation is accepted."""
    from circuitmath.io import family

    cfg = family("Gemma2").cfg
    model, folded_cfg = cm.fold_rms_norm(cm.random_state_dict(cfg, seed=0, dtype=torch.float64), cfg)
    Q = cm.random_orthogonal(cfg.d_model, seed=0)
    with pytest.raises(cm.PreconditionError, match=re.escape(
            "the sandwich norms ['blocks.0.ln1_post.w', 'blocks.0.ln2_post.w', 'blocks.1.ln1_post.w'] apply a gain")):
        cm.rotate_residual_stream(model, folded_cfg, Q)
    even = {n: torch.full_like(t, float(t[0])) if n.endswith("_post.w") else t for n, t in model.items()}
    cm.rotate_residual_stream(even, folded_cfg, Q)
