"""The Hugging Face converters beneath :mod:`circuitmath.io`: one :class:`Layout` of names and
shapes per architecture, used whole (``from_hf_*``) or a part at a time
(:mod:`circuitmath._checkpoint`). GPT-2, GPT-NeoX and BERT are here, BLOOM in
:mod:`circuitmath._hf_bloom`, the other families in :mod:`circuitmath._hf_families`;
:func:`hf_layout` picks one by ``model_type``.
"""

from __future__ import annotations

import torch

from ._config import Config
from ._hf_bloom import _bloom_layout, from_hf_bloom
from ._hf_families import (
    _cohere_layout,
    _falcon_layout,
    _gptj_layout,
    _llama_layout,
    _olmo2_layout,
    _opt_layout,
    from_hf_cohere,
    from_hf_falcon,
    from_hf_gemma,
    from_hf_gemma2,
    from_hf_gemma3,
    from_hf_gptj,
    from_hf_llama,
    from_hf_mistral,
    from_hf_olmo2,
    from_hf_opt,
    from_hf_phi3,
    from_hf_qwen2,
    from_hf_qwen3,
)
from ._hf_moe import MOE_CONVERTERS, MOE_LAYOUTS
from ._hf_source import (  # noqa: F401  (re-exported: the checkpoint, the stored layout and the tests read them here)
    Layout,
    UnsupportedArchitectureError,
    _activation,
    _dimensions,
    _heads_from_columns,
    _int,
    _linear_heads,
    _number,
    _option,
    _require,
    _tied,
    _rotary,
    _Source,
)
from ._state import StateDict

# No __all__: circuitmath.io lists the public names (one list), and the package imports the rest by name.


