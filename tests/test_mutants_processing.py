"""Behaviours of the transforms that mutation testing (``make mutate``) found unpinned, each pinned
by a test that the mutant it names fails."""

import pytest
import torch

import circuitmath as cm
from circuitmath._errors import OverflowedError

CFG = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)


def test_a_half_precision_model_processed_by_parts_that_overflows_when_rounded_is_refused():
    """A float16 model whose block 1 folds a gain of 300 into a W_in of entries up to about 1000:
    processed a part at a time in float32 (the refactor asked for), the folded W_in exceeds
    float16's range when rounded back, and the rounding is refused, naming the tensor; in float32
    the same processing is finite (the control)."""
    model = cm.random_state_dict(CFG, seed=0, dtype=torch.float32)
    model["blocks.1.ln2.w"] = torch.full_like(model["blocks.1.ln2.w"], 300.0)
    model["blocks.1.mlp.W_in"] = torch.randn(model["blocks.1.mlp.W_in"].shape, generator=torch.Generator().manual_seed(0)) * 300
    half = {name: tensor.half() for name, tensor in model.items()}
    in_float32, _ = cm.process_weights({n: t.float() for n, t in half.items()}, CFG, refactor_factored_attn_matrices=True)
    assert all(t.isfinite().all() for t in in_float32.values())
    assert in_float32["blocks.1.mlp.W_in"].abs().max() > torch.finfo(torch.float16).max
    with pytest.raises(OverflowedError, match=r"rounding the processed weights to torch\.float16 overflowed.*blocks\.1\.mlp\.W_in"):
        cm.process_weights(half, CFG, refactor_factored_attn_matrices=True)
