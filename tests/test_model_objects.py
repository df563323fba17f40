"""Model objects in: ``transformers`` models, TransformerLens bridges and any ``nn.Module``, read
once at the public boundary, through every checker (tiny random models built offline)."""

import copy
import logging
import warnings

import pytest
import torch
import transformers

import circuitmath as cm
from circuitmath import io
from circuitmath._errors import StateDictError
from circuitmath._reference import log_probs
from circuitmath.testing import (
    NotEquivalentError,
    assert_equivalent,
    assert_fold_layer_norm,
    check_model,
    diagnose,
)

FAMILIES = {
    "gpt2": (transformers.GPT2LMHeadModel, "GPT2LMHeadModel", lambda: transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)),
    "llama": (transformers.LlamaForCausalLM, "LlamaForCausalLM", lambda: transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=50, max_position_embeddings=16)),
    "neox": (transformers.GPTNeoXForCausalLM, "GPTNeoXForCausalLM", lambda: transformers.GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=50,
        max_position_embeddings=16, rotary_pct=0.5)),
}


def tiny(family: str):
    """A tiny random ``transformers`` model of ``family`` whose norms are not the identity."""
    model_class, _, config = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config()).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or "ln" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def bridge_of(model, family: str):
    """A TransformerLens 4.3 bridge over a copy of ``model`` (building one rewrites the module)."""
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    copied = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return build_bridge_from_module(copied, FAMILIES[family][1], hf_config=copied.config)
        finally:
            logging.disable(logging.NOTSET)


TOKENS = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_model_is_read_with_its_config(family):
    model = tiny(family)
    state_dict, cfg = io.from_hf(model.state_dict(), model.config)
    processed, processed_cfg = cm.process_weights(state_dict, cfg)
    assert_equivalent(model, processed, after_cfg=processed_cfg)
    assert check_model(model).ok
    # negative control: a 1 % change of one row of one weight
    wrong = dict(processed, **{"blocks.1.mlp.W_out": processed["blocks.1.mlp.W_out"].clone()})
    wrong["blocks.1.mlp.W_out"][3] *= 1.5
    with pytest.raises(NotEquivalentError):
        assert_equivalent(model, wrong, after_cfg=processed_cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bridge_reads_as_its_forward_pass_computes(family):
    """The bridge's tensors, read by circuitmath, compute the bridge's own log-probs, before and
    after TransformerLens processes them (its tl_parameters() alone would not: after
    process_weights its biases and norms there are stale copies)."""
    bridge = bridge_of(tiny(family), family)
    for processed in (False, True):
        if processed:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                bridge.process_weights()
        from circuitmath._models import as_state_dict

        state_dict, cfg = as_state_dict(bridge)
        with torch.no_grad():
            theirs = torch.log_softmax(bridge(TOKENS).double(), -1)
        assert (log_probs(state_dict, cfg, TOKENS).double() - theirs).abs().max() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bridge_processed_by_transformer_lens_checks_against_the_model(family):
    model = tiny(family)
    before, after = bridge_of(model, family), bridge_of(model, family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after.process_weights()
    assert_equivalent(before, after)
    assert_equivalent(model, after)
    assert diagnose(before, after).ok
    assert check_model(before).ok
    # negative control: a weight changed where the bridge's forward pass reads it
    with torch.no_grad():
        after.state_dict()["blocks.1.mlp.out.weight"][1] *= 1.5
    with pytest.raises(NotEquivalentError):
        assert_equivalent(before, after)


def test_the_per_identity_checkers_take_model_objects():
    model = tiny("gpt2")
    state_dict, cfg = io.from_hf(model.state_dict(), model.config)
    folded, folded_cfg = cm.fold_layer_norm(state_dict, cfg)
    assert_fold_layer_norm(model, folded, after_cfg=folded_cfg)


def _module_of(state_dict):
    """A plain ``nn.Module`` whose ``state_dict()`` is ``state_dict`` (TransformerLens names)."""
    root = torch.nn.Module()
    for name, tensor in state_dict.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.clone()))
    return root


def test_any_module_in_a_supported_naming():
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    weights = cm.random_state_dict(cfg, seed=0)
    folded, folded_cfg = cm.fold_layer_norm(weights, cfg)
    assert_equivalent(_module_of(weights), _module_of(folded), cfg, after_cfg=folded_cfg)
    assert_equivalent(_module_of(weights), folded, cfg)  # after read against the module's config
    with pytest.raises(StateDictError, match="has no .config: pass its config"):
        assert_equivalent(_module_of(weights), folded)
