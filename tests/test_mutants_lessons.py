"""What the diagnosis learns of a wrong rewrite (``_diagnosis/_lessons.py``), pinned where
mutation testing (``make mutate``) found it unpinned: the lesson is learnt on the model cut to one
layer where that is smaller, on the model itself where nothing is cut, and is what the rewrite
records and touches."""

import pytest
import torch

import circuitmath as cm
from circuitmath._diagnosis._lessons import Lessons, cut_model


def _recording(calls):
    """fold_layer_norm, noting the number of layers and tokens of each model it is run on."""
    def function(state, cfg):
        calls.append((cfg.n_layers, state["embed.W_E"].shape[0]))
        return cm.fold_layer_norm(state, cfg)
    return function


@pytest.mark.parametrize("n_layers, d_vocab, run_on", [(1, 11, (1, 11)), (3, 40, (1, 16))], ids=["uncut", "cut"])
def test_a_lesson_is_learnt_once_on_the_smallest_model_that_stands_for_the_whole(n_layers, d_vocab, run_on):
    """fold_layer_norm's lesson: it records itself and touches every LayerNorm and reader of a
    layer (by layer pattern), learnt on the model cut to one layer and 16 tokens (3 layers, 40
    tokens) or on the model itself (1 layer, 11 tokens: nothing to cut), and run once for two asks.
    A rewrite that does not fit (raises) teaches ``None``."""
    cfg = cm.Config(n_layers=n_layers, d_model=8, n_heads=2, d_head=4, d_vocab=d_vocab, n_ctx=5, d_mlp=16)
    state = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    lessons, calls = Lessons(), []
    found = lessons.learn("fold_layer_norm", _recording(calls), state, cfg)
    assert found is not None and found.records == ("fold_layer_norm",)
    assert {"blocks.*.ln1.w", "blocks.*.ln1.b", "blocks.*.attn.W_Q", "blocks.*.mlp.W_in", "blocks.*.mlp.b_in",
            "ln_final.w", "unembed.W_U", "unembed.b_U"} <= found.touches
    assert "blocks.*.attn.W_O" not in found.touches and "embed.W_E" not in found.touches
    assert found.touches_any(["blocks.2.mlp.W_in"] if n_layers > 2 else ["blocks.0.mlp.W_in"])
    assert lessons.learn("fold_layer_norm", _recording(calls), state, cfg) is found
    assert calls == [run_on]
    assert lessons.known("fold_layer_norm", cfg) is found

    def refusing(state, cfg):
        raise cm.PreconditionError("refused")
    assert lessons.learn("refusing", refusing, state, cfg) is None


@pytest.mark.parametrize("n_layers, d_vocab, cut_to", [(1, 16, None), (1, 17, (1, 16)), (2, 16, (1, 16)), (2, 5, (1, 5))])
def test_a_model_is_cut_to_one_layer_and_16_tokens_only_where_that_is_smaller(n_layers, d_vocab, cut_to):
    """cut_model at its edges: one layer of 16 tokens is nothing to cut (``None``); one token or
    one layer more is cut to one layer of at most 16 tokens, every kept tensor the model's values."""
    cfg = cm.Config(n_layers=n_layers, d_model=8, n_heads=2, d_head=4, d_vocab=d_vocab, n_ctx=5, d_mlp=16)
    state = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    small, small_cfg = cut_model(state, cfg)
    if cut_to is None:
        assert small is None and small_cfg == cfg
        return
    assert (small_cfg.n_layers, small_cfg.d_vocab) == cut_to
    assert set(small) == {name for name in state if not name.startswith("blocks.") or name.startswith("blocks.0.")}
    assert torch.equal(small["embed.W_E"], state["embed.W_E"][:cut_to[1]])
    assert torch.equal(small["unembed.W_U"], state["unembed.W_U"][:, :cut_to[1]])
    assert torch.equal(small["blocks.0.mlp.W_in"], state["blocks.0.mlp.W_in"])
