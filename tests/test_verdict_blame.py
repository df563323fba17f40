"""Blame lands on the cause: heads and neurons permuted by hand, anywhere in a composition, are
recovered (exact where every tensor of those units moved, else the wrong rewrite ``.partial``);
a dropped fold is blamed on the fold; ``culprits()`` names every tensor a violated row names;
naming a wrong rewrite builds no proof."""

import pytest
import torch

import circuitmath as cm
from circuitmath import _identities
from circuitmath._registry import Identity
from circuitmath._twin_descriptions import TWIN_DESCRIPTIONS
from circuitmath.testing import diagnose

CFG = cm.Config(n_layers=2, d_model=16, n_heads=3, d_head=4, d_vocab=40, n_ctx=8, d_mlp=32)


@pytest.fixture(scope="module")
def model():
    before = cm.random_state_dict(CFG, seed=3)
    return before, *cm.process_weights(before, CFG)


def _rows(found):
    return {f.name: (f.status, f.rewrite) for f in found.findings}


def _swapped(tensor, axis, i=0, j=2):
    index = list(range(tensor.shape[axis]))
    index[i], index[j] = j, i
    return tensor.index_select(axis, torch.tensor(index))


def test_two_heads_w_o_swapped_is_blamed_on_a_partial_head_permutation(model):
    before, processed, processed_cfg = model
    after = dict(processed, **{"blocks.1.attn.W_O": _swapped(processed["blocks.1.attn.W_O"], 0)})
    found = diagnose(before, after, CFG, after_cfg=processed_cfg)
    assert not found.ok
    assert _rows(found)["permute_heads"] == ("violated", "permute_heads.partial")
    assert _rows(found)["center_writing_weights"] == ("holds", "exact")
    assert [p.name for p in found.culprits()] == ["blocks.1.attn.W_O"]


def test_one_mlp_s_output_rows_swapped_is_blamed_on_a_partial_neuron_permutation(model):
    before, processed, processed_cfg = model
    after = dict(processed, **{"blocks.0.mlp.W_out": _swapped(processed["blocks.0.mlp.W_out"], 0, 3, 7)})
    found = diagnose(before, after, CFG, after_cfg=processed_cfg)
    assert not found.ok and _rows(found)["permute_neurons"] == ("violated", "permute_neurons.partial")
    assert [p.name for p in found.culprits()] == ["blocks.0.mlp.W_out"]


@pytest.mark.parametrize("kind", ["heads", "neurons"])
def test_units_permuted_before_processing_are_recovered_as_exact(kind):
    """Control: the same units permuted in every tensor, before the processing: exact, passes."""
    before = cm.random_state_dict(CFG, seed=3)
    if kind == "heads":
        permuted, _ = cm.permute_heads(before, CFG, torch.tensor([[2, 0, 1], [0, 1, 2]]))
    else:
        permuted, _ = cm.permute_neurons(before, CFG, torch.stack([torch.arange(32).flip(0), torch.arange(32)]))
    after, after_cfg = cm.process_weights(permuted, CFG)
    found = diagnose(before, after, CFG, after_cfg=after_cfg)
    assert found.ok and _rows(found)[f"permute_{kind}"] == ("holds", "exact")


def test_a_dropped_final_norm_bias_fold_is_blamed_on_the_fold(model):
    before, processed, processed_cfg = model
    unbiased, _ = cm.process_weights(dict(before, **{"ln_final.b": torch.zeros_like(before["ln_final.b"])}), CFG)
    after = dict(processed, **{"unembed.b_U": unbiased["unembed.b_U"]})  # centred, but ln_final.b not folded in
    found = diagnose(before, after, CFG, after_cfg=processed_cfg)
    assert not found.ok
    assert _rows(found)["fold_layer_norm"] == ("violated", "fold_layer_norm.drop_bias")
    assert _rows(found)["center_unembed"] == ("holds", "exact")
    assert [p.name for p in found.culprits()] == ["unembed.b_U"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_culprits_name_the_tensor_of_a_one_row_change(model, dtype):
    before, processed, processed_cfg = model
    before = {k: v.to(dtype) for k, v in before.items()}
    processed, processed_cfg = cm.process_weights(before, CFG)
    changed = processed["blocks.0.mlp.W_in"].clone()
    changed[3] = (changed[3].double() * 1.01).to(dtype)
    found = diagnose(before, dict(processed, **{"blocks.0.mlp.W_in": changed}), CFG, after_cfg=processed_cfg)
    assert not found.ok and [p.name for p in found.culprits()] == ["blocks.0.mlp.W_in"]


def test_the_stored_twin_descriptions_are_the_proofs():
    expected = {}
    for identity in _identities.identities():
        for twin in identity.proof.twins:
            wrong = identity.wrong_rewrites.get(twin.name)
            if wrong is not None and not wrong.description:
                expected.setdefault(identity.name, {}).setdefault(twin.name, twin.description)
    assert TWIN_DESCRIPTIONS == expected, f"write circuitmath/_twin_descriptions.py's dict as {expected!r}"


def test_a_failing_check_builds_no_proof(model, monkeypatch):
    """Naming a wrong rewrite takes its twin's stored description: with building a proof made to
    fail, the diagnosis of a dropped fold still names and describes it (and the trap does fail a
    proof built: the control)."""
    before, processed, processed_cfg = model
    monkeypatch.setattr(Identity, "proof", property(lambda self: pytest.fail(f"built the proof of {self.name}")))
    with pytest.raises(pytest.fail.Exception):
        _identities.get_identity("fold_layer_norm").prove()
    unbiased, _ = cm.process_weights(dict(before, **{"ln_final.b": torch.zeros_like(before["ln_final.b"])}), CFG)
    found = diagnose(before, dict(processed, **{"unembed.b_U": unbiased["unembed.b_U"]}), CFG, after_cfg=processed_cfg)
    assert "fold_layer_norm.drop_bias explains unembed.b_U: forget the LayerNorm bias term b W" in str(found)
