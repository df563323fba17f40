"""Softcaps (Gemma 2): proved what survives them and what does not, and checked on weights whose
logits and scores reach the cap. Centering the unembedding and removing key biases are refused
(a shift is not a shift once capped: the twins the engine rejects); folding the norms, folding
value biases and the QK refactor stay exact (the cap acts after the linear map)."""

import dataclasses

import pytest
import torch

import circuitmath as cm
from circuitmath import testing
from circuitmath._identities._softcaps import ENTRY, capped_rows_sum_to_one, fold_before_the_logit_softcap

BASE = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=6, d_mlp=16)
CAPPED = BASE.replace(attn_softcap=2.0, logit_softcap=3.0)
TOKENS = torch.tensor([[1, 4, 2, 7, 0, 3], [5, 5, 9, 10, 2, 8]])


def _biting(cfg):
    """Weights whose logits reach the logit cap and whose scores reach the attention cap, with
    gains away from 1 and nonzero key biases."""
    sd = cm.random_state_dict(cfg, seed=1, dtype=torch.float64)
    sd["unembed.W_U"] = sd["unembed.W_U"] * 20
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        sd[f"{p}.attn.W_Q"] = sd[f"{p}.attn.W_Q"] * 6
        sd[f"{p}.attn.b_K"] = torch.randn(sd[f"{p}.attn.b_K"].shape, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(layer)) * 3
        for norm in ("ln1", "ln2"):
            sd[f"{p}.{norm}.w"] = 1 + 0.5 * torch.rand(cfg.d_model, dtype=torch.float64,
                                                       generator=torch.Generator().manual_seed(10 + layer))
    return sd


def _gap(a, a_cfg, b, b_cfg):
    return float((cm.log_probs(a, a_cfg, TOKENS) - cm.log_probs(b, b_cfg, TOKENS)).abs().max())


def test_the_logits_reach_the_cap():
    logits = cm.forward(_biting(CAPPED), CAPPED, TOKENS)
    assert float(logits.abs().max()) > 0.95 * CAPPED.logit_softcap
    uncapped = cm.forward(_biting(BASE), BASE, TOKENS)
    assert float(uncapped.abs().max()) > 3 * CAPPED.logit_softcap


@pytest.mark.parametrize("name, twin", [("center_unembed", "under_logit_softcap"),
                                         ("remove_key_biases", "under_attention_softcap")])
def test_the_shift_under_a_softcap_is_a_twin_the_engine_rejects(name, twin):
    report = cm.get_identity(name).prove()
    assert report.ok
    found = next(t for t in report.twins if t.name == twin)
    assert found.rejected and found.counterexample_gap > 1e-4
    assert "tanh" in found.claim


@pytest.mark.parametrize("lemma", [fold_before_the_logit_softcap, capped_rows_sum_to_one])
def test_what_holds_under_a_softcap_is_proved_and_a_wrong_version_is_not(lemma):
    proof = lemma()
    report = proof.verify()
    assert report.proved and report.ok and report.symbolic_dims
    wrong = dataclasses.replace(proof, rhs=proof.rhs * 2, steps=(*proof.steps[:-1], dataclasses.replace(
        proof.steps[-1], expr=proof.steps[-1].expr * 2)))
    assert not wrong.verify().proved


def test_the_lemmas_are_part_of_the_identities_they_qualify():
    assert "fold_before_the_logit_softcap" in dict(cm.get_identity("center_unembed").proof.lemmas)
    assert "capped_rows_sum_to_one" in dict(cm.get_identity("fold_value_biases").proof.lemmas)
    assert ENTRY.shape == (1, 1)


@pytest.mark.parametrize("name, feature", [("center_unembed", "no logit softcap"),
                                           ("remove_key_biases", "no attention-score softcap")])
def test_a_shift_under_a_softcap_is_refused_naming_identity_and_feature_and_would_change_the_model(name, feature):
    sd = _biting(CAPPED)
    with pytest.raises(cm.PreconditionError, match=f"{name}: precondition '{feature}'.*softcap"):
        getattr(cm, name)(sd, CAPPED)
    identity = cm.get_identity(name)
    regardless = identity.wrong_rewrites["regardless"]
    after, after_cfg = regardless(sd, CAPPED)
    assert _gap(sd, CAPPED, after, after_cfg) > 1e-3  # what the refusal prevents
    # control: without the softcap the same rewrite is exact on the same weights
    plain = BASE
    after, after_cfg = regardless(sd, plain)
    assert _gap(sd, plain, after, after_cfg) < 1e-10


@pytest.mark.parametrize("name", ["fold_layer_norm", "fold_value_biases", "refactor_factored_attn_matrices"])
def test_a_rewrite_that_keeps_the_logits_or_scores_themselves_is_exact_under_both_caps(name):
    sd = _biting(CAPPED)
    out, out_cfg = getattr(cm, name)(sd, CAPPED)
    assert _gap(sd, CAPPED, out, out_cfg) < 1e-10
    assert cm.get_identity(name).check(sd, CAPPED).passed


def test_the_rms_fold_is_exact_under_a_logit_softcap():
    cfg = CAPPED.replace(normalization_type="RMS", gated_mlp=True, act_fn="silu", positional_embedding_type="rotary")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    sd["unembed.W_U"] = sd["unembed.W_U"] * 20
    sd["ln_final.w"] = 1 + torch.rand(cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out, out_cfg = cm.fold_rms_norm(sd, cfg)
    assert _gap(sd, cfg, out, out_cfg) < 1e-10
    # negative control: the final gain dropped instead of folded moves the capped log-probs
    out["unembed.W_U"] = sd["unembed.W_U"]
    assert _gap(sd, cfg, out, out_cfg) > 1e-3


@pytest.mark.parametrize("name, feature", [("center_unembed", "logit softcap"),
                                           ("remove_key_biases", "attention-score softcap")])
def test_the_checker_names_a_shift_made_under_a_softcap(name, feature):
    """A model processed with the shift anyway: refused, and the row says which identity's rewrite
    it was, applied although its precondition (the softcap) forbids it."""
    sd = _biting(CAPPED)
    after, after_cfg = cm.get_identity(name).wrong_rewrites["regardless"](sd, CAPPED)
    report = testing.CHECKERS[name](sd, after, CAPPED, after_cfg=after_cfg)
    assert not report.ok
    row = next(f for f in report.findings if f.name == name)
    assert row.rewrite == f"{name}.regardless" and row.status == "violated"
    assert feature in str(report)
    # control: the same shift on the model without the softcap is the identity itself
    plain_after, plain_cfg = cm.get_identity(name).wrong_rewrites["regardless"](sd, BASE)
    assert testing.CHECKERS[name](sd, plain_after, BASE, after_cfg=plain_cfg).ok
