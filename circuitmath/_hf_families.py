"""The converters of the LLaMA-like families (LLaMA, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Phi-3,
Cohere, OLMo-2) and of GPT-J, OPT and Falcon: each a :class:`~circuitmath._hf_source.Layout` whose
tensors are views of the checkpoint's, so a processed model is written back through them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ._config import Config
from ._errors import ConfigError
from ._hf_source import (
    _unembed,
    Layout,
    _activation,
    _dimensions,
    _heads_from_columns,
    _int,
    _linear_heads,
    _number,
    _option,
    _require,
    _rotary,
    _Source,
    _tied,
)
from ._state import StateDict, attention_names

# No __all__: circuitmath.io lists the public names (one list), and the package imports the rest by name.


def from_hf_llama(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face LLaMA checkpoint (``LlamaModel`` or ``LlamaForCausalLM``).

    RMSNorm gains become ``ln1.w``, ``ln2.w``, ``ln_final.w``; ``up_proj`` is ``W_in`` and
    ``gate_proj`` is ``W_gate`` (``silu(x W_gate) * (x W_in)``); with fewer key/value heads than
    query heads the keys and values are ``_W_K``, ``_W_V`` (grouped-query attention). Missing
    biases (``attention_bias=False``) are zero. ``mlp_bias=True`` is refused: the reference's
    ``W_gate`` has no bias.
    """
    return _llama_layout(config).convert(state_dict)


