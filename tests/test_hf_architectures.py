"""Hugging Face GPT-2, GPT-NeoX, LLaMA and BERT, built offline from small configs with random
weights, converted with circuitmath.io: the reference forward pass reproduces HF's outputs, and
the processing identities hold on (or refuse, with a reason) the converted weights."""

import types

import pytest
import torch
import transformers

import circuitmath as cm
from circuitmath import io

VOCAB, CTX = 64, 12


def _configs():
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    return {
        "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=CTX, n_embd=24, n_layer=2, n_head=3, bos_token_id=0, eos_token_id=0)),
        "gpt2-relu-untied": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=CTX, n_embd=16, n_layer=1, n_head=2, n_inner=40,
            activation_function="relu", tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)),
        "neox-parallel-partial-rotary": (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
            vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=24, num_hidden_layers=2,
            num_attention_heads=3, intermediate_size=40, use_parallel_residual=True,
            rope_parameters=rope | {"partial_rotary_factor": 0.5}, bos_token_id=0, eos_token_id=0)),
        "neox-sequential": (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
            vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=16, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=24, use_parallel_residual=False,
            rope_parameters=rope | {"rope_theta": 500.0}, bos_token_id=0, eos_token_id=0)),
        "llama-gqa": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, rope_parameters=rope,
            bos_token_id=0, eos_token_id=0, pad_token_id=None)),
        "llama-mha-attention-bias": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=16, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=24, attention_bias=True, head_dim=6,
            rope_parameters=rope, bos_token_id=0, eos_token_id=0, pad_token_id=None)),
        "bert": (transformers.BertModel, transformers.BertConfig(
            vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=24, num_hidden_layers=2,
            num_attention_heads=3, intermediate_size=40, pad_token_id=0)),
    }


CONFIGS = _configs()
ROTARY = {name for name in CONFIGS if name.startswith(("neox", "llama"))}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's small initialisation with weights whose every part matters: unit-scale
    matrices, gains around 1 (spread 0.3), biases of size 0.5."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = torch.randn(param.shape, generator=g, dtype=torch.float64)
            if param.ndim == 1 and ("norm" in name.lower() or "ln" in name) and name.endswith("weight"):
                value = torch.exp(0.3 * value)
            elif param.ndim == 1:
                value = 0.5 * value
            else:
                value = value * param.shape[-1] ** -0.5
            param.copy_(value.to(param.dtype))


def _float64_internals(model: torch.nn.Module) -> None:
    """HF computes rotary cos/sin tables and RMSNorm in float32 even inside a float64 model.
    Swap those two computations for the same formulas evaluated in the model's dtype."""

    def rotary(self, x, position_ids):
        half = self.inv_freq.shape[0]
        base = self.config.rope_parameters["rope_theta"]
        inv_freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def rms_norm(self, hidden):
        return self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(rotary, module)
        elif kind.endswith("RMSNorm"):
            module.forward = types.MethodType(rms_norm, module)


def _build(name: str, dtype: torch.dtype, attention: str = "eager"):
    cls, config = CONFIGS[name]
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = cls(config).to(dtype).eval()
    _randomise(model, seed=sum(map(ord, name)))
    return model, config


def _hf_logits(model, name: str, tokens: torch.Tensor, state_dict) -> torch.Tensor:
    with torch.no_grad():
        if name == "bert":  # the encoder's last hidden state through the tied unembed (see from_hf_bert)
            return model(tokens).last_hidden_state @ state_dict["unembed.W_U"]
        return model(tokens).logits


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, CTX), generator=torch.Generator().manual_seed(seed))


def _max_error(name: str, dtype: torch.dtype, *, attention="eager", exact_internals=False, corrupt=None) -> float:
    model, config = _build(name, dtype, attention)
    if exact_internals:
        _float64_internals(model)
    sd, cfg = io.from_hf(model.state_dict(), config)
    assert {t.dtype for t in sd.values()} == {dtype}
    if corrupt:
        sd = corrupt(sd)
    tokens = _tokens()
    with torch.no_grad():
        ours = cm.forward(sd, cfg, tokens)
    return float((ours - _hf_logits(model, name, tokens, sd)).abs().max())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_float32_logits_match_hf(name):
    assert _max_error(name, torch.float32) <= 1e-4


@pytest.mark.parametrize("name", sorted(set(CONFIGS) - ROTARY))
def test_float64_logits_match_hf(name):
    assert _max_error(name, torch.float64) <= 1e-10


