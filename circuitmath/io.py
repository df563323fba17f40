"""Weights in and out: safetensors only, and converters from Hugging Face checkpoints.

Nothing here ever unpickles. :func:`save` writes a state dict with its :class:`~circuitmath.Config`
in the safetensors metadata and :func:`load` reads it back; :func:`load_tensors` reads any
safetensors file. A PyTorch pickle (``.pt``, ``.pth``, ``.bin``, ``.ckpt``, ``.pkl``, or any file
that starts like one) is refused with :class:`UnsafeFormatError` before a byte of it is
interpreted: unpickling runs arbitrary code.

The converters turn a Hugging Face state dict and its config (the ``config.json`` as a dict, or a
``transformers`` config object; ``transformers`` itself is not needed) into a state dict in the
reference conventions (TransformerLens names, row vectors ``x @ W``, per-head
``W_Q [n_heads, d_model, d_head]``) and the matching ``Config``:

- :func:`from_hf_gpt2`: GPT-2 (pre-LN, learned positions, ``gelu_new``, tied unembed);
- :func:`from_hf_gpt_neox`: GPT-NeoX / Pythia (parallel attention and MLP, partial rotary);
- :func:`from_hf_llama`: LLaMA (RMSNorm, SiLU-gated MLP, grouped-query attention, rotary);
- :func:`from_hf_bert`: BERT (post-LN, embedding LayerNorm, bidirectional attention).

Every converter keeps the checkpoint's dtype, fills biases the architecture lacks with zeros,
refuses configurations the reference forward pass cannot reproduce (naming the option), and
refuses a state dict with tensors it does not know what to do with (naming them).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ._config import Config
from ._errors import CircuitMathError, StateDictError
from ._state import StateDict, attention_names, validate_state_dict

__all__ = [
    "UnsafeFormatError",
    "UnsupportedArchitectureError",
    "save",
    "load",
    "load_tensors",
    "from_hf",
    "from_hf_gpt2",
    "from_hf_gpt_neox",
    "from_hf_llama",
    "from_hf_bert",
    "load_hf_directory",
]

CONFIG_KEY = "circuitmath.config"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")


class UnsafeFormatError(CircuitMathError, ValueError):
    """The file is (or looks like) a pickle; circuitmath reads safetensors only."""


class UnsupportedArchitectureError(CircuitMathError, ValueError):
    """A Hugging Face config uses an option the reference forward pass does not reproduce."""


# ---------------------------------------------------------------------------------------------
# safetensors


def _refuse_pickle(path: Path) -> None:
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UnsafeFormatError(
            f"{path} has suffix {path.suffix!r}, a PyTorch pickle; circuitmath never unpickles (it can run"
            " arbitrary code). Convert it to safetensors where you trust it, e.g. with"
            " safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')"
        )
    with open(path, "rb") as handle:
        head = handle.read(9)
    if head[:2] == b"PK" or head[:1] == b"\x80":
        raise UnsafeFormatError(
            f"{path} starts like a PyTorch zip archive or a pickle, not a safetensors file; circuitmath never"
            " unpickles"
        )
    if len(head) < 9 or head[8:9] != b"{":
        raise UnsafeFormatError(f"{path} is not a safetensors file (no JSON header after the 8-byte length)")


def load_tensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the safetensors file at ``path`` and its string metadata.

    Raises :class:`UnsafeFormatError` for a pickle (refused by suffix and by content).
    """
    path = Path(path)
    _refuse_pickle(path)
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    return tensors, metadata


