"""The BLOOM converter: ALiBi positions and a LayerNorm of the token embeddings, on GPT-NeoX's
per-head fused projections; a :class:`~circuitmath._hf_source.Layout` whose tensors are views of
the checkpoint's, so a processed model is written back through them.
"""

from __future__ import annotations

import torch

from ._config import Config
from ._hf_source import _unembed, Layout, _int, _number, _option, _require, _Source, _tied
from ._state import StateDict

# No __all__: circuitmath.io lists the public names (one list), and the package imports the rest by name.

#: The context length a BLOOM config does not give (ALiBi has no table of positions): BLOOM's
#: training length, the bound the reference checks token sequences against.
BLOOM_CONTEXT = 2048


def from_hf_bloom(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face BLOOM checkpoint (``BloomModel`` or ``BloomForCausalLM``).

    No positional weights: head ``h`` adds ``slope_h * k`` to its scores of key ``k`` (ALiBi,
    ``positional_embedding_type="alibi"``). The token embeddings pass through
    ``word_embeddings_layernorm`` (``embed.ln``, ``Config.embedding_norm`` in a pre-norm model).
    ``query_key_value`` is laid out per head as ``[q | k | v]`` (GPT-NeoX's layout), every linear
    map has a bias, the MLP is ``dense_h_to_4h``, tanh-GELU, ``dense_4h_to_h``, and the unembedding
    is the tied ``word_embeddings`` without bias. ``n_ctx`` is the config's ``seq_length`` (default
    :data:`BLOOM_CONTEXT`). Refused: ``apply_residual_connection_post_layernorm`` (the residual
    is the norm's output, which the reference lacks).
    """
    return _bloom_layout(config).convert(state_dict)


def _bloom_layout(config) -> Layout:
    arch = "BLOOM"
    _require(not _option(config, "apply_residual_connection_post_layernorm", False), arch,
             "apply_residual_connection_post_layernorm=True (the residual stream is each norm's output)")
    d = _int(config, "hidden_size", arch, None) or _int(config, "n_embed", arch)
    heads, layers = _int(config, "n_head", arch), _int(config, "n_layer", arch, floor=0)
    _require(d % heads == 0, arch, f"hidden_size={d} is not a multiple of n_head={heads}")
    d_head = d // heads
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_int(config, "vocab_size", arch),
        n_ctx=_int(config, "seq_length", arch, BLOOM_CONTEXT), d_mlp=4 * d, act_fn="gelu_new",
        eps=_number(config, "layer_norm_epsilon", arch, 1e-5), positional_embedding_type="alibi", embedding_norm=True,
        tied_embeddings=_tied(config, True),
    )
    m = cfg.d_mlp

    def embed(src: _Source) -> dict:
        return {"embed.W_E": src.take("word_embeddings.weight", cfg.d_vocab, d),
                "embed.ln.w": src.take("word_embeddings_layernorm.weight", d),
                "embed.ln.b": src.take("word_embeddings_layernorm.bias", d)}

    def block(src: _Source, layer: int) -> dict:
        h, p, out = f"h.{layer}", f"blocks.{layer}", {}
        for norm, name in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")):
            out[f"{p}.{norm}.w"], out[f"{p}.{norm}.b"] = src.take(f"{h}.{name}.weight", d), src.take(f"{h}.{name}.bias", d)
        qkv = src.linear(f"{h}.self_attention.query_key_value.weight", 3 * d, d).reshape(d, heads, 3, d_head)
        qkv_b = src.take(f"{h}.self_attention.query_key_value.bias", 3 * d).reshape(heads, 3, d_head)
        for i, name in enumerate("QKV"):
            out[f"{p}.attn.W_{name}"] = qkv[:, :, i, :].permute(1, 0, 2)
            out[f"{p}.attn.b_{name}"] = qkv_b[:, i, :]
        out[f"{p}.attn.W_O"] = src.linear(f"{h}.self_attention.dense.weight", d, d).reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.self_attention.dense.bias", d)
        out[f"{p}.mlp.W_in"], out[f"{p}.mlp.b_in"] = src.linear(f"{h}.mlp.dense_h_to_4h.weight", m, d), src.take(f"{h}.mlp.dense_h_to_4h.bias", m)
        out[f"{p}.mlp.W_out"], out[f"{p}.mlp.b_out"] = src.linear(f"{h}.mlp.dense_4h_to_h.weight", d, m), src.take(f"{h}.mlp.dense_4h_to_h.bias", d)
        return out

    def final(src: _Source) -> dict:
        return {
            "ln_final.w": src.take("ln_f.weight", d), "ln_final.b": src.take("ln_f.bias", d),
            **_unembed(src, arch, cfg, "word_embeddings.weight"),
        }

    return Layout(cfg, ("transformer.",), None, embed, block, final)