def from_hf_gpt2(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face GPT-2 checkpoint (``GPT2Model`` or ``GPT2LMHeadModel``).

    GPT-2 stores its projections as ``Conv1D`` (``x @ W + b``, already row-vector). ``c_attn``
    holds ``[W_Q | W_K | W_V]`` side by side, each with its heads side by side. Without an
    ``lm_head.weight`` the unembed is the tied ``wte``; ``b_U`` is zero.
    """
    return _gpt2_layout(config).convert(state_dict)


def _gpt2_layout(config) -> Layout:
    arch = "GPT-2"
    d, heads, layers = _int(config, "n_embd", arch), _int(config, "n_head", arch), _int(config, "n_layer", arch, floor=0)
    _require(d % heads == 0, arch, f"n_embd={d} is not a multiple of n_head={heads}")
    d_head, d_mlp = d // heads, _int(config, "n_inner", arch, None) or 4 * d
    _require(_option(config, "scale_attn_weights", True), arch, "scale_attn_weights=False (no 1/sqrt(d_head))")
    _require(not _option(config, "scale_attn_by_inverse_layer_idx", False), arch,
             "scale_attn_by_inverse_layer_idx=True divides scores by the layer number")
    _require(not _option(config, "add_cross_attention", False), arch, "cross-attention")
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_int(config, "vocab_size", arch),
        n_ctx=_int(config, "n_positions", arch), d_mlp=d_mlp,
        act_fn=_activation(_option(config, "activation_function", "gelu_new"), "activation_function", arch),
        eps=_number(config, "layer_norm_epsilon", arch, 1e-5), tied_embeddings=_tied(config, True),
    )

    def embed(src: _Source) -> dict:
        return {"embed.W_E": src.take("wte.weight", cfg.d_vocab, d), "pos_embed.W_pos": src.take("wpe.weight", cfg.n_ctx, d)}

    def block(src: _Source, layer: int) -> dict:
        h, p, out = f"h.{layer}", f"blocks.{layer}", {}
        out[f"{p}.ln1.w"], out[f"{p}.ln1.b"] = src.take(f"{h}.ln_1.weight"), src.take(f"{h}.ln_1.bias")
        qkv_w, qkv_b = src.take(f"{h}.attn.c_attn.weight", d, 3 * d), src.take(f"{h}.attn.c_attn.bias", 3 * d)
        for i, name in enumerate("QKV"):
            out[f"{p}.attn.W_{name}"] = _heads_from_columns(qkv_w[:, i * d:(i + 1) * d], heads, d_head)
            out[f"{p}.attn.b_{name}"] = qkv_b[i * d:(i + 1) * d].reshape(heads, d_head)
        out[f"{p}.attn.W_O"] = src.take(f"{h}.attn.c_proj.weight", d, d).reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.attn.c_proj.bias")
        out[f"{p}.ln2.w"], out[f"{p}.ln2.b"] = src.take(f"{h}.ln_2.weight"), src.take(f"{h}.ln_2.bias")
        out[f"{p}.mlp.W_in"], out[f"{p}.mlp.b_in"] = src.take(f"{h}.mlp.c_fc.weight"), src.take(f"{h}.mlp.c_fc.bias")
        out[f"{p}.mlp.W_out"] = src.take(f"{h}.mlp.c_proj.weight")
        out[f"{p}.mlp.b_out"] = src.take(f"{h}.mlp.c_proj.bias")
        return out

    def final(src: _Source) -> dict:
        tied = "lm_head.weight" not in src
        _require(not tied or cfg.tied_embeddings, arch, "no lm_head.weight and untied embeddings")
        return {
            "ln_final.w": src.take("ln_f.weight"), "ln_final.b": src.take("ln_f.bias"),
            "unembed.W_U": src.take("wte.weight", cfg.d_vocab, d).T if tied else src.linear("lm_head.weight", cfg.d_vocab, d),
            "unembed.b_U": src.zeros(cfg.d_vocab),
        }

    # causal-mask buffers
    return Layout(cfg, ("transformer.",), r"h\.\d+\.attn\.(masked_)?bias", embed, block, final)


def from_hf_gpt_neox(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face GPT-NeoX checkpoint (``GPTNeoXModel`` or ``GPTNeoXForCausalLM``).

    ``query_key_value`` is a ``Linear`` whose output is laid out per head as ``[q | k | v]``
    (``3 * d_head`` rows per head). ``use_parallel_residual`` maps to ``parallel_attn_mlp``;
    ``rotary_pct`` / ``partial_rotary_factor`` to ``rotary_dim``. The unembed (``embed_out``,
    named ``lm_head`` by transformers 5) has no bias (``b_U`` is zero).
    """
    return _gpt_neox_layout(config).convert(state_dict)


def _gpt_neox_layout(config) -> Layout:
    arch = "GPT-NeoX"
    d, heads, layers = _dimensions(config, arch)
    d_head = d // heads
    base, rotary_dim = _rotary(config, d_head, arch)
    bias = bool(_option(config, "attention_bias", True))
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_int(config, "vocab_size", arch),
        n_ctx=_int(config, "max_position_embeddings", arch), d_mlp=_int(config, "intermediate_size", arch),
        act_fn=_activation(_option(config, "hidden_act", "gelu"), "hidden_act", arch), eps=_number(config, "layer_norm_eps", arch, 1e-5),
        positional_embedding_type="rotary", rotary_dim=rotary_dim, rotary_base=base,
        parallel_attn_mlp=bool(_option(config, "use_parallel_residual", True)), tied_embeddings=_tied(config, False),
    )
    m = cfg.d_mlp

    def embed(src: _Source) -> dict:
        return {"embed.W_E": src.take("embed_in.weight", cfg.d_vocab, d)}

    def block(src: _Source, layer: int) -> dict:
        h, p, out = f"layers.{layer}", f"blocks.{layer}", {}
        out[f"{p}.ln1.w"], out[f"{p}.ln1.b"] = src.take(f"{h}.input_layernorm.weight"), src.take(f"{h}.input_layernorm.bias")
        qkv = src.linear(f"{h}.attention.query_key_value.weight", 3 * d, d).reshape(d, heads, 3, d_head)
        qkv_b = src.take(f"{h}.attention.query_key_value.bias", 3 * d).reshape(heads, 3, d_head) if bias else None
        for i, name in enumerate("QKV"):
            out[f"{p}.attn.W_{name}"] = qkv[:, :, i, :].permute(1, 0, 2)
            out[f"{p}.attn.b_{name}"] = qkv_b[:, i, :] if bias else src.zeros(heads, d_head)
        out[f"{p}.attn.W_O"] = src.linear(f"{h}.attention.dense.weight", d, d).reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.attention.dense.bias") if bias else src.zeros(d)
        out[f"{p}.ln2.w"] = src.take(f"{h}.post_attention_layernorm.weight")
        out[f"{p}.ln2.b"] = src.take(f"{h}.post_attention_layernorm.bias")
        out[f"{p}.mlp.W_in"], out[f"{p}.mlp.b_in"] = src.linear(f"{h}.mlp.dense_h_to_4h.weight", m, d), src.take(f"{h}.mlp.dense_h_to_4h.bias")
        out[f"{p}.mlp.W_out"], out[f"{p}.mlp.b_out"] = src.linear(f"{h}.mlp.dense_4h_to_h.weight", d, m), src.take(f"{h}.mlp.dense_4h_to_h.bias")
        return out

    def final(src: _Source) -> dict:
        head = next((n for n in ("embed_out.weight", "lm_head.weight") if n in src), None)  # transformers 4 / 5 name
        _require(head is not None or cfg.tied_embeddings, arch, "no unembed and untied embeddings")
        return {
            "ln_final.w": src.take("final_layer_norm.weight"), "ln_final.b": src.take("final_layer_norm.bias"),
            "unembed.W_U": src.linear(head, cfg.d_vocab, d) if head else src.take("embed_in.weight", cfg.d_vocab, d).T,
            "unembed.b_U": src.zeros(cfg.d_vocab),
        }

    ignored = r"(layers\.\d+\.attention\.)?(rotary_emb\.inv_freq|(masked_)?bias)"
    return Layout(cfg, ("gpt_neox.",), ignored, embed, block, final)