def save(
    path: str | os.PathLike, state_dict: StateDict, cfg: Config, *, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``state_dict`` (validated against ``cfg``) and ``cfg`` to a safetensors file.

    ``cfg`` is stored as JSON under the metadata key ``"circuitmath.config"``; ``metadata`` adds
    other string entries. The file name must end in ``.safetensors``.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: circuitmath writes safetensors only; use a name ending in .safetensors")
    validate_state_dict(state_dict, cfg)
    extra = dict(metadata or {})
    if CONFIG_KEY in extra:
        raise ValueError(f"metadata key {CONFIG_KEY!r} is reserved for the config")
    bad = [k for k, v in extra.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise ValueError(f"metadata keys and values must be strings; not so for {bad}")
    tensors = {name: tensor.detach().contiguous() for name, tensor in state_dict.items()}
    save_file(tensors, str(path), metadata={CONFIG_KEY: cfg.to_json(), **extra})


def load(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Config]:
    """Read a file written by :func:`save`: ``(state_dict, cfg)``, validated against each other.

    >>> import tempfile, torch
    >>> from circuitmath import Config, random_state_dict
    >>> cfg = Config(n_layers=1, d_model=4, n_heads=1, d_head=2, d_vocab=5, n_ctx=3)
    >>> sd = random_state_dict(cfg, seed=0)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     save(f"{folder}/m.safetensors", sd, cfg)
    ...     back, back_cfg = load(f"{folder}/m.safetensors")
    >>> back_cfg == cfg and all(torch.equal(back[k], sd[k]) for k in sd)
    True
    """
    tensors, metadata = load_tensors(path)
    if CONFIG_KEY not in metadata:
        raise StateDictError(
            f"{path} has no {CONFIG_KEY!r} metadata, so it was not written by circuitmath.io.save; read it with"
            " load_tensors and convert it (e.g. from_hf)"
        )
    cfg = Config.from_json(metadata[CONFIG_KEY])
    validate_state_dict(tensors, cfg)
    return tensors, cfg


# ---------------------------------------------------------------------------------------------
# Hugging Face converters


def _option(config, name: str, default=None):
    """``config[name]`` for a dict (a config.json), ``config.name`` for a transformers config."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


class _Source:
    """A Hugging Face state dict being consumed: every tensor taken is ticked off, so that
    :meth:`finish` can refuse tensors nobody converted."""

    def __init__(self, state_dict: StateDict, prefixes: tuple[str, ...], ignored: str | None = None):
        if not isinstance(state_dict, Mapping):
            raise StateDictError(f"expected a mapping of names to tensors, got {type(state_dict).__name__}")
        names = list(state_dict)
        for prefix in prefixes:  # a task model (GPT2LMHeadModel, BertForX) nests the base model
            if any(n.startswith(prefix) for n in names):
                names = [n[len(prefix):] if n.startswith(prefix) else n for n in names]
                state_dict = dict(zip(names, state_dict.values()))
                break
        skip = re.compile(ignored) if ignored else None
        self.tensors = {n: t for n, t in state_dict.items() if not (skip and skip.fullmatch(n))}
        self.unused = set(self.tensors)
        floats = {t.dtype for t in self.tensors.values() if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if len(floats) != 1:
            raise StateDictError(f"expected one floating dtype in the checkpoint, found {sorted(map(str, floats))}")
        self.dtype = floats.pop()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise StateDictError(f"the checkpoint has no tensor {name!r}")
        self.unused.discard(name)
        return self.tensors[name].detach()

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype)

    def finish(self, out: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], Config]:
        if self.unused:
            raise StateDictError(
                f"the checkpoint has tensors this converter does not use: {sorted(self.unused)}; the config"
                " does not describe the weights, or the architecture has a part the reference lacks"
            )
        out = {name: tensor.contiguous() for name, tensor in out.items()}
        validate_state_dict(out, cfg)
        return out, cfg


def _activation(hf_name: str, architecture: str) -> str:
    known = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
    if hf_name not in known:
        raise UnsupportedArchitectureError(
            f"{architecture}: activation {hf_name!r} is not one the reference has ({sorted(set(known.values()))})"
        )
    return known[hf_name]


def _require(holds: bool, architecture: str, detail: str) -> None:
    if not holds:
        raise UnsupportedArchitectureError(f"{architecture}: {detail}")


def _heads_from_columns(weight: torch.Tensor, heads: int, d_head: int) -> torch.Tensor:
    """``[d_model, heads * d_head]`` (columns grouped by head) to ``[heads, d_model, d_head]``."""
    return weight.reshape(weight.shape[0], heads, d_head).permute(1, 0, 2)


def _linear_heads(source: _Source, prefix: str, heads: int, d_head: int, bias: bool):
    """A ``torch.nn.Linear`` projecting to ``heads * d_head`` as per-head weight and bias."""
    weight = _heads_from_columns(source.take(f"{prefix}.weight").T, heads, d_head)
    b = source.take(f"{prefix}.bias").reshape(heads, d_head) if bias else source.zeros(heads, d_head)
    return weight, b


def _rotary(config, d_head: int, architecture: str) -> tuple[float, int]:
    """``(base, rotary_dim)`` from ``rope_parameters`` (transformers 5) or the older fields."""
    rope = _option(config, "rope_parameters") or {}
    scaling = _option(config, "rope_scaling")
    kind = rope.get("rope_type", (scaling or {}).get("rope_type", "default"))
    _require(kind == "default", architecture, f"rope_type {kind!r}; only the default rotary embedding is in the reference")
    base = rope.get("rope_theta", _option(config, "rope_theta", _option(config, "rotary_emb_base", 10000.0)))
    fraction = rope.get("partial_rotary_factor", _option(config, "rotary_pct", 1.0))
    rotary_dim = int(d_head * fraction)
    _require(rotary_dim % 2 == 0 and rotary_dim > 0, architecture, f"rotary dimension {rotary_dim} is not even and positive")
    return float(base), rotary_dim


def from_hf_gpt2(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face GPT-2 checkpoint (``GPT2Model`` or ``GPT2LMHeadModel``).

    GPT-2 stores its projections as ``Conv1D`` (``x @ W + b``, already row-vector). ``c_attn``
    holds ``[W_Q | W_K | W_V]`` side by side, each with its heads side by side. Without an
    ``lm_head.weight`` the unembed is the tied ``wte``; ``b_U`` is zero.
    """
    arch = "GPT-2"
    d, heads, layers = _option(config, "n_embd"), _option(config, "n_head"), _option(config, "n_layer")
    d_head, d_mlp = d // heads, _option(config, "n_inner") or 4 * d
    _require(d % heads == 0, arch, f"n_embd={d} is not a multiple of n_head={heads}")
    _require(_option(config, "scale_attn_weights", True), arch, "scale_attn_weights=False (no 1/sqrt(d_head))")
    _require(not _option(config, "scale_attn_by_inverse_layer_idx", False), arch,
             "scale_attn_by_inverse_layer_idx=True divides scores by the layer number")
    _require(not _option(config, "add_cross_attention", False), arch, "cross-attention")
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_option(config, "vocab_size"),
        n_ctx=_option(config, "n_positions"), d_mlp=d_mlp,
        act_fn=_activation(_option(config, "activation_function", "gelu_new"), arch),
        eps=float(_option(config, "layer_norm_epsilon", 1e-5)),
    )
    src = _Source(state_dict, ("transformer.",), ignored=r"h\.\d+\.attn\.(masked_)?bias")  # causal-mask buffers
    out = {"embed.W_E": src.take("wte.weight"), "pos_embed.W_pos": src.take("wpe.weight")}
    for layer in range(layers):
        h, p = f"h.{layer}", f"blocks.{layer}"
        out[f"{p}.ln1.w"], out[f"{p}.ln1.b"] = src.take(f"{h}.ln_1.weight"), src.take(f"{h}.ln_1.bias")
        qkv_w, qkv_b = src.take(f"{h}.attn.c_attn.weight"), src.take(f"{h}.attn.c_attn.bias")
        for i, name in enumerate("QKV"):
            out[f"{p}.attn.W_{name}"] = _heads_from_columns(qkv_w[:, i * d:(i + 1) * d], heads, d_head)
            out[f"{p}.attn.b_{name}"] = qkv_b[i * d:(i + 1) * d].reshape(heads, d_head)
        out[f"{p}.attn.W_O"] = src.take(f"{h}.attn.c_proj.weight").reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.attn.c_proj.bias")
        out[f"{p}.ln2.w"], out[f"{p}.ln2.b"] = src.take(f"{h}.ln_2.weight"), src.take(f"{h}.ln_2.bias")
        out[f"{p}.mlp.W_in"], out[f"{p}.mlp.b_in"] = src.take(f"{h}.mlp.c_fc.weight"), src.take(f"{h}.mlp.c_fc.bias")
        out[f"{p}.mlp.W_out"] = src.take(f"{h}.mlp.c_proj.weight")
        out[f"{p}.mlp.b_out"] = src.take(f"{h}.mlp.c_proj.bias")
    out["ln_final.w"], out["ln_final.b"] = src.take("ln_f.weight"), src.take("ln_f.bias")
    out["unembed.W_U"] = (src.take("lm_head.weight") if "lm_head.weight" in src else out["embed.W_E"]).T
    out["unembed.b_U"] = src.zeros(cfg.d_vocab)
    return src.finish(out, cfg)


def from_hf_gpt_neox(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face GPT-NeoX checkpoint (``GPTNeoXModel`` or ``GPTNeoXForCausalLM``).

    ``query_key_value`` is a ``Linear`` whose output is laid out per head as ``[q | k | v]``
    (``3 * d_head`` rows per head). ``use_parallel_residual`` maps to ``parallel_attn_mlp``;
    ``rotary_pct`` / ``partial_rotary_factor`` to ``rotary_dim``. The unembed (``embed_out``,
    named ``lm_head`` by transformers 5) has no bias (``b_U`` is zero).
    """
    arch = "GPT-NeoX"
    d, heads, layers = _option(config, "hidden_size"), _option(config, "num_attention_heads"), _option(config, "num_hidden_layers")
    _require(d % heads == 0, arch, f"hidden_size={d} is not a multiple of num_attention_heads={heads}")
    d_head = d // heads
    base, rotary_dim = _rotary(config, d_head, arch)
    bias = _option(config, "attention_bias", True)
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_option(config, "vocab_size"),
        n_ctx=_option(config, "max_position_embeddings"), d_mlp=_option(config, "intermediate_size"),
        act_fn=_activation(_option(config, "hidden_act", "gelu"), arch), eps=float(_option(config, "layer_norm_eps", 1e-5)),
        positional_embedding_type="rotary", rotary_dim=rotary_dim, rotary_base=base,
        parallel_attn_mlp=bool(_option(config, "use_parallel_residual", True)),
    )
    src = _Source(state_dict, ("gpt_neox.",), ignored=r"(layers\.\d+\.attention\.)?(rotary_emb\.inv_freq|(masked_)?bias)")
    out = {"embed.W_E": src.take("embed_in.weight")}
    for layer in range(layers):
        h, p = f"layers.{layer}", f"blocks.{layer}"
        out[f"{p}.ln1.w"], out[f"{p}.ln1.b"] = src.take(f"{h}.input_layernorm.weight"), src.take(f"{h}.input_layernorm.bias")
        qkv = src.take(f"{h}.attention.query_key_value.weight").T.reshape(d, heads, 3, d_head)
        qkv_b = src.take(f"{h}.attention.query_key_value.bias").reshape(heads, 3, d_head) if bias else None
        for i, name in enumerate("QKV"):
            out[f"{p}.attn.W_{name}"] = qkv[:, :, i, :].permute(1, 0, 2)
            out[f"{p}.attn.b_{name}"] = qkv_b[:, i, :] if bias else src.zeros(heads, d_head)
        out[f"{p}.attn.W_O"] = src.take(f"{h}.attention.dense.weight").T.reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.attention.dense.bias") if bias else src.zeros(d)
        out[f"{p}.ln2.w"] = src.take(f"{h}.post_attention_layernorm.weight")
        out[f"{p}.ln2.b"] = src.take(f"{h}.post_attention_layernorm.bias")
        out[f"{p}.mlp.W_in"], out[f"{p}.mlp.b_in"] = src.take(f"{h}.mlp.dense_h_to_4h.weight").T, src.take(f"{h}.mlp.dense_h_to_4h.bias")
        out[f"{p}.mlp.W_out"], out[f"{p}.mlp.b_out"] = src.take(f"{h}.mlp.dense_4h_to_h.weight").T, src.take(f"{h}.mlp.dense_4h_to_h.bias")
    out["ln_final.w"], out["ln_final.b"] = src.take("final_layer_norm.weight"), src.take("final_layer_norm.bias")
    head = next((n for n in ("embed_out.weight", "lm_head.weight") if n in src), None)  # transformers 4 / 5 name
    _require(head is not None or _option(config, "tie_word_embeddings", False), arch, "no unembed and untied embeddings")
    out["unembed.W_U"] = (src.take(head) if head else out["embed.W_E"]).T
    out["unembed.b_U"] = src.zeros(cfg.d_vocab)
    return src.finish(out, cfg)


def from_hf_llama(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert a Hugging Face LLaMA checkpoint (``LlamaModel`` or ``LlamaForCausalLM``).

    RMSNorm gains become ``ln1.w``, ``ln2.w``, ``ln_final.w``; ``up_proj`` is ``W_in`` and
    ``gate_proj`` is ``W_gate`` (``silu(x W_gate) * (x W_in)``); with fewer key/value heads than
    query heads the keys and values are ``_W_K``, ``_W_V`` (grouped-query attention). Missing
    biases (``attention_bias=False``) are zero. ``mlp_bias=True`` is refused: the reference's
    ``W_gate`` has no bias.
    """
    arch = "LLaMA"
    d, heads, layers = _option(config, "hidden_size"), _option(config, "num_attention_heads"), _option(config, "num_hidden_layers")
    d_head = _option(config, "head_dim") or d // heads
    kv_heads = _option(config, "num_key_value_heads") or heads
    base, rotary_dim = _rotary(config, d_head, arch)
    _require(rotary_dim == d_head, arch, "partial rotary (LLaMA rotates every query/key dimension)")
    _require(not _option(config, "mlp_bias", False), arch, "mlp_bias=True puts a bias inside the gate, which the reference lacks")
    bias = bool(_option(config, "attention_bias", False))
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_option(config, "vocab_size"),
        n_ctx=_option(config, "max_position_embeddings"), d_mlp=_option(config, "intermediate_size"),
        act_fn=_activation(_option(config, "hidden_act", "silu"), arch), normalization_type="RMS",
        eps=float(_option(config, "rms_norm_eps", 1e-6)), positional_embedding_type="rotary", rotary_base=base,
        gated_mlp=True, n_key_value_heads=kv_heads if kv_heads != heads else None,
    )
    src = _Source(state_dict, ("model.",), ignored=r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
    out = {"embed.W_E": src.take("embed_tokens.weight")}
    for layer in range(layers):
        h, p = f"layers.{layer}", f"blocks.{layer}"
        out[f"{p}.ln1.w"] = src.take(f"{h}.input_layernorm.weight")
        for name, proj in (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj")):
            weight, b, n = attention_names(cfg, name)
            out[f"{p}.attn.{weight}"], out[f"{p}.attn.{b}"] = _linear_heads(src, f"{h}.self_attn.{proj}", n, d_head, bias)
        out[f"{p}.attn.W_O"] = src.take(f"{h}.self_attn.o_proj.weight").T.reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.self_attn.o_proj.bias") if bias else src.zeros(d)
        out[f"{p}.ln2.w"] = src.take(f"{h}.post_attention_layernorm.weight")
        out[f"{p}.mlp.W_in"] = src.take(f"{h}.mlp.up_proj.weight").T
        out[f"{p}.mlp.W_gate"] = src.take(f"{h}.mlp.gate_proj.weight").T
        out[f"{p}.mlp.b_in"] = src.zeros(cfg.d_mlp)
        out[f"{p}.mlp.W_out"] = src.take(f"{h}.mlp.down_proj.weight").T
        out[f"{p}.mlp.b_out"] = src.zeros(d)
    out["ln_final.w"] = src.take("norm.weight")
    tied = "lm_head.weight" not in src
    _require(not tied or _option(config, "tie_word_embeddings", False), arch, "no lm_head.weight and untied embeddings")
    out["unembed.W_U"] = (out["embed.W_E"] if tied else src.take("lm_head.weight")).T
    out["unembed.b_U"] = src.zeros(cfg.d_vocab)
    return src.finish(out, cfg)


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
    arch = "BERT"
    d, heads, layers = _option(config, "hidden_size"), _option(config, "num_attention_heads"), _option(config, "num_hidden_layers")
    _require(d % heads == 0, arch, f"hidden_size={d} is not a multiple of num_attention_heads={heads}")
    _require(_option(config, "position_embedding_type", "absolute") == "absolute", arch,
             f"position_embedding_type={_option(config, 'position_embedding_type')!r}; only absolute positions")
    _require(not _option(config, "is_decoder", False), arch, "is_decoder=True (a causal BERT)")
    d_head = d // heads
    cfg = Config(
        n_layers=layers, d_model=d, n_heads=heads, d_head=d_head, d_vocab=_option(config, "vocab_size"),
        n_ctx=_option(config, "max_position_embeddings"), d_mlp=_option(config, "intermediate_size"),
        act_fn=_activation(_option(config, "hidden_act", "gelu"), arch), eps=float(_option(config, "layer_norm_eps", 1e-12)),
        norm_position="post", causal=False, embedding_norm=True,
    )
    src = _Source(state_dict, ("bert.",), ignored=r"(pooler|cls)\..*|embeddings\.(position|token_type)_ids")
    e = "embeddings"
    out = {
        "embed.W_E": src.take(f"{e}.word_embeddings.weight"),
        "pos_embed.W_pos": src.take(f"{e}.position_embeddings.weight") + src.take(f"{e}.token_type_embeddings.weight")[0],
        "embed.ln.w": src.take(f"{e}.LayerNorm.weight"),
        "embed.ln.b": src.take(f"{e}.LayerNorm.bias"),
    }
    for layer in range(layers):
        h, p = f"encoder.layer.{layer}", f"blocks.{layer}"
        for name, proj in (("Q", "query"), ("K", "key"), ("V", "value")):
            out[f"{p}.attn.W_{name}"], out[f"{p}.attn.b_{name}"] = _linear_heads(
                src, f"{h}.attention.self.{proj}", heads, d_head, bias=True)
        out[f"{p}.attn.W_O"] = src.take(f"{h}.attention.output.dense.weight").T.reshape(heads, d_head, d)
        out[f"{p}.attn.b_O"] = src.take(f"{h}.attention.output.dense.bias")
        out[f"{p}.ln1.w"] = src.take(f"{h}.attention.output.LayerNorm.weight")
        out[f"{p}.ln1.b"] = src.take(f"{h}.attention.output.LayerNorm.bias")
        out[f"{p}.mlp.W_in"] = src.take(f"{h}.intermediate.dense.weight").T
        out[f"{p}.mlp.b_in"] = src.take(f"{h}.intermediate.dense.bias")
        out[f"{p}.mlp.W_out"] = src.take(f"{h}.output.dense.weight").T
        out[f"{p}.mlp.b_out"] = src.take(f"{h}.output.dense.bias")
        out[f"{p}.ln2.w"] = src.take(f"{h}.output.LayerNorm.weight")
        out[f"{p}.ln2.b"] = src.take(f"{h}.output.LayerNorm.bias")
    out["unembed.W_U"] = out["embed.W_E"].T
    out["unembed.b_U"] = src.zeros(cfg.d_vocab)
    return src.finish(out, cfg)


CONVERTERS = {"gpt2": from_hf_gpt2, "gpt_neox": from_hf_gpt_neox, "llama": from_hf_llama, "bert": from_hf_bert}


def from_hf(state_dict: StateDict, config) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert with the converter for ``config``'s ``model_type`` (gpt2, gpt_neox, llama, bert)."""
    model_type = _option(config, "model_type")
    if model_type not in CONVERTERS:
        raise UnsupportedArchitectureError(f"model_type {model_type!r}: converters exist for {sorted(CONVERTERS)}")
    return CONVERTERS[model_type](state_dict, config)


def load_hf_directory(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Config]:
    """Convert the ``config.json`` and ``model.safetensors`` of a Hugging Face model folder.

    A folder with only ``pytorch_model.bin`` (a pickle) is refused with :class:`UnsafeFormatError`.
    """
    directory = Path(directory)
    weights = directory / "model.safetensors"
    if not weights.exists():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise UnsafeFormatError(f"{directory} has only pickled weights {pickles}; circuitmath reads safetensors only")
        raise FileNotFoundError(f"{directory} has no model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    tensors, _metadata = load_tensors(weights)
    return from_hf(tensors, config)
