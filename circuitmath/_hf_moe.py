"""The converters of the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): LLaMA's
attention and norms (:mod:`circuitmath._hf_families`) with a router and experts per block
(:mod:`circuitmath._moe`).

Each reads both layouts of the experts: a model's own ``state_dict()`` (transformers 5), where
the experts of a layer are stacked, ``experts.gate_up_proj`` ``[n_experts, 2 d_mlp, d_model]``
(the gate's rows, then up's) and ``experts.down_proj`` ``[n_experts, d_model, d_mlp]``; and the
folder ``save_pretrained`` writes, one ``Linear`` per expert (Mixtral: ``block_sparse_moe.
experts.{e}.w1`` the gate, ``w3`` up, ``w2`` down; Qwen-MoE: ``mlp.experts.{e}.gate_proj``,
``up_proj``, ``down_proj``). Every expert tensor is a view of a stored one, so a processed model
is written back through them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ._config import Config
from ._hf_families import _llama_attention, _llama_config, _Variant
from ._hf_source import _unembed, Layout, _int, _number, _option, _require, _Source
from ._moe import expert_names
from ._state import StateDict

# No __all__: circuitmath.io lists the public names (one list), and the package imports the rest by name.

#: Per family: the attention variant, the block's MLP module name in a saved folder, and the
#: names of a saved expert's gate, up and down ``Linear`` layers.
_FAMILIES = {
    "Mixtral": (_Variant(False, False), "block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen2-MoE": (_Variant(None, False), "mlp", ("gate_proj", "up_proj", "down_proj")),
    "Qwen3-MoE": (_Variant(qk_norm=True), "mlp", ("gate_proj", "up_proj", "down_proj")),
    "GPT-OSS": (_Variant(), "mlp", ()),
}


def from_hf_mixtral(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Mixtral checkpoint: LLaMA's attention and norms, and per block a
    router (``gate``, no bias) over ``num_local_experts`` gated SiLU experts of which the
    ``num_experts_per_tok`` of largest softmax weight run, their weights renormalised to sum to 1."""
    return _moe_layout(config, "Mixtral").convert(state_dict)