def from_hf_mistral(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Mistral checkpoint: LLaMA's names and layout, with a sliding
    window of ``sliding_window`` keys in every layer (``Config.sliding_window``)."""
    return _llama_layout(config, "Mistral").convert(state_dict)


def from_hf_qwen2(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Qwen2 checkpoint: LLaMA's names and layout, with biases on the
    query, key and value projections (none on ``o_proj``: ``b_O`` is zero) and a sliding window
    in the layers ``layer_types`` names (``use_sliding_window``)."""
    return _llama_layout(config, "Qwen2").convert(state_dict)


def from_hf_qwen3(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Qwen3 checkpoint: LLaMA's names and layout, with each head's
    queries and keys RMS-normed over ``head_dim`` before the rotary embedding (``q_norm``,
    ``k_norm``: ``attn.q_norm.w``, ``attn.k_norm.w``; ``Config.qk_norm``)."""
    return _llama_layout(config, "Qwen3").convert(state_dict)


def _sliding_window(config, layers: int, architecture: str) -> tuple[int | None, tuple[int, ...] | None]:
    """``(sliding_window, sliding_window_layers)`` from ``sliding_window`` and ``layer_types``
    (absent: every layer slides, as in Mistral; ``use_sliding_window=False``: none does)."""
    window = _int(config, "sliding_window", architecture, None)
    if window is None or not _option(config, "use_sliding_window", True):
        return None, None
    kinds = _option(config, "layer_types")
    if kinds is None:
        return window, None
    if not isinstance(kinds, (list, tuple)) or len(kinds) != layers:
        raise ConfigError(f"{architecture} config: layer_types must list one kind per layer ({layers}), got {kinds!r}")
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    _require(not unknown, architecture, f"layer_types {unknown}; the reference has full and sliding-window attention")
    sliding = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    return (window, None if len(sliding) == layers else sliding) if sliding else (None, None)


def from_hf_gemma(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Gemma checkpoint: LLaMA's names and layout, with every RMSNorm
    gain stored as ``w`` and applied as ``1 + w`` (``Config.norm_gain_offset = 1``) and the token
    embeddings multiplied by ``sqrt(hidden_size)`` (``Config.embedding_scale``: the float32
    number transformers keeps, which it rounds to the model's dtype before multiplying)."""
    return _llama_layout(config, "Gemma").convert(state_dict)


def from_hf_gemma2(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Gemma 2 checkpoint: Gemma's, with sandwich norms
    (``post_attention_layernorm`` after attention is ``ln1_post``, ``pre_feedforward_layernorm``
    is ``ln2``, ``post_feedforward_layernorm`` is ``ln2_post``; ``Config.post_norms``), scores
    scaled by ``query_pre_attn_scalar ** -0.5`` (``attention_scale``), softcaps on the scores and
    the logits (``attn_softcap``, ``logit_softcap``) and a sliding window in the layers
    ``layer_types`` names."""
    return _llama_layout(config, "Gemma2").convert(state_dict)


def from_hf_gemma3(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Gemma 3 text checkpoint (``Gemma3ForCausalLM``, ``model_type``
    ``gemma3_text``): Gemma 2's names, sandwich norms and query scale, with QK-norm (``q_norm``,
    ``k_norm``, gains applied as ``1 + w``), no softcap unless the config sets one, and the
    sliding-window layers rotating with their own base (``rope_parameters["sliding_attention"]``:
    ``Config.rotary_base_local``), the full layers with ``rope_parameters["full_attention"]``'s."""
    return _llama_layout(config, "Gemma3").convert(state_dict)


def from_hf_phi3(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Phi-3 checkpoint: LLaMA's, with the query, key and value projections
    fused in ``qkv_proj`` (rows: the queries, then the keys, then the values) and the gate and up
    projections in ``gate_up_proj`` (rows: the gate, then up), each read as views of the fused
    matrix; partial rotary (``partial_rotary_factor``) is kept."""
    return _llama_layout(config, "Phi3").convert(state_dict)


@dataclass(frozen=True)
class _Variant:
    """What a LLaMA-like architecture adds: biases on q/k/v and on o_proj (``None``: the config's
    ``attention_bias``), QK-norm, Gemma's 1 + w gains and embedding scale, Gemma 2's sandwich
    norms, query scale and softcaps, Phi-3's fused projections (and partial rotary)."""

    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False
    gemma: bool = False
    sandwich: bool = False
    fused: bool = False
    local_rope: bool = False


_LLAMA_LIKE = {"LLaMA": _Variant(), "Mistral": _Variant(False, False), "Qwen2": _Variant(True, False),
               "Qwen3": _Variant(qk_norm=True), "Gemma": _Variant(gemma=True), "Gemma2": _Variant(gemma=True, sandwich=True),
               "Phi3": _Variant(False, False, fused=True),
               "Gemma3": _Variant(qk_norm=True, gemma=True, sandwich=True, local_rope=True)}


def _rotary_by_layer_type(config, d_head: int, arch: str, window_layers, window) -> tuple[float, int, float | None]:
    """``(base, rotary_dim, rotary_base_local)`` from Gemma 3's ``rope_parameters``, one per layer
    type (``full_attention``, ``sliding_attention``): the full layers' base, and the sliding
    layers' where any layer slides (both rotate every dimension of a head)."""
    rope = _option(config, "rope_parameters") or {}
    if not isinstance(rope, Mapping) or not all(isinstance(rope.get(k, {}), Mapping) for k in ("full_attention", "sliding_attention")):
        raise ConfigError(f"{arch} config: rope_parameters must hold an object per layer type, got {rope!r}")
    base, rotary_dim = _rotary({"rope_parameters": rope.get("full_attention", {})}, d_head, arch)
    local, local_dim = _rotary({"rope_parameters": rope.get("sliding_attention", {})}, d_head, arch)
    _require(local_dim == rotary_dim, arch, "the sliding layers rotate another number of dimensions than the full layers")
    return base, rotary_dim, local if window is not None and local != base else None


def _gemma2_options(config, arch: str) -> dict:
    """Gemma 2's query scale and softcaps as :class:`Config` fields."""
    scalar = _number(config, "query_pre_attn_scalar", arch, 256)
    _require(scalar > 0, arch, f"query_pre_attn_scalar={scalar} is not positive")
    caps = {}
    for field, name in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "logit_softcap")):
        value = _option(config, field)
        caps[name] = None if value is None else _number(config, field, arch, 0.0)
    return {"attention_scale": scalar**-0.5, "post_norms": True, **caps}


def _hidden_act(config) -> tuple[str, str]:
    """The activation's name and the field that gives it (Gemma 2 names it ``hidden_activation``)."""
    for field in ("hidden_activation", "hidden_act"):
        if _option(config, field) is not None:
            return _option(config, field), field
    return "silu", "hidden_act"


def _llama_config(config, arch: str, variant: _Variant, eps: tuple[str, float] = ("rms_norm_eps", 1e-6)) -> Config:
    """The :class:`Config` of a LLaMA-like architecture's ``config`` (``eps``: the field of its
    norms' epsilon and its default)."""
    d, heads, layers = _int(config, "hidden_size", arch), _int(config, "num_attention_heads", arch), _int(config, "num_hidden_layers", arch, floor=0)
    d_head = _int(config, "head_dim", arch, None) or d // heads
    _require(d_head >= 1, arch, f"hidden_size={d} is smaller than num_attention_heads={heads} and no head_dim is given")
    kv_heads = _int(config, "num_key_value_heads", arch, None) or heads
    _require(not _option(config, "mlp_bias", False), arch, "mlp_bias=True puts a bias inside the gate, which the reference lacks")
    _require(not _option(config, "use_bidirectional_attention", False), arch, "use_bidirectional_attention=True (not causal)")
    window, window_layers = _sliding_window(config, layers, arch)
    local = None
    if variant.local_rope:
        base, rotary_dim, local = _rotary_by_layer_type(config, d_head, arch, window_layers, window)
    else:
        base, rotary_dim = _rotary(config, d_head, arch)
    _require(rotary_dim == d_head or variant.fused, arch, "partial rotary (LLaMA rotates every query/key dimension)")
    return Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_int(config, "vocab_size", arch),
        n_ctx=_int(config, "max_position_embeddings", arch), d_mlp=_int(config, "intermediate_size", arch),
        act_fn=_activation(*_hidden_act(config), arch), normalization_type="RMS",
        eps=_number(config, eps[0], arch, eps[1]), positional_embedding_type="rotary", rotary_base=base,
        rotary_dim=rotary_dim if rotary_dim != d_head else None,
        gated_mlp=True, n_key_value_heads=kv_heads if kv_heads != heads else None,
        sliding_window=window, sliding_window_layers=window_layers, qk_norm=variant.qk_norm,
        norm_gain_offset=1.0 if variant.gemma else 0.0,
        embedding_scale=float(torch.tensor(d**0.5, dtype=torch.float32)) if variant.gemma else None,
        rotary_base_local=local, tied_embeddings=_tied(config, variant.gemma),
        **(_gemma2_options(config, arch) if variant.sandwich else {}),
    )


def _llama_attention(src: _Source, cfg: Config, h: str, p: str, variant: _Variant, qkv_bias: bool) -> dict:
    """Block ``h``'s query, key and value projections (separate or fused in ``qkv_proj``)."""
    out, d, e = {}, cfg.d_model, cfg.d_head
    names = [attention_names(cfg, name) for name in "QKV"]
    if variant.fused:
        rows = [n * e for _w, _b, n in names]
        fused = src.linear(f"{h}.self_attn.qkv_proj.weight", sum(rows), d)
        for (weight, bias, n), start, size in zip(names, (0, rows[0], rows[0] + rows[1]), rows):
            out[f"{p}.attn.{weight}"] = _heads_from_columns(fused[:, start:start + size], n, e)
            out[f"{p}.attn.{bias}"] = src.zeros(n, e)
        return out
    for (weight, bias, n), proj in zip(names, ("q_proj", "k_proj", "v_proj")):
        out[f"{p}.attn.{weight}"], out[f"{p}.attn.{bias}"] = _linear_heads(src, f"{h}.self_attn.{proj}", n, e, d, qkv_bias)
    return out


def _llama_mlp(src: _Source, cfg: Config, h: str, p: str, variant: _Variant) -> dict:
    """Block ``h``'s gated MLP (gate and up separate or fused in ``gate_up_proj``)."""
    d, m = cfg.d_model, cfg.d_mlp
    if variant.fused:
        fused = src.linear(f"{h}.mlp.gate_up_proj.weight", 2 * m, d)
        gate, up = fused[:, :m], fused[:, m:]
    else:
        gate, up = src.linear(f"{h}.mlp.gate_proj.weight", m, d), src.linear(f"{h}.mlp.up_proj.weight", m, d)
    return {f"{p}.mlp.W_in": up, f"{p}.mlp.W_gate": gate, f"{p}.mlp.b_in": src.zeros(m),
            f"{p}.mlp.W_out": src.linear(f"{h}.mlp.down_proj.weight", d, m), f"{p}.mlp.b_out": src.zeros(d)}


def _llama_layout(config, arch: str = "LLaMA") -> Layout:
    variant = _LLAMA_LIKE[arch]
    cfg = _llama_config(config, arch, variant)
    attention_bias = bool(_option(config, "attention_bias", False))
    qkv_bias = attention_bias if variant.qkv_bias is None else variant.qkv_bias
    o_bias = attention_bias if variant.o_bias is None else variant.o_bias
    post_attention = "pre_feedforward_layernorm" if variant.sandwich else "post_attention_layernorm"
    d, d_head, heads = cfg.d_model, cfg.d_head, cfg.n_heads

    def embed(src: _Source) -> dict:
        return {"embed.W_E": src.take("embed_tokens.weight", cfg.d_vocab, d)}

    def block(src: _Source, layer: int) -> dict:
        h, p = f"layers.{layer}", f"blocks.{layer}"
        out = {f"{p}.ln1.w": src.take(f"{h}.input_layernorm.weight")}
        out |= _llama_attention(src, cfg, h, p, variant, qkv_bias)
        if variant.qk_norm:
            out[f"{p}.attn.q_norm.w"] = src.take(f"{h}.self_attn.q_norm.weight", d_head)
            out[f"{p}.attn.k_norm.w"] = src.take(f"{h}.self_attn.k_norm.weight", d_head)
        out[f"{p}.attn.W_O"] = src.linear(f"{h}.self_attn.o_proj.weight", d, heads * d_head).reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.self_attn.o_proj.bias") if o_bias else src.zeros(d)
        out[f"{p}.ln2.w"] = src.take(f"{h}.{post_attention}.weight")
        if variant.sandwich:
            out[f"{p}.ln1_post.w"] = src.take(f"{h}.post_attention_layernorm.weight", d)
            out[f"{p}.ln2_post.w"] = src.take(f"{h}.post_feedforward_layernorm.weight", d)
        return out | _llama_mlp(src, cfg, h, p, variant)

    def final(src: _Source) -> dict:
        return {
            "ln_final.w": src.take("norm.weight"),
            **_unembed(src, arch, cfg, "embed_tokens.weight"),
        }

    return Layout(cfg, ("model.",), r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq", embed, block, final)


def from_hf_olmo2(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face OLMo-2 checkpoint (``Olmo2ForCausalLM``): LLaMA's names, with no norm
    before attention or the MLP (``Config.pre_norms=False``: each reads the residual stream
    itself), each sub-layer's output RMS-normed before it is added (``post_attention_layernorm``
    is ``ln1_post``, ``post_feedforward_layernorm`` ``ln2_post``; ``Config.post_norms``), and the
    queries and keys each RMS-normed over the whole projection (``q_norm.weight`` ``[n_heads *
    d_head]`` read as ``attn.q_norm.w`` ``[n_heads, d_head]``, ``k_norm`` over the key/value heads;
    ``Config.qk_norm_over="projection"``) before the rotary embedding."""
    return _olmo2_layout(config).convert(state_dict)


def _olmo2_layout(config) -> Layout:
    arch = "OLMo-2"
    llama = _llama_config(config, arch, _Variant(), eps=("rms_norm_eps", 1e-5))
    cfg = llama.replace(pre_norms=False, post_norms=True, qk_norm=True, qk_norm_over="projection")
    bias = bool(_option(config, "attention_bias", False))
    d, d_head, heads, kv_heads = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_key_value_heads or cfg.n_heads

    def embed(src: _Source) -> dict:
        return {"embed.W_E": src.take("embed_tokens.weight", cfg.d_vocab, d)}

    def block(src: _Source, layer: int) -> dict:
        h, p = f"layers.{layer}", f"blocks.{layer}"
        out = _llama_attention(src, cfg, h, p, _Variant(), bias)
        out[f"{p}.attn.q_norm.w"] = src.take(f"{h}.self_attn.q_norm.weight", heads * d_head).reshape(heads, d_head)
        out[f"{p}.attn.k_norm.w"] = src.take(f"{h}.self_attn.k_norm.weight", kv_heads * d_head).reshape(kv_heads, d_head)
        out[f"{p}.attn.W_O"] = src.linear(f"{h}.self_attn.o_proj.weight", d, heads * d_head).reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.self_attn.o_proj.bias") if bias else src.zeros(d)
        out[f"{p}.ln1_post.w"] = src.take(f"{h}.post_attention_layernorm.weight", d)
        out[f"{p}.ln2_post.w"] = src.take(f"{h}.post_feedforward_layernorm.weight", d)
        return out | _llama_mlp(src, cfg, h, p, _Variant())

    def final(src: _Source) -> dict:
        return {"ln_final.w": src.take("norm.weight", d),
                **_unembed(src, arch, cfg, "embed_tokens.weight")}

    return Layout(cfg, ("model.",), r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq", embed, block, final)


def from_hf_gptj(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face GPT-J checkpoint (``GPTJModel`` or ``GPTJForCausalLM``).

    Attention and MLP run in parallel on one LayerNorm, ``x + attn(ln_1(x)) + mlp(ln_1(x))``: the
    reference's ``ln1`` and ``ln2`` are both views of ``ln_1`` (stored once; a processed model
    keeps them equal or is written in circuitmath's names). The rotary embedding rotates the
    first ``rotary_dim`` entries of each head in neighbouring pairs (``rotary_interleaved``); the
    projections have no biases (zeros) and ``lm_head`` has one (``b_U``).
    """
    return _gptj_layout(config).convert(state_dict)


def _gptj_layout(config) -> Layout:
    arch = "GPT-J"
    d, heads, layers = _int(config, "n_embd", arch), _int(config, "n_head", arch), _int(config, "n_layer", arch, floor=0)
    _require(d % heads == 0, arch, f"n_embd={d} is not a multiple of n_head={heads}")
    d_head = d // heads
    rotary_dim = _int(config, "rotary_dim", arch, None)
    _require(rotary_dim is not None and rotary_dim % 2 == 0 and rotary_dim <= d_head, arch,
             f"rotary_dim={rotary_dim}: the reference rotates an even number of each head's {d_head} entries"
             " (transformers' GPT-J without rotary_dim draws its angles for n_embd, not a head)")
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_int(config, "vocab_size", arch),
        n_ctx=_int(config, "n_positions", arch), d_mlp=_int(config, "n_inner", arch, None) or 4 * d,
        act_fn=_activation(_option(config, "activation_function", "gelu_new"), "activation_function", arch),
        eps=_number(config, "layer_norm_epsilon", arch, 1e-5), positional_embedding_type="rotary",
        rotary_dim=rotary_dim if rotary_dim != d_head else None, rotary_interleaved=True, parallel_attn_mlp=True,
        tied_embeddings=_tied(config, False),
    )
    m = cfg.d_mlp

    def embed(src: _Source) -> dict:
        return {"embed.W_E": src.take("wte.weight", cfg.d_vocab, d)}

    def block(src: _Source, layer: int) -> dict:
        h, p, out = f"h.{layer}", f"blocks.{layer}", {}
        for norm in ("ln1", "ln2"):  # one LayerNorm read by both branches
            out[f"{p}.{norm}.w"], out[f"{p}.{norm}.b"] = src.take(f"{h}.ln_1.weight", d), src.take(f"{h}.ln_1.bias", d)
        for name, proj in (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj")):
            out[f"{p}.attn.W_{name}"], out[f"{p}.attn.b_{name}"] = _linear_heads(src, f"{h}.attn.{proj}", heads, d_head, d, False)
        out[f"{p}.attn.W_O"] = src.linear(f"{h}.attn.out_proj.weight", d, d).reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.zeros(d)
        out[f"{p}.mlp.W_in"], out[f"{p}.mlp.b_in"] = src.linear(f"{h}.mlp.fc_in.weight", m, d), src.take(f"{h}.mlp.fc_in.bias", m)
        out[f"{p}.mlp.W_out"], out[f"{p}.mlp.b_out"] = src.linear(f"{h}.mlp.fc_out.weight", d, m), src.take(f"{h}.mlp.fc_out.bias", d)
        return out

    def final(src: _Source) -> dict:
        return {
            "ln_final.w": src.take("ln_f.weight", d), "ln_final.b": src.take("ln_f.bias", d),
            **_unembed(src, arch, cfg, "wte.weight"),
        }

    return Layout(cfg, ("transformer.",), r"h\.\d+\.attn\.(masked_)?bias", embed, block, final)


def from_hf_opt(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face OPT checkpoint (``OPTModel`` or ``OPTForCausalLM``).

    Learned positions with an offset: position ``p`` reads row ``p + 2`` of ``embed_positions``
    (``W_pos`` is rows 2 onwards; the first two rows are never read, so a processed OPT is
    written in circuitmath's names). ReLU MLP (``fc1``, ``fc2``); ``do_layer_norm_before``
    picks pre-norm (``self_attn_layer_norm`` is ``ln1``, ``final_layer_norm`` ``ln2``, the
    decoder's ``final_layer_norm`` ``ln_final``) or post-norm (no final norm). Refused:
    ``word_embed_proj_dim != hidden_size`` (project_in/out), LayerNorms without gains.
    """
    return _opt_layout(config).convert(state_dict)


def _opt_layout(config) -> Layout:
    arch = "OPT"
    d, heads, layers = _dimensions(config, arch)
    d_head, offset = d // heads, 2
    _require((_int(config, "word_embed_proj_dim", arch, None) or d) == d, arch,
             "word_embed_proj_dim differs from hidden_size (project_in and project_out), which the reference lacks")
    _require(_option(config, "layer_norm_elementwise_affine", True), arch, "LayerNorms without gain and bias")
    pre = bool(_option(config, "do_layer_norm_before", True))
    _require(not pre or not _option(config, "_remove_final_layer_norm", False), arch, "a pre-norm OPT without its final norm")
    bias = bool(_option(config, "enable_bias", True))
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_int(config, "vocab_size", arch),
        n_ctx=_int(config, "max_position_embeddings", arch), d_mlp=_int(config, "ffn_dim", arch),
        act_fn=_activation(_option(config, "activation_function", "relu"), "activation_function", arch),
        norm_position="pre" if pre else "post", tied_embeddings=_tied(config, True),
    )
    m = cfg.d_mlp

    def embed(src: _Source) -> dict:
        return {"embed.W_E": src.take("embed_tokens.weight", cfg.d_vocab, d),
                "pos_embed.W_pos": src.take("embed_positions.weight", cfg.n_ctx + offset, d)[offset:]}

    def block(src: _Source, layer: int) -> dict:
        h, p, out = f"layers.{layer}", f"blocks.{layer}", {}
        for norm, name in (("ln1", "self_attn_layer_norm"), ("ln2", "final_layer_norm")):
            out[f"{p}.{norm}.w"], out[f"{p}.{norm}.b"] = src.take(f"{h}.{name}.weight", d), src.take(f"{h}.{name}.bias", d)
        for name, proj in (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj")):
            out[f"{p}.attn.W_{name}"], out[f"{p}.attn.b_{name}"] = _linear_heads(src, f"{h}.self_attn.{proj}", heads, d_head, d, bias)
        return out | _output_and_mlp(src, h, p, ("self_attn.out_proj", "fc1", "fc2"), (heads, d_head, d, m), bias)

    def final(src: _Source) -> dict:
        tied = "lm_head.weight" not in src
        _require(not tied or cfg.tied_embeddings, arch, "no lm_head.weight and untied embeddings")
        out = {"unembed.W_U": src.take("embed_tokens.weight", cfg.d_vocab, d).T if tied else src.linear("lm_head.weight", cfg.d_vocab, d),
               "unembed.b_U": src.zeros(cfg.d_vocab)}
        if pre:
            out["ln_final.w"], out["ln_final.b"] = src.take("final_layer_norm.weight", d), src.take("final_layer_norm.bias", d)
        return out

    return Layout(cfg, ("model.decoder.", "decoder."), None, embed, block, final)


def from_hf_cohere(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Cohere (Command-R) checkpoint: LLaMA's names, with attention and
    the gated MLP in parallel on one LayerNorm (gain only: its bias is zero; ``ln1`` and ``ln2``
    are both views of ``input_layernorm``), rotary pairs interleaved (``rotary_interleaved``),
    the logits multiplied by ``logit_scale``. ``use_qk_norm`` is refused (a LayerNorm per head
    the reference lacks)."""
    return _cohere_layout(config).convert(state_dict)


def _cohere_layout(config) -> Layout:
    arch = "Cohere"
    _require(not _option(config, "use_qk_norm", False), arch, "use_qk_norm=True (a LayerNorm of each head's queries and keys)")
    llama = _llama_config(config, arch, _Variant(), eps=("layer_norm_eps", 1e-5))
    scale = _option(config, "logit_scale")
    cfg = llama.replace(normalization_type="LN", gated_mlp=True, parallel_attn_mlp=True, rotary_interleaved=True,
                        logit_scale=None if scale is None else _number(config, "logit_scale", arch, 1.0),
                        tied_embeddings=_tied(config, True))
    bias = bool(_option(config, "attention_bias", False))
    d, d_head, heads = cfg.d_model, cfg.d_head, cfg.n_heads

    def embed(src: _Source) -> dict:
        return {"embed.W_E": src.take("embed_tokens.weight", cfg.d_vocab, d)}

    def block(src: _Source, layer: int) -> dict:
        h, p = f"layers.{layer}", f"blocks.{layer}"
        out = {}
        for norm in ("ln1", "ln2"):  # one LayerNorm, gain only, read by both branches
            out[f"{p}.{norm}.w"], out[f"{p}.{norm}.b"] = src.take(f"{h}.input_layernorm.weight", d), src.zeros(d)
        out |= _llama_attention(src, cfg, h, p, _Variant(), bias)
        out[f"{p}.attn.W_O"] = src.linear(f"{h}.self_attn.o_proj.weight", d, heads * d_head).reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.self_attn.o_proj.bias") if bias else src.zeros(d)
        return out | _llama_mlp(src, cfg, h, p, _Variant())

    def final(src: _Source) -> dict:
        return {
            "ln_final.w": src.take("norm.weight", d), "ln_final.b": src.zeros(d),
            **_unembed(src, arch, cfg, "embed_tokens.weight"),
        }

    return Layout(cfg, ("model.",), r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq", embed, block, final)


def from_hf_falcon(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face Falcon checkpoint of the first architecture (Falcon-7B style).

    ``query_key_value`` fuses the projections: with ``multi_query`` the rows are every query
    head, then one key head and one value head (grouped-query attention with one key/value
    head); without, ``[q | k | v]`` per head (GPT-NeoX's layout). With ``parallel_attn`` both
    branches read ``input_layernorm`` (``ln1`` and ``ln2`` are views of it), else the MLP reads
    ``post_attention_layernorm``. Falcon-40B/180B (``new_decoder_architecture``): parallel blocks
    with a norm for each branch (``ln_attn``, ``ln_mlp``; one ``input_layernorm`` with
    ``num_ln_in_parallel_attn=1``) and ``num_kv_heads`` key/value heads, each stored after its
    group's query heads (:func:`_grouped_qkv`); its query heads are copies, not views, so a
    processed Falcon-40B is written in circuitmath's names. Refused: ``alibi``.
    """
    return _falcon_layout(config).convert(state_dict)


def _falcon_layout(config) -> Layout:
    arch = "Falcon"
    _require(not _option(config, "alibi", False), arch, "alibi=True (ALiBi position biases, which the reference lacks)")
    d, heads, layers = _dimensions(config, arch)
    d_head = d // heads
    new = bool(_option(config, "new_decoder_architecture", False))
    multi_query, parallel = bool(_option(config, "multi_query", True)) and not new, bool(_option(config, "parallel_attn", True))
    _require(parallel or not new, arch, "new_decoder_architecture with parallel_attn=False (no norm feeds its MLP)")
    kv_heads = (_int(config, "num_kv_heads", arch, None) or heads) if new else 1 if multi_query else heads
    _require(heads % kv_heads == 0, arch, f"num_kv_heads={kv_heads} does not divide num_attention_heads={heads}")
    two_norms = new and (_int(config, "num_ln_in_parallel_attn", arch, None) or 2) == 2
    bias = bool(_option(config, "bias", False))
    base, rotary_dim = _rotary(config, d_head, arch)
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_int(config, "vocab_size", arch),
        n_ctx=_int(config, "max_position_embeddings", arch), d_mlp=_int(config, "ffn_hidden_size", arch, None) or 4 * d,
        act_fn=_activation(_option(config, "activation", "gelu"), "activation", arch),
        eps=_number(config, "layer_norm_epsilon", arch, 1e-5), positional_embedding_type="rotary", rotary_base=base,
        rotary_dim=rotary_dim if rotary_dim != d_head else None, parallel_attn_mlp=parallel,
        n_key_value_heads=kv_heads if kv_heads != heads else None, tied_embeddings=_tied(config, True),
    )
    m = cfg.d_mlp

    def embed(src: _Source) -> dict:
        return {"embed.W_E": src.take("word_embeddings.weight", cfg.d_vocab, d)}

    def attention(src: _Source, h: str, p: str) -> dict:
        out, names = {}, [attention_names(cfg, name) for name in "QKV"]
        rows = (heads + 2 * kv_heads) * d_head if new or multi_query else 3 * d
        fused = src.linear(f"{h}.self_attention.query_key_value.weight", rows, d)
        fused_b = src.take(f"{h}.self_attention.query_key_value.bias", rows) if bias else None
        if new:
            return out | _grouped_qkv(src, p, names, fused, fused_b, (heads, kv_heads, d_head))
        for i, (weight, b, n) in enumerate(names):
            if multi_query:
                start = (0, heads * d_head, heads * d_head + d_head)[i]
                columns = slice(start, start + n * d_head)
                out[f"{p}.attn.{weight}"] = _heads_from_columns(fused[:, columns], n, d_head)
                out[f"{p}.attn.{b}"] = fused_b[columns].reshape(n, d_head) if bias else src.zeros(n, d_head)
            else:
                out[f"{p}.attn.{weight}"] = fused.reshape(d, heads, 3, d_head)[:, :, i, :].permute(1, 0, 2)
                out[f"{p}.attn.{b}"] = fused_b.reshape(heads, 3, d_head)[:, i, :] if bias else src.zeros(heads, d_head)
        return out

    def block(src: _Source, layer: int) -> dict:
        h, p = f"h.{layer}", f"blocks.{layer}"
        out = {}
        norms = (("ln1", "ln_attn"), ("ln2", "ln_mlp")) if two_norms else \
            (("ln1", "input_layernorm"), ("ln2", "input_layernorm" if parallel else "post_attention_layernorm"))
        for norm, name in norms:
            out[f"{p}.{norm}.w"], out[f"{p}.{norm}.b"] = src.take(f"{h}.{name}.weight", d), src.take(f"{h}.{name}.bias", d)
        out |= attention(src, h, p)
        return out | _output_and_mlp(src, h, p, ("self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
                                     (heads, d_head, d, m), bias)

    def final(src: _Source) -> dict:
        return {
            "ln_final.w": src.take("ln_f.weight", d), "ln_final.b": src.take("ln_f.bias", d),
            **_unembed(src, arch, cfg, "word_embeddings.weight"),
        }

    return Layout(cfg, ("transformer.",), r"(h\.\d+\.self_attention\.)?rotary_emb\.inv_freq", embed, block, final)


def _grouped_qkv(src: _Source, p: str, names: list, fused: torch.Tensor, fused_b, dims: tuple) -> dict:
    """Falcon-40B's ``query_key_value`` (``new_decoder_architecture``): per key/value head, its
    group's query heads, then its key, then its value (``fused``: ``[d_model, rows]``, the bias
    ``[rows]`` or ``None``). The keys and values are views; the query heads of all groups together
    are no single strided view of the rows (each group's are followed by its key and value), so
    ``W_Q`` and ``b_Q`` are copies. ``dims``: ``(heads, kv_heads, d_head)``."""
    heads, kv_heads, d_head = dims
    group = heads // kv_heads
    d = fused.shape[0]
    rows = fused.reshape(d, kv_heads, group + 2, d_head)
    bias_rows = None if fused_b is None else fused_b.reshape(kv_heads, group + 2, d_head)
    out = {}
    for (weight, b, n), picked in zip(names, (slice(0, group), group, group + 1)):
        out[f"{p}.attn.{weight}"] = rows[:, :, picked, :].permute(1, 2, 0, 3).reshape(n, d, d_head) if n == heads and group > 1 \
            else rows[:, :, picked, :].reshape(d, n, d_head).permute(1, 0, 2)
        out[f"{p}.attn.{b}"] = src.zeros(n, d_head) if bias_rows is None else bias_rows[:, picked, :].reshape(n, d_head)
    return out


def _output_and_mlp(src: _Source, h: str, p: str, names: tuple[str, str, str], dims: tuple, bias: bool) -> dict:
    """A block's attention output and ungated MLP read from the linear layers ``names`` (output
    projection, up, down) under ``h``, in circuitmath's names under ``p``; the biases zeros where
    the architecture has none. ``dims``: ``(heads, d_head, d_model, d_mlp)``."""
    heads, d_head, d, m = dims
    out_proj, up, down = names

    def bias_of(layer: str, size: int):
        return src.take(f"{h}.{layer}.bias", size) if bias else src.zeros(size)

    return {
        f"{p}.attn.W_O": src.linear(f"{h}.{out_proj}.weight", d, d).reshape(heads, d_head, d),
        f"{p}.attn.b_O": bias_of(out_proj, d),
        f"{p}.mlp.W_in": src.linear(f"{h}.{up}.weight", m, d), f"{p}.mlp.b_in": bias_of(up, m),
        f"{p}.mlp.W_out": src.linear(f"{h}.{down}.weight", d, m), f"{p}.mlp.b_out": bias_of(down, d),
    }
