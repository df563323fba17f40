"""Records kept true, pinned where mutation testing (``make mutate``) found them unpinned: a
model that records ``remove_key_biases`` keeps zero key biases through the LayerNorm fold, which
adds ``ln1.b @ W_K`` to them; and a check's findings cannot be changed once reported."""

import dataclasses

import pytest
import torch

import circuitmath as cm

CFG = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
TOKENS = torch.tensor([[1, 4, 2, 7, 3]])


def test_key_biases_removed_stay_removed_through_the_layer_norm_fold():
    """remove_key_biases, then fold_layer_norm on a float64 LN model with nonzero ln1 biases: every
    b_K is zero again after the fold (the record stays true of the weights), both records in
    order, and the log-probs are the model's to 1e-12. Control: the fold alone gives nonzero key
    biases (ln1.b @ W_K)."""
    model = cm.random_state_dict(CFG, seed=0, dtype=torch.float64)
    assert all(model[f"blocks.{l}.ln1.b"].abs().max() > 0 for l in range(CFG.n_layers))
    removed, removed_cfg = cm.remove_key_biases(model, CFG)
    folded, folded_cfg = cm.fold_layer_norm(removed, removed_cfg)
    assert folded_cfg.applied == ("remove_key_biases", "fold_layer_norm")
    assert all(not folded[f"blocks.{l}.attn.b_K"].any() for l in range(CFG.n_layers))
    lp = cm.log_probs(model, CFG, TOKENS) - cm.log_probs(folded, folded_cfg, TOKENS)
    assert lp.abs().max() < 1e-12
    fold_alone, _ = cm.fold_layer_norm(model, CFG)
    assert all(fold_alone[f"blocks.{l}.attn.b_K"].abs().max() > 1e-3 for l in range(CFG.n_layers))


def test_a_checks_findings_cannot_be_changed():
    """Each row of check_model's diagnosis is frozen: assigning its status raises, and the row
    still says what the check found."""
    model = cm.random_state_dict(CFG, seed=0, dtype=torch.float64)
    finding = cm.testing.check_model(model, CFG).findings[0]
    status = finding.status
    with pytest.raises(dataclasses.FrozenInstanceError):
        finding.status = "changed"
    assert finding.status == status


def test_process_weights_is_decided_by_its_steps_records_not_its_own_name():
    """process_weights records its steps, never itself, and composes: run on the output of a run
    it applies nothing more; run on a config that records the name 'process_weights' and none of
    the steps (a hand-made one) it applies every step, as on a config that records nothing."""
    model = cm.random_state_dict(CFG, seed=0, dtype=torch.float64)
    out, out_cfg = cm.process_weights(model, CFG)
    assert "process_weights" not in out_cfg.applied
    assert cm.process_weights(out, out_cfg)[1].applied == out_cfg.applied
    named = CFG.replace(applied=("process_weights",))
    assert cm.process_weights(model, named)[1].applied == ("process_weights", *out_cfg.applied)
