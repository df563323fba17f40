"""Blame lands on the cause: heads and neurons permuted by hand, anywhere in a composition, are
recovered (exact where every tensor of those units moved, else the wrong rewrite ``.partial``);
a dropped fold is blamed on the fold; ``culprits()`` names every tensor a violated row names."""

import pytest
import torch

import circuitmath as cm
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