def from_hf_bert(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face BERT encoder (``BertModel``, or the ``bert.`` part of a task model).

    Post-LN: each block is ``x = LN1(x + attn(x)); x = LN2(x + mlp(x))`` with bidirectional
    attention, after an embedding LayerNorm (``embed.ln``). Two choices make it fit the
    reference, both exact for the inputs they cover:

    - token type 0 (a single segment, every sentence-embedding input) is folded into ``W_pos``:
      ``W_pos + token_type_embeddings[0]``; segment-pair inputs are not represented;
    - the unembed is the tied word embedding, ``W_U = W_E^T``, ``b_U = 0`` (the matrix of BERT's
      masked-LM decoder), so logits are ``hidden @ W_E^T``: the encoder's last hidden state is
      reproduced, and the log-probs the identity checks compare are a function of all of it.

    The pooler and task heads (``pooler.*``, ``cls.*``) are outside the encoder and are not
    converted.
    """
    return _bert_layout(config).convert(state_dict)


def _bert_layout(config) -> Layout:
    arch = "BERT"
    d, heads, layers = _dimensions(config, arch)
    _require(_option(config, "position_embedding_type", "absolute") == "absolute", arch,
             f"position_embedding_type={_option(config, 'position_embedding_type')!r}; only absolute positions")
    _require(not _option(config, "is_decoder", False), arch, "is_decoder=True (a causal BERT)")
    d_head = d // heads
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_int(config, "vocab_size", arch),
        n_ctx=_int(config, "max_position_embeddings", arch), d_mlp=_int(config, "intermediate_size", arch),
        act_fn=_activation(_option(config, "hidden_act", "gelu"), "hidden_act", arch), eps=_number(config, "layer_norm_eps", arch, 1e-12),
        norm_position="post", causal=False, embedding_norm=True, tied_embeddings=True,  # W_U is W_E^T by construction
    )
    e, m = "embeddings", cfg.d_mlp

    def embed(src: _Source) -> dict:
        token_types = src.take(f"{e}.token_type_embeddings.weight")
        _require(token_types.ndim == 2 and token_types.shape[0] >= 1 and token_types.shape[1] == d, arch,
                 f"token_type_embeddings has shape {tuple(token_types.shape)}, expected [type_vocab_size, {d}]")
        return {
            "embed.W_E": src.take(f"{e}.word_embeddings.weight", cfg.d_vocab, d),
            "pos_embed.W_pos": src.take(f"{e}.position_embeddings.weight", cfg.n_ctx, d) + token_types[0],
            "embed.ln.w": src.take(f"{e}.LayerNorm.weight"),
            "embed.ln.b": src.take(f"{e}.LayerNorm.bias"),
        }

    def block(src: _Source, layer: int) -> dict:
        h, p, out = f"encoder.layer.{layer}", f"blocks.{layer}", {}
        for name, proj in (("Q", "query"), ("K", "key"), ("V", "value")):
            out[f"{p}.attn.W_{name}"], out[f"{p}.attn.b_{name}"] = _linear_heads(
                src, f"{h}.attention.self.{proj}", heads, d_head, d, bias=True)
        out[f"{p}.attn.W_O"] = src.linear(f"{h}.attention.output.dense.weight", d, d).reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.attention.output.dense.bias")
        out[f"{p}.ln1.w"] = src.take(f"{h}.attention.output.LayerNorm.weight")
        out[f"{p}.ln1.b"] = src.take(f"{h}.attention.output.LayerNorm.bias")
        out[f"{p}.mlp.W_in"] = src.linear(f"{h}.intermediate.dense.weight", m, d)
        out[f"{p}.mlp.b_in"] = src.take(f"{h}.intermediate.dense.bias")
        out[f"{p}.mlp.W_out"] = src.linear(f"{h}.output.dense.weight", d, m)
        out[f"{p}.mlp.b_out"] = src.take(f"{h}.output.dense.bias")
        out[f"{p}.ln2.w"] = src.take(f"{h}.output.LayerNorm.weight")
        out[f"{p}.ln2.b"] = src.take(f"{h}.output.LayerNorm.bias")
        return out

    def final(src: _Source) -> dict:
        return {"unembed.W_U": src.take(f"{e}.word_embeddings.weight", cfg.d_vocab, d).T, "unembed.b_U": src.zeros(cfg.d_vocab)}

    ignored = r"(pooler|cls)\..*|embeddings\.(position|token_type)_ids"
    return Layout(cfg, ("bert.",), ignored, embed, block, final)


CONVERTERS = {"gpt2": from_hf_gpt2, "gpt_neox": from_hf_gpt_neox, "llama": from_hf_llama, "bert": from_hf_bert,
              "mistral": from_hf_mistral, "qwen2": from_hf_qwen2, "qwen3": from_hf_qwen3, "gemma": from_hf_gemma,
              "gemma2": from_hf_gemma2, "gemma3_text": from_hf_gemma3,
              "phi3": from_hf_phi3, "gptj": from_hf_gptj,
              "opt": from_hf_opt, "cohere": from_hf_cohere, "falcon": from_hf_falcon, "bloom": from_hf_bloom,
              "olmo2": from_hf_olmo2} | MOE_CONVERTERS
_LAYOUTS = {"gpt2": _gpt2_layout, "gpt_neox": _gpt_neox_layout, "llama": _llama_layout, "bert": _bert_layout,
            "mistral": lambda config: _llama_layout(config, "Mistral"), "qwen2": lambda config: _llama_layout(config, "Qwen2"),
            "qwen3": lambda config: _llama_layout(config, "Qwen3"), "gemma": lambda config: _llama_layout(config, "Gemma"),
            "gemma2": lambda config: _llama_layout(config, "Gemma2"),
            "gemma3_text": lambda config: _llama_layout(config, "Gemma3"),
            "phi3": lambda config: _llama_layout(config, "Phi3"), "gptj": _gptj_layout,
            "opt": _opt_layout, "cohere": _cohere_layout, "falcon": _falcon_layout, "bloom": _bloom_layout,
            "olmo2": _olmo2_layout} | MOE_LAYOUTS


def hf_layout(config) -> Layout:
    """The :class:`Layout` of ``config``'s ``model_type`` (see :data:`CONVERTERS`)."""
    model_type = _option(config, "model_type")
    if not isinstance(model_type, str) or model_type not in _LAYOUTS:
        raise UnsupportedArchitectureError(f"model_type {model_type!r} is not one circuitmath reads; it reads {', '.join(sorted(_LAYOUTS))}")
    return _LAYOUTS[model_type](config)


def from_hf(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert with the converter for ``config``'s ``model_type`` (see :data:`CONVERTERS`)."""
    return hf_layout(config).convert(state_dict)