def from_hf_qwen2_moe(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Qwen2-MoE checkpoint: Qwen2's attention (biases on q, k, v), a
    router over ``num_experts`` experts of width ``moe_intermediate_size`` (renormalised with
    ``norm_topk_prob``), and a shared expert of width ``shared_expert_intermediate_size`` scaled
    by ``sigmoid(shared_expert_gate(x))``. Every block must be sparse (``decoder_sparse_step``
    1, no ``mlp_only_layers``)."""
    return _moe_layout(config, "Qwen2-MoE").convert(state_dict)


def from_hf_qwen3_moe(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Qwen3-MoE checkpoint: Qwen3's attention (QK-norm) and a router
    over ``num_experts`` experts of width ``moe_intermediate_size``, no shared expert."""
    return _moe_layout(config, "Qwen3-MoE").convert(state_dict)


def from_hf_gpt_oss(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face GPT-OSS checkpoint: LLaMA's attention with biases on every
    projection and a learned sink logit per head (``sinks``: ``Config.attn_sinks``), sliding-window
    layers (``layer_types``), and per block a router with a bias over ``num_local_experts``
    experts whose ``num_experts_per_tok`` largest logits are softmaxed; the experts, stacked
    (``gate_up_proj`` ``[n_experts, d_model, 2 d_mlp]`` with the gate's and up's columns
    interleaved, ``down_proj`` ``[n_experts, d_mlp, d_model]``, all with biases), compute the
    clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``). Only the default rotary embedding is read
    (GPT-OSS's own configs use YaRN, refused by name)."""
    return _moe_layout(config, "GPT-OSS").convert(state_dict)


def _gpt_oss_experts(src: _Source, cfg: Config, h: str, p: str) -> dict:
    """Block ``h``'s router and stacked experts (gate and up interleaved) as views."""
    d, m, n = cfg.d_model, cfg.d_mlp, cfg.n_experts
    gate_up = src.take(f"{h}.mlp.experts.gate_up_proj", n, d, 2 * m)
    gate_up_bias = src.take(f"{h}.mlp.experts.gate_up_proj_bias", n, 2 * m)
    down, down_bias = src.take(f"{h}.mlp.experts.down_proj", n, m, d), src.take(f"{h}.mlp.experts.down_proj_bias", n, d)
    out = {f"{p}.mlp.W_router": src.linear(f"{h}.mlp.router.weight", n, d), f"{p}.mlp.b_router": src.take(f"{h}.mlp.router.bias", n)}
    for e, expert in enumerate(expert_names(cfg, f"{p}.mlp")):
        out |= {f"{expert}.W_gate": gate_up[e, :, 0::2], f"{expert}.W_in": gate_up[e, :, 1::2],
                f"{expert}.b_gate": gate_up_bias[e, 0::2], f"{expert}.b_in": gate_up_bias[e, 1::2],
                f"{expert}.W_out": down[e], f"{expert}.b_out": down_bias[e]}
    return out


def _moe_config(config, arch: str, variant: _Variant) -> Config:
    # Qwen3-MoE's config.json says num_local_experts (its attribute map's name for num_experts)
    experts_field = "num_experts" if _option(config, "num_local_experts") is None else "num_local_experts"
    n_experts = _int(config, experts_field, arch)
    top_k = _int(config, "num_experts_per_tok", arch)
    _require(top_k <= n_experts, arch, f"num_experts_per_tok={top_k} exceeds {experts_field}={n_experts}")
    if not _option(config, "use_sliding_window", True):  # Qwen-MoE then stores sliding_window 0
        config = (dict(config) if isinstance(config, Mapping) else config.to_dict()) | {"sliding_window": None}
    cfg = _llama_config(config, arch, variant)
    if arch == "Mixtral":
        return cfg.replace(n_experts=n_experts, experts_per_token=top_k)
    if arch == "GPT-OSS":
        return cfg.replace(n_experts=n_experts, experts_per_token=top_k, attn_sinks=True,
                           swiglu_limit=_number(config, "swiglu_limit", arch, 7.0),
                           swiglu_alpha=_number(config, "swiglu_alpha", arch, 1.702))
    _require((_int(config, "decoder_sparse_step", arch, 1) == 1) and not _option(config, "mlp_only_layers"), arch,
             "dense MLP layers among the sparse ones (decoder_sparse_step > 1 or mlp_only_layers)")
    shared = _int(config, "shared_expert_intermediate_size", arch) if arch == "Qwen2-MoE" else None
    return cfg.replace(d_mlp=_int(config, "moe_intermediate_size", arch), n_experts=n_experts, experts_per_token=top_k,
                       router_normalize_top_k=bool(_option(config, "norm_topk_prob", False)), d_shared_mlp=shared)


def _experts(src: _Source, cfg: Config, h: str, p: str, stored: tuple[str, tuple[str, str, str]]) -> dict:
    """Block ``h``'s experts as views: stacked (``experts.gate_up_proj``, ``experts.down_proj``)
    or one ``Linear`` per expert under ``{h}.{module}.experts.{e}``."""
    d, m, out = cfg.d_model, cfg.d_mlp, {}
    module, (gate, up, down) = stored
    stacked = f"{h}.mlp.experts.gate_up_proj" in src
    if stacked:
        gate_up = src.take(f"{h}.mlp.experts.gate_up_proj", cfg.n_experts, 2 * m, d)
        down_all = src.take(f"{h}.mlp.experts.down_proj", cfg.n_experts, d, m)
    for e, expert in enumerate(expert_names(cfg, f"{p}.mlp")):
        if stacked:
            out[f"{expert}.W_gate"], out[f"{expert}.W_in"] = gate_up[e, :m].T, gate_up[e, m:].T
            out[f"{expert}.W_out"] = down_all[e].T
        else:
            saved = f"{h}.{module}.experts.{e}"
            out[f"{expert}.W_gate"] = src.linear(f"{saved}.{gate}.weight", m, d)
            out[f"{expert}.W_in"] = src.linear(f"{saved}.{up}.weight", m, d)
            out[f"{expert}.W_out"] = src.linear(f"{saved}.{down}.weight", d, m)
        out[f"{expert}.b_in"], out[f"{expert}.b_gate"], out[f"{expert}.b_out"] = src.zeros(m), src.zeros(m), src.zeros(d)
    return out


def _mixture(src: _Source, cfg: Config, h: str, p: str, stored: tuple[str, tuple[str, str, str]]) -> dict:
    """Block ``h``'s router, experts and shared expert in circuitmath's names under ``p``."""
    d, module = cfg.d_model, stored[0] if f"{h}.{stored[0]}.gate.weight" in src else "mlp"
    out = {f"{p}.mlp.W_router": src.linear(f"{h}.{module}.gate.weight", cfg.n_experts, d),
           f"{p}.mlp.b_router": src.zeros(cfg.n_experts)}
    out |= _experts(src, cfg, h, p, (module, stored[1]))
    if cfg.d_shared_mlp is not None:
        s, shared = cfg.d_shared_mlp, f"{h}.mlp.shared_expert"
        out |= {f"{p}.mlp.shared.W_gate": src.linear(f"{shared}.gate_proj.weight", s, d),
                f"{p}.mlp.shared.W_in": src.linear(f"{shared}.up_proj.weight", s, d),
                f"{p}.mlp.shared.W_out": src.linear(f"{shared}.down_proj.weight", d, s),
                f"{p}.mlp.shared.b_in": src.zeros(s), f"{p}.mlp.shared.b_gate": src.zeros(s),
                f"{p}.mlp.shared.b_out": src.zeros(d),
                f"{p}.mlp.W_shared_gate": src.linear(f"{h}.mlp.shared_expert_gate.weight", 1, d)}
    return out


def _moe_layout(config, arch: str) -> Layout:
    variant, module, linears = _FAMILIES[arch]
    cfg = _moe_config(config, arch, variant)
    qkv_bias = bool(_option(config, "qkv_bias", True)) if arch == "Qwen2-MoE" else \
        bool(_option(config, "attention_bias", arch == "GPT-OSS"))
    o_bias = arch in ("Qwen3-MoE", "GPT-OSS") and bool(_option(config, "attention_bias", arch == "GPT-OSS"))
    d, d_head, heads = cfg.d_model, cfg.d_head, cfg.n_heads

    def embed(src: _Source) -> dict:
        return {"embed.W_E": src.take("embed_tokens.weight", cfg.d_vocab, d)}

    def block(src: _Source, layer: int) -> dict:
        h, p = f"layers.{layer}", f"blocks.{layer}"
        out = {f"{p}.ln1.w": src.take(f"{h}.input_layernorm.weight", d)}
        out |= _llama_attention(src, cfg, h, p, variant, qkv_bias)
        if variant.qk_norm:
            out[f"{p}.attn.q_norm.w"] = src.take(f"{h}.self_attn.q_norm.weight", d_head)
            out[f"{p}.attn.k_norm.w"] = src.take(f"{h}.self_attn.k_norm.weight", d_head)
        out[f"{p}.attn.W_O"] = src.linear(f"{h}.self_attn.o_proj.weight", d, heads * d_head).reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.self_attn.o_proj.bias", d) if o_bias else src.zeros(d)
        out[f"{p}.ln2.w"] = src.take(f"{h}.post_attention_layernorm.weight", d)
        if cfg.attn_sinks:
            out[f"{p}.attn.sinks"] = src.take(f"{h}.self_attn.sinks", heads)
            return out | _gpt_oss_experts(src, cfg, h, p)
        return out | _mixture(src, cfg, h, p, (module, linears))

    def final(src: _Source) -> dict:
        return {
            "ln_final.w": src.take("norm.weight", d),
            **_unembed(src, arch, cfg, "embed_tokens.weight"),
        }

    return Layout(cfg, ("model.",), r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq", embed, block, final)


#: The converters and layouts of this module, by ``model_type`` (:data:`circuitmath._hf.CONVERTERS`).
MOE_CONVERTERS = {"mixtral": from_hf_mixtral, "qwen2_moe": from_hf_qwen2_moe, "qwen3_moe": from_hf_qwen3_moe,
                  "gpt_oss": from_hf_gpt_oss}
MOE_LAYOUTS = {"mixtral": lambda config: _moe_layout(config, "Mixtral"),
               "qwen2_moe": lambda config: _moe_layout(config, "Qwen2-MoE"),
               "qwen3_moe": lambda config: _moe_layout(config, "Qwen3-MoE"),
               "gpt_oss": lambda config: _moe_layout(config, "GPT-OSS")}