@pytest.mark.parametrize("name", sorted(ROTARY))
def test_float64_rotary_models_match_hf(name):
    # As HF runs them: its float32 rotary tables, RMSNorm and eager softmax cap the agreement.
    as_is = _max_error(name, torch.float64)
    assert 1e-12 < as_is <= 1e-5
    # With those computations in float64 (SDPA keeps the model's dtype), agreement is to rounding.
    assert _max_error(name, torch.float64, attention="sdpa", exact_internals=True) <= 1e-10


def _swap_first_two_query_heads(sd):
    sd = dict(sd)
    W_Q = sd["blocks.0.attn.W_Q"].clone()
    sd["blocks.0.attn.W_Q"] = W_Q[[1, 0, *range(2, W_Q.shape[0])]]
    return sd


def _gpt2_style_qkv_split_for_neox(sd):
    """NeoX interleaves q, k, v per head; reading its fused matrix as GPT-2's [Q | K | V] is wrong."""
    sd = dict(sd)
    Q, K = sd["blocks.0.attn.W_Q"], sd["blocks.0.attn.W_K"]
    sd["blocks.0.attn.W_Q"] = torch.cat([Q[:, :, : Q.shape[2] // 2], K[:, :, Q.shape[2] // 2:]], dim=2)
    return sd


@pytest.mark.parametrize("name,corrupt", [
    ("gpt2", _swap_first_two_query_heads),
    ("llama-gqa", _swap_first_two_query_heads),
    ("neox-parallel-partial-rotary", _gpt2_style_qkv_split_for_neox),
    ("bert", _swap_first_two_query_heads),
])
def test_negative_control_a_wrong_conversion_is_caught(name, corrupt):
    assert _max_error(name, torch.float32, corrupt=corrupt) > 1e-2


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_identity_holds_or_refuses_on_converted_weights(name):
    model, config = _build(name, torch.float64)
    sd, cfg = io.from_hf(model.state_dict(), config)
    tokens = _tokens(1)
    applicable = []
    for identity in cm.identities():
        try:
            result = identity.check(sd, cfg, tokens)
        except cm.PreconditionError as refusal:
            assert refusal.detail, f"{identity.name} refused {name} without a reason"
            continue
        assert result.passed, f"{identity.name} on {name}: {result}"
        applicable.append(identity.name)
    if cfg.normalization_type == "LN" and cfg.norm_position == "pre":
        assert "fold_layer_norm" in applicable
    if cfg.norm_position == "post":
        assert "fold_layer_norm" not in applicable


def test_converter_refuses_what_the_reference_cannot_reproduce():
    _cls, gpt2 = CONFIGS["gpt2"]
    with pytest.raises(io.UnsupportedArchitectureError, match="scale_attn_by_inverse_layer_idx"):
        io.from_hf_gpt2({}, gpt2.to_dict() | {"scale_attn_by_inverse_layer_idx": True})
    _cls, llama = CONFIGS["llama-gqa"]
    with pytest.raises(io.UnsupportedArchitectureError, match="mlp_bias"):
        io.from_hf_llama({}, llama.to_dict() | {"mlp_bias": True})
    scaled = llama.to_dict() | {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}
    with pytest.raises(io.UnsupportedArchitectureError, match="rope_type 'linear'"):
        io.from_hf_llama({}, scaled)
    with pytest.raises(io.UnsupportedArchitectureError, match="activation 'swish_weird'"):
        io.from_hf_gpt2({}, gpt2.to_dict() | {"activation_function": "swish_weird"})


def test_converter_refuses_tensors_it_does_not_use_and_missing_ones():
    model, config = _build("gpt2", torch.float32)
    sd = dict(model.state_dict())
    with pytest.raises(cm.StateDictError, match=r"does not use: \['transformer.h.0.adapter.weight'\]|adapter"):
        io.from_hf(sd | {"transformer.h.0.adapter.weight": torch.zeros(2)}, config)
    del sd["transformer.h.1.ln_2.bias"]
    with pytest.raises(cm.StateDictError, match="no tensor 'h.1.ln_2.bias'"):
        io.from_hf(sd, config)


def test_converters_accept_config_json_dicts_and_keep_the_input_intact():
    model, config = _build("neox-sequential", torch.float32)
    hf_sd = model.state_dict()
    before = {k: v.clone() for k, v in hf_sd.items()}
    from_object = io.from_hf(hf_sd, config)
    from_dict = io.from_hf(hf_sd, config.to_dict())
    assert from_object[1] == from_dict[1]
    assert all(torch.equal(from_object[0][k], from_dict[0][k]) for k in from_object[0])
    assert all(torch.equal(before[k], hf_sd[k]) for k in before)
    assert from_dict[1].rotary_base == 500.0 and not from_dict[1].parallel_attn_mlp
