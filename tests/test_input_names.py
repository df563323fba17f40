"""Diagnoses name tensors as the input names them: Hugging Face state dicts, folders and models
in their architecture's names (with the entries a head takes), circuitmath's only where the input
used them."""

import json
import re

import pytest
import torch
import transformers

import circuitmath as cm
from circuitmath import io
from circuitmath._cli import main
from circuitmath._diagnosis._names import InputNames
from circuitmath._hf import hf_layout
from circuitmath.testing import NotEquivalentError, assert_equivalent, check_model, diagnose


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=50, max_position_embeddings=16)).eval()


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()


def test_the_names_and_entries_of_each_view():
    names = InputNames.of(hf_layout(gpt2().config), gpt2().state_dict())
    assert names.name("blocks.1.attn.W_Q") == "transformer.h.1.attn.c_attn.weight[:, 0:32]"
    assert names.name("blocks.1.attn.W_K", (1,)) == "transformer.h.1.attn.c_attn.weight[:, 40:48]"
    assert names.name("blocks.0.attn.b_V", (0, 2)) == "transformer.h.0.attn.c_attn.bias[64:72], [80:88]"
    assert names.name("blocks.0.attn.W_O", (3,)) == "transformer.h.0.attn.c_proj.weight[24:32, :]"
    assert names.name("blocks.0.mlp.W_in") == "transformer.h.0.mlp.c_fc.weight"
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=50,
        max_position_embeddings=16))
    names = InputNames.of(hf_layout(neox.config), neox.state_dict())  # heads interleaved: [q k v] per head
    fused = "gpt_neox.layers.0.attention.query_key_value"
    assert names.name("blocks.0.attn.W_K", (1,)) == f"{fused}.weight[32:40, :]"
    assert names.name("blocks.0.attn.b_V") == f"{fused}.bias[16:24], [40:48], [64:72], [88:96]"
    names = InputNames.of(hf_layout(llama().config), llama().state_dict())
    assert names.name("blocks.1.attn.W_Q", (1,)) == "model.layers.1.self_attn.q_proj.weight[8:16, :]"
    assert names.name("blocks.1.attn._W_V", (1,)) == "model.layers.1.self_attn.v_proj.weight[8:16, :]"
    assert names.name("blocks.1.mlp.W_gate") == "model.layers.1.mlp.gate_proj.weight"
    assert names.name("blocks.1.attn.b_Q") == "blocks.1.attn.b_Q"  # made up (zeros): no name of the input's
    assert names.text("explains blocks.1.mlp.W_in and blocks.1.mlp.W_in2") == (
        "explains model.layers.1.mlp.up_proj.weight and blocks.1.mlp.W_in2")


def _one_row_wrong(state_dict, name, row=5):
    """``state_dict`` with part of one row of ``name`` changed (a whole row scaled would be a
    neuron's rescaling, which the diagnosis recovers and blames on the tensor that did not follow)."""
    after = {k: v.clone() for k, v in state_dict.items()}
    after[name][row, :7] += 0.5
    return after


@pytest.mark.parametrize("as_model", [True, False])
def test_a_hugging_face_input_is_diagnosed_in_its_names(as_model):
    model = llama()
    after = _one_row_wrong(model.state_dict(), "model.layers.1.mlp.up_proj.weight")
    found = diagnose(model, after) if as_model else diagnose(model.state_dict(), after, model.config)
    assert not found.ok
    assert {p.name for f in found.violations for p in f.parameters} == {"model.layers.1.mlp.up_proj.weight"}
    assert re.search(r"model\.layers\.1\.mlp\.up_proj\.weight \(layer 1\): max .* the largest at \[5, [0-6]\]\)",
                     str(found)), str(found)  # the row and column as the input indexes the tensor
    assert "blocks.1" not in str(found) and "W_in" not in str(found)
    with pytest.raises(NotEquivalentError) as raised:
        assert_equivalent(model, after)
    assert "model.layers.1.mlp.up_proj.weight" in str(raised.value) and "blocks.1.mlp.W_in" not in str(raised.value)
    assert raised.value.diagnosis.culprits()[0].as_dict()["circuitmath_name"] == "blocks.1.mlp.W_in"


def test_a_head_is_named_by_the_entries_it_takes():
    model = gpt2()
    after = {k: v.clone() for k, v in model.state_dict().items()}
    after["transformer.h.0.attn.c_attn.weight"][:, 72:80] *= 1.5  # head 1 of W_V
    found = diagnose(model, after)
    named = {str(p).split(" (")[0] for f in found.violations for p in f.parameters}
    assert named == {"transformer.h.0.attn.c_attn.weight[:, 72:80]"}, str(found)


def test_circuitmath_names_stay_where_the_input_used_them():
    """Control: a processing in circuitmath's names of a Hugging Face model is named as it came."""
    model = llama()
    sd, cfg = io.from_hf(model.state_dict(), model.config)
    processed, processed_cfg = cm.process_weights(sd, cfg)
    wrong = dict(processed, **{"blocks.1.mlp.W_in": processed["blocks.1.mlp.W_in"] * 1.5})
    found = diagnose(model, wrong, after_cfg=processed_cfg)
    assert not found.ok and "blocks.1.mlp.W_in" in {p.name for p in found.culprits()}
    assert "up_proj" not in str(found)


def test_a_checked_model_is_named_as_given(tmp_path):
    model = llama()
    model.save_pretrained(tmp_path / "llama")
    assert check_model(tmp_path / "llama").ok
    sd = model.state_dict()
    found = check_model(sd, model.config)
    assert found.ok  # the names only change what is printed


def test_the_cli_names_a_folder_s_tensors_as_the_folder_does(tmp_path, capsys):
    model = llama()
    model.save_pretrained(tmp_path / "in")
    assert main(["process", str(tmp_path / "in"), str(tmp_path / "out")]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shard = tmp_path / "out" / index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    tensors, metadata = io.load_tensors(shard)
    tensors["model.layers.1.mlp.up_proj.weight"][5] *= 1.01
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(shard), metadata=metadata)
    capsys.readouterr()
    assert main(["check", str(tmp_path / "in"), "--processed", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.up_proj.weight" in out and "blocks.1.mlp.W_in" not in out, out
    with pytest.raises(NotEquivalentError) as raised:
        assert_equivalent(tmp_path / "in", tmp_path / "out")
    assert "model.layers.1.mlp.up_proj.weight" in str(raised.value) and "blocks.1.mlp.W_in" not in str(raised.value)
