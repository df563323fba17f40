"""Behaviours of the streamed paths that mutation testing (``make mutate``) found unpinned, each
pinned by a test that the mutant it names fails."""

import pytest
import torch

import circuitmath as cm
from circuitmath import io

GATED_LN = cm.Config(n_layers=3, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16, gated_mlp=True,
                     act_fn="silu")


def test_a_precondition_broken_in_a_later_block_names_that_block_when_streamed(tmp_path):
    """A gated LayerNorm model whose block 1 alone has a nonzero ln2.b in front of W_gate (no
    bias): folding is refused on the streamed checkpoint as in memory, the detail naming
    blocks.1 (the part is processed as a one-block model, whose names say blocks.0)."""
    state_dict = cm.random_state_dict(GATED_LN, seed=0, dtype=torch.float32)
    for layer in (0, 2):
        state_dict[f"blocks.{layer}.ln2.b"] = torch.zeros_like(state_dict[f"blocks.{layer}.ln2.b"])
    with pytest.raises(cm.PreconditionError) as in_memory:
        cm.fold_layer_norm(state_dict, GATED_LN)
    io.save(tmp_path / "m.safetensors", state_dict, GATED_LN)
    with pytest.raises(cm.PreconditionError) as streamed:
        io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "out", steps=["fold_ln"])
    assert "blocks.1.mlp.W_gate" in in_memory.value.detail  # control: the block that breaks it
    assert streamed.value.detail == in_memory.value.detail
    assert str(streamed.value) == str(in_memory.value)


def test_a_streamed_report_prints_a_ruled_table_then_the_explanations():
    """The table of check --processed: a header, a rule as wide as each column, one line a row
    (None as '-'), then each row's explanation."""
    from circuitmath._streaming_check_processed import StreamingReport

    report = StreamingReport([
        {"name": "log-probs", "status": "holds", "max_abs_error": 1.5e-6, "tolerance": 1e-4, "explanation": "within"},
        {"name": "tensors", "status": "violated", "max_abs_error": None, "tolerance": None, "explanation": "W_U"},
    ])
    assert str(report).splitlines() == [
        "check      status    max |Δ|  tolerance",
        "---------  --------  -------  ---------",
        "log-probs  holds     1.5e-06  0.0001",
        "tensors    violated  -        -",
        "",
        "log-probs: within",
        "tensors: W_U",
    ]
