"""A diagnosis names the rows of a tensor that differ, as ranges, not only its largest entry: in
circuitmath's names and in the input's own (a Hugging Face tensor stored transposed)."""

import torch
import transformers

import circuitmath as cm
from circuitmath.testing import diagnose

CFG = cm.Config(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=23, n_ctx=8, d_mlp=64)


def _processed_with(rows, name="blocks.0.mlp.W_in", factor=1.01):
    model = cm.random_state_dict(CFG, seed=0, dtype=torch.float32)
    after, after_cfg = cm.process_weights(model, CFG)
    after = dict(after)
    changed = after[name].clone()
    changed[rows] *= factor
    after[name] = changed
    return model, after, after_cfg


def _culprits(found):
    """The tensors the violated rows name, each once (the identity's row and the residual name the same)."""
    return list({p.name: p for f in found.violations for p in f.parameters}.values())


def test_a_block_of_rows_is_named_as_one_range():
    model, after, after_cfg = _processed_with(list(range(4, 8)))
    found = diagnose(model, after, CFG, after_cfg=after_cfg)
    (culprit,) = _culprits(found)
    assert culprit.name == "blocks.0.mlp.W_in" and culprit.rows == ((4, 7),) and culprit.row_count == 16
    assert 4 <= culprit.at[0] <= 7
    assert "the largest at [{}, {}]); rows 4–7 (4 of 16) differ".format(*culprit.at) in str(found), str(found)
    assert culprit.as_dict()["rows"] == [[4, 7]]


def test_scattered_rows_are_named_each():
    model, after, after_cfg = _processed_with([1, 2, 9, 14], name="blocks.1.mlp.W_out")
    (culprit,) = _culprits(diagnose(model, after, CFG, after_cfg=after_cfg))
    assert culprit.rows == ((1, 2), (9, 9), (14, 14)) and culprit.row_count == 64
    assert "rows 1–2, 9, 14 (4 of 64) differ" in str(culprit)


def test_rows_within_rounding_are_not_named():
    """Negative control: a change of one ulp in other rows, beside the planted one, is rounding: only
    the planted row is named; and an untouched processing names no rows at all."""
    model, after, after_cfg = _processed_with([3])
    after["blocks.0.mlp.W_in"][10] = torch.nextafter(after["blocks.0.mlp.W_in"][10], torch.tensor(float("inf")))
    (culprit,) = _culprits(diagnose(model, after, CFG, after_cfg=after_cfg))
    assert culprit.rows == ((3, 3),)
    untouched, untouched_cfg = cm.process_weights(model, CFG)
    assert diagnose(model, untouched, CFG, after_cfg=untouched_cfg).ok


def test_a_hugging_face_tensor_names_the_entries_it_stores():
    """``up_proj.weight`` stores ``W_in`` transposed: the rows 4-7 of ``W_in`` are its columns 4:8."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=50, max_position_embeddings=16)).eval()
    after = {k: v.clone() for k, v in model.state_dict().items()}
    after["model.layers.1.mlp.up_proj.weight"][:, 4:8] *= 1.5
    found = diagnose(model, after)
    (culprit,) = _culprits(found)
    assert culprit.name == "model.layers.1.mlp.up_proj.weight" and culprit.rows == ((4, 7),)
    assert "; entries [:, 4:8] (4 of 32) differ" in str(found), str(found)


def test_one_row_of_a_gpt2_sized_block_is_named():
    """The large-model control, one layer of GPT-2 small's shape (d_model 768, 12 heads, d_mlp
    3072) and a small vocabulary: a 1 % change of one row of W_in is named with its row. The search
    for a known wrong rewrite runs only on the stages that rewrite W_in (a whole GPT-2-small-shaped
    model: benchmarks/one_row_control.py)."""
    cfg = cm.Config(n_layers=1, d_model=768, n_heads=12, d_head=64, d_vocab=64, n_ctx=32, d_mlp=3072,
                    act_fn="gelu_new")
    model = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    after, after_cfg = cm.process_weights(model, cfg)
    after = dict(after)
    after["blocks.0.mlp.W_in"] = after["blocks.0.mlp.W_in"].clone()
    after["blocks.0.mlp.W_in"][5] *= 1.01
    found = diagnose(model, after, cfg, after_cfg=after_cfg, tokens=torch.randint(0, 64, (2, 32)))
    assert not found.ok
    assert [(p.name, p.rows) for p in _culprits(found)] == [("blocks.0.mlp.W_in", ((5, 5),))]
