"""The architecture description every state dict is read against."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ._errors import ConfigError

__all__ = ["Config", "config_expected"]

Normalization = Literal["LN", "LNPre", "RMS", "RMSPre"] | None
NORMALIZATIONS = ("LN", "LNPre", "RMS", "RMSPre", None)
POSITIONAL = ("standard", "shortformer", "shortformer_tables", "rotary", "alibi")
ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu")
NORM_POSITIONS = ("pre", "post")
QK_NORM_SPANS = ("head", "projection")
#: The one table of former names: an identity's former name -> its name now. ``Config.applied``
#: reads a former name as the current one, so a file saved under a former name still says what
#: was applied; :func:`circuitmath.get_identity` finds the identity by it, with a warning.
FORMER_NAMES: dict[str, str] = {
    "layer_norm_fold": "fold_layer_norm",
    "centring_projection": "centering_projection",
    "scale_invariance": "rescale_residual_stream",
    "rms_norm_fold": "fold_rms_norm",
    "shortformer_tables": "shortformer_to_tables",
    "rotation_invariance": "rotate_residual_stream",
}


@dataclass(frozen=True)
class Config:
    """A transformer in TransformerLens conventions (row vectors, ``x @ W``).

    ``normalization_type`` is the norm before every reader (``ln1``, ``ln2``, ``ln_final``):
    ``"LN"`` (center, normalise, gain ``w``, bias ``b``), ``"LNPre"`` (center and normalise only),
    ``"RMS"`` (normalise, gain), ``"RMSPre"`` (normalise only) or ``None``. ``norm_position`` is
    ``"pre"`` (GPT-2: the norm feeds each reader) or ``"post"`` (BERT: the norm is applied to the
    residual stream after each sub-layer's sum, so it feeds the stream itself).

    ``positional_embedding_type``: ``"standard"`` adds ``W_pos`` to the residual stream;
    ``"shortformer"`` adds ``W_pos`` only to the query and key inputs (after ``ln1``);
    ``"shortformer_tables"`` is a shortformer model with ``W_pos`` folded into each layer's
    positional query and key tables ``attn.pos_Q = W_pos @ W_Q`` and ``attn.pos_K = W_pos @ W_K``
    (``[n_ctx, heads, d_head]``), added to the queries and keys after projection;
    ``"rotary"`` rotates queries and keys by position and has no ``W_pos``; ``"alibi"`` (BLOOM)
    has no ``W_pos`` either and adds ``slope_h * k`` to head ``h``'s score of key position ``k``
    (:func:`~circuitmath._reference.alibi_slopes`; a shift of each query's row by
    ``-slope_h * q`` gives the usual ``-slope_h (q - k)``, and the softmax does not see it).

    ``gated_mlp``: the MLP computes ``act(x W_gate) * (x W_in + b_in)`` before ``W_out``
    (LLaMA). ``parallel_attn_mlp``: attention and MLP both read the block's input,
    ``x + attn(ln1(x)) + mlp(ln2(x))`` (GPT-J, GPT-NeoX). ``n_key_value_heads``: grouped-query
    attention, with keys and values (``attn._W_K``, ``attn._W_V``, ``[n_key_value_heads,
    d_model, d_head]``) shared by ``n_heads // n_key_value_heads`` query heads each.

    ``embedding_norm``: the embeddings pass through a norm (``embed.ln``, of
    ``normalization_type``) before the first block: BERT's post-norm models, and BLOOM's
    pre-LayerNorm models with ALiBi (nothing is added to the token embedding before its norm).

    Architecture features (each off by default; the identities' preconditions read them):

    - ``sliding_window``: a query attends only to the ``sliding_window`` most recent keys
      (itself included: key ``k`` is seen by query ``q`` when ``q - sliding_window < k <= q``),
      in the layers ``sliding_window_layers`` (``None``: every layer) (Mistral, Gemma 2).
    - ``qk_norm``: each head's query and key pass through an RMSNorm over ``d_head`` (gains
      ``attn.q_norm.w``, ``attn.k_norm.w`` ``[d_head]``, ``eps``) after their projection and
      before the rotary embedding (Qwen3). ``qk_norm_over="projection"``: one RMSNorm over the
      whole query projection (``n_heads * d_head`` entries) and one over the whole key projection
      (``n_key_value_heads * d_head``), with a gain per entry (``attn.q_norm.w`` ``[n_heads,
      d_head]``, ``attn.k_norm.w`` ``[n_key_value_heads, d_head]``) (OLMo-2).
    - ``norm_gain_offset``: every norm scales by ``norm_gain_offset + w`` (Gemma stores RMSNorm
      gains as ``w`` and scales by ``1 + w``).
    - ``embedding_scale``: the token embeddings are multiplied by this number, first rounded to
      the model's dtype as transformers does (Gemma: ``sqrt(d_model)``).
    - ``rotary_interleaved``: the rotary embedding rotates the pairs of neighbouring dimensions
      ``(2i, 2i + 1)`` (GPT-J) instead of ``(i, i + rotary_dim / 2)`` (GPT-NeoX, LLaMA).
    - ``attention_scale``: the scores ``q k^T`` are multiplied by this number instead of
      ``1 / sqrt(d_head)`` (Gemma 2's ``query_pre_attn_scalar ** -0.5``).
    - ``attn_softcap``, ``logit_softcap``: the scaled scores and the logits pass through
      ``cap * tanh(. / cap)`` (Gemma 2).
    - ``logit_scale``: the logits are multiplied by this number (Cohere), before any softcap.
    - ``post_norms``: each sub-layer's output passes through an RMSNorm of its own (gains
      ``ln1_post.w``, ``ln2_post.w``) before it is added to the residual stream (Gemma 2's
      sandwich norms); it needs a pre-RMSNorm model.
    - ``pre_norms``: ``False``: each sub-layer reads the residual stream itself, through no norm
      (no ``ln1``, ``ln2``; the final norm stays), and writes through its post-norm (OLMo-2's
      blocks, ``x + RMS(attn(x))``, ``x + RMS(mlp(x))``); it needs ``post_norms``.
    - ``n_experts``: each MLP is a mixture of ``n_experts`` gated experts of width ``d_mlp``
      (``circuitmath._moe``): a router ``mlp.W_router`` ``[d_model, n_experts]`` (and bias) reads
      the normalised stream, the ``experts_per_token`` experts of largest softmax weight run and
      their outputs are summed with those weights (renormalised over the chosen experts with
      ``router_normalize_top_k``); ``d_shared_mlp``: a shared expert of that width, run on every
      token and scaled by ``sigmoid(x W_shared_gate)``, is added (Qwen-MoE).
    - ``attn_sinks``: each head's softmax has one more logit, ``attn.sinks`` ``[n_heads]``, whose
      weight is dropped, so a pattern's rows sum to less than 1 (GPT-OSS).
    - ``swiglu_limit``: the gated MLPs compute ``(clamp(u, -L, L) + 1) * g' sigmoid(swiglu_alpha g')``
      with ``g' = min(g, L)`` for the gate's ``g`` and up's ``u`` (GPT-OSS's clamped SwiGLU;
      ``act_fn`` is not used).

    - ``tied_embeddings``: the unembedding is the token embedding transposed, ``unembed.W_U ==
      embed.W_E.T``, one tensor in the checkpoint (``tie_word_embeddings``: GPT-2, Gemma, OPT). A
      transform after which they differ returns ``tied_embeddings=False``: it untied them, and
      the config says so.

    - ``rotary_base_local``: the rotary base of the layers with a sliding window (Gemma 3's local
      layers; ``None``: ``rotary_base`` in every layer); :meth:`rotary_base_at` gives a layer's.

    ``applied`` records, in order, the weight transforms that produced the state dict. A former
    name of an identity (a config saved before the rename, see :data:`FORMER_NAMES`) is read as
    the current one.
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_vocab: int
    n_ctx: int
    d_mlp: int | None = None
    act_fn: str = "gelu"
    normalization_type: Normalization = "LN"
    norm_position: str = "pre"
    positional_embedding_type: str = "standard"
    rotary_dim: int | None = None
    rotary_base: float = 10000.0
    causal: bool = True
    gated_mlp: bool = False
    parallel_attn_mlp: bool = False
    n_key_value_heads: int | None = None
    embedding_norm: bool = False
    eps: float = 1e-5
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    qk_norm: bool = False
    qk_norm_over: str = "head"
    norm_gain_offset: float = 0.0
    embedding_scale: float | None = None
    attention_scale: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    post_norms: bool = False
    pre_norms: bool = True
    rotary_interleaved: bool = False
    logit_scale: float | None = None
    n_experts: int | None = None
    experts_per_token: int | None = None
    router_normalize_top_k: bool = True
    d_shared_mlp: int | None = None
    attn_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    rotary_base_local: float | None = None
    tied_embeddings: bool = False
    applied: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = _type_problems(self)
        if not problems:  # the relations between fields mean something only once each is well typed
            problems = _relation_problems(self)
        if problems:
            raise ConfigError("invalid Config: " + "; ".join(problems))
        object.__setattr__(self, "applied", tuple(FORMER_NAMES.get(name, name) for name in self.applied))
        object.__setattr__(self, "rotary_base", float(self.rotary_base))
        object.__setattr__(self, "eps", float(self.eps))
        object.__setattr__(self, "norm_gain_offset", float(self.norm_gain_offset))
        for name in ("embedding_scale", "attention_scale", "attn_softcap", "logit_softcap", "logit_scale",
                     "swiglu_limit", "swiglu_alpha", "rotary_base_local"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        if self.sliding_window_layers is not None:
            object.__setattr__(self, "sliding_window_layers", tuple(self.sliding_window_layers))

    @property
    def attn_only(self) -> bool:
        return self.d_mlp is None

    def window(self, layer: int | None) -> int | None:
        """The sliding window of layer ``layer`` (``None``: it attends to every earlier key).
        ``layer=None`` asks for a window every layer shares: :class:`ConfigError` when the
        layers differ."""
        if self.sliding_window is None or self.sliding_window_layers is None:
            return self.sliding_window
        if layer is None:
            if set(self.sliding_window_layers) not in (set(), set(range(self.n_layers))):
                raise ConfigError(f"sliding_window applies to the layers {list(self.sliding_window_layers)} only: name the layer")
            return self.sliding_window if self.sliding_window_layers else None
        return self.sliding_window if layer in self.sliding_window_layers else None

    def rotary_base_at(self, layer: int | None) -> float:
        """The rotary base of layer ``layer``: ``rotary_base_local`` in a layer with a sliding window
        (:meth:`window`), else ``rotary_base``; ``layer=None`` asks for a base every layer shares
        (:class:`ConfigError` when they differ)."""
        if self.rotary_base_local is None:
            return self.rotary_base
        return self.rotary_base_local if self.window(layer) is not None else self.rotary_base

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["applied"] = list(self.applied)
        if self.sliding_window_layers is not None:
            out["sliding_window_layers"] = list(self.sliding_window_layers)
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "Config":
        """A config from a mapping of field names to values (:meth:`to_dict`'s inverse).

        Unknown and missing fields, and ill-typed values, raise :class:`ConfigError` naming them.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"invalid Config: expected a JSON object of fields, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(data) - set(fields)))
        required = [name for name, f in fields.items() if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        problems = ([f"unknown keys {unknown}"] if unknown else []) + ([f"missing keys {missing}"] if missing else [])
        if problems:
            raise ConfigError("invalid Config: " + "; ".join(problems))
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Config":
        """A config from :meth:`to_json`'s text; :class:`ConfigError` says why one cannot be read."""
        return cls.from_dict(parse_json(text, "Config JSON"))


#: The largest JSON text circuitmath parses (a config, a Hugging Face config.json, a header).
MAX_JSON_BYTES = 1 << 20
#: How deeply a JSON text circuitmath parses may nest (a config needs 2 levels).
MAX_JSON_DEPTH = 32
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKETS = re.compile(r"[\[\]{}]")


def parse_json(text: str | bytes, what: str, *, limit: int = MAX_JSON_BYTES):
    """``json.loads(text)``, with every way it can fail a :class:`ConfigError` saying ``what`` it was.

    Texts over ``limit`` bytes (:data:`MAX_JSON_BYTES` by default) or nested deeper than :data:`MAX_JSON_DEPTH` are refused
    before they are parsed, so no input can make the parser run out of memory or stack.
    """
    if isinstance(text, bytes):
        if len(text) > limit:
            raise ConfigError(f"{what} is {len(text)} bytes, over the limit of {limit}")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError(f"{what} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not isinstance(text, str):
        raise ConfigError(f"{what} must be text, got {type(text).__name__}")
    if len(text) > limit:
        raise ConfigError(f"{what} is {len(text)} characters, over the limit of {limit}")
    depth = deepest = 0
    outside_strings = _JSON_STRING.sub('""', text)
    for bracket in _JSON_BRACKETS.findall(outside_strings):  # they bound how deep the parser recurses
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_JSON_DEPTH:
        raise ConfigError(f"{what} nests {deepest} levels deep, over the limit of {MAX_JSON_DEPTH}")
    try:
        return json.loads(text)
    except ValueError as error:
        raise ConfigError(f"{what} is not JSON: {error}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _type_problems(cfg: Config) -> list[str]:
    """Every field whose value has the wrong type or lies outside its range."""
    problems = []
    for name in ("n_layers", "d_model", "n_heads", "d_head", "d_vocab", "n_ctx"):
        value, floor = getattr(cfg, name), 0 if name == "n_layers" else 1
        if not _is_int(value) or value < floor:
            problems.append(f"{name} must be an int >= {floor}, got {value!r}")
    for name, meaning in (("d_mlp", "attention-only"), ("rotary_dim", "d_head"), ("n_key_value_heads", "n_heads"),
                          ("sliding_window", "no sliding window"), ("n_experts", "a dense MLP"),
                          ("experts_per_token", "a dense MLP"), ("d_shared_mlp", "no shared expert")):
        value = getattr(cfg, name)
        if value is not None and (not _is_int(value) or value < 1):
            problems.append(f"{name} must be None ({meaning}) or an int >= 1, got {value!r}")
    for name, allowed in (
        ("act_fn", ACTIVATIONS),
        ("normalization_type", NORMALIZATIONS),
        ("norm_position", NORM_POSITIONS),
        ("positional_embedding_type", POSITIONAL),
        ("qk_norm_over", QK_NORM_SPANS),
    ):
        value = getattr(cfg, name)
        if not (value is None or isinstance(value, str)) or value not in allowed:
            problems.append(f"{name} must be one of {allowed}, got {value!r}")
    for name in ("causal", "gated_mlp", "parallel_attn_mlp", "embedding_norm", "qk_norm", "post_norms", "pre_norms",
                 "rotary_interleaved", "router_normalize_top_k", "attn_sinks", "tied_embeddings"):
        if not isinstance(getattr(cfg, name), bool):
            problems.append(f"{name} must be True or False, got {getattr(cfg, name)!r}")
    if not _is_number(cfg.rotary_base) or cfg.rotary_base <= 0:
        problems.append(f"rotary_base must be a finite number > 0, got {cfg.rotary_base!r}")
    if not _is_number(cfg.eps) or cfg.eps < 0:
        problems.append(f"eps must be a finite number >= 0, got {cfg.eps!r}")
    if not _is_number(cfg.norm_gain_offset):
        problems.append(f"norm_gain_offset must be a finite number, got {cfg.norm_gain_offset!r}")
    for name in ("embedding_scale", "attention_scale", "attn_softcap", "logit_softcap", "logit_scale", "swiglu_limit",
                 "swiglu_alpha", "rotary_base_local"):
        value = getattr(cfg, name)
        if value is not None and (not _is_number(value) or value <= 0):
            problems.append(f"{name} must be None or a finite number > 0, got {value!r}")
    layers = cfg.sliding_window_layers
    if layers is not None and (isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple))
                               or not all(_is_int(i) and i >= 0 for i in layers)):
        problems.append(f"sliding_window_layers must be None or a list of layer indices, got {layers!r}")
    if isinstance(cfg.applied, (str, bytes)) or not isinstance(cfg.applied, (list, tuple)):
        problems.append(f"applied must be a list of identity names, got {cfg.applied!r}")
    elif not all(isinstance(name, str) for name in cfg.applied):
        problems.append(f"applied must hold identity names (strings), got {list(cfg.applied)!r}")
    return problems


def _relation_problems(cfg: Config) -> list[str]:
    """Every combination of (well-typed) fields the reference forward pass does not describe."""
    problems = []
    if cfg.norm_position == "post" and cfg.normalization_type is None:
        problems.append("norm_position='post' needs a normalization_type")
    if cfg.positional_embedding_type.startswith("shortformer") and cfg.norm_position == "post":
        problems.append("shortformer positional embeddings need a pre-norm model")
    if cfg.positional_embedding_type == "rotary":
        rotary_dim = cfg.rotary_dim if cfg.rotary_dim is not None else cfg.d_head
        if rotary_dim % 2 or not 0 < rotary_dim <= cfg.d_head:
            problems.append(f"rotary_dim must be even and in (0, d_head={cfg.d_head}], got {rotary_dim}")
    if cfg.gated_mlp and cfg.d_mlp is None:
        problems.append("gated_mlp needs d_mlp (an attention-only model has no MLP)")
    if cfg.parallel_attn_mlp and (cfg.d_mlp is None or cfg.norm_position == "post"):
        problems.append("parallel_attn_mlp needs an MLP and a pre-norm model")
    if cfg.embedding_norm and cfg.norm_position == "pre" and (cfg.normalization_type not in ("LN", "LNPre")
                                                              or cfg.positional_embedding_type != "alibi"):
        problems.append("embedding_norm in a pre-norm model is BLOOM's embedding LayerNorm: it needs a LayerNorm"
                        " (normalization_type 'LN' or 'LNPre') and positional_embedding_type='alibi' (no W_pos added before it)")
    if cfg.sliding_window_layers is not None:
        if cfg.sliding_window is None:
            problems.append("sliding_window_layers needs a sliding_window")
    if cfg.norm_gain_offset and cfg.normalization_type in ("LN", "LNPre"):
        problems.append("norm_gain_offset is for RMSNorm gains stored as w and applied as offset + w (Gemma); no LayerNorm family has it")
    if cfg.post_norms and (cfg.norm_position != "pre" or cfg.parallel_attn_mlp or cfg.normalization_type in ("LN", "LNPre")):
        problems.append("post_norms (sandwich RMSNorms after each sub-layer) need a sequential pre-norm model without LayerNorm")
    if not cfg.pre_norms and (not cfg.post_norms or cfg.normalization_type not in ("RMS", "RMSPre")):
        problems.append("pre_norms=False (sub-layers reading the residual stream itself, OLMo-2) needs post_norms and an RMSNorm")
    if cfg.qk_norm_over != "head" and not cfg.qk_norm:
        problems.append(f"qk_norm_over={cfg.qk_norm_over!r} says what the QK-norm spans: it needs qk_norm")
    if cfg.rotary_base_local is not None and (cfg.positional_embedding_type != "rotary" or cfg.sliding_window is None):
        problems.append("rotary_base_local is the rotary base of the sliding-window layers: it needs rotary positions and a sliding_window")
    if cfg.sliding_window is not None and not cfg.causal:
        problems.append("sliding_window is a causal mask; it needs causal=True")
    if cfg.n_key_value_heads is not None and cfg.n_heads % cfg.n_key_value_heads:
        problems.append(f"n_key_value_heads must be None or a divisor of n_heads={cfg.n_heads}, got {cfg.n_key_value_heads!r}")
    return problems + _mixture_problems(cfg)


def _mixture_problems(cfg: Config) -> list[str]:
    """The mixture-of-experts fields' relations (each well typed)."""
    if cfg.n_experts is None:
        wrong = [n for n in ("experts_per_token", "d_shared_mlp") if getattr(cfg, n) is not None]
        problems = [f"{', '.join(wrong)} need n_experts (a mixture-of-experts MLP)"] if wrong else []
    else:
        problems = []
    if cfg.swiglu_limit is not None and not cfg.gated_mlp:
        problems.append("swiglu_limit is a gated MLP's clamped SwiGLU; it needs gated_mlp")
    if cfg.n_experts is None:
        return problems
    if not cfg.gated_mlp or cfg.parallel_attn_mlp or cfg.norm_position != "pre":
        problems.append("n_experts needs gated experts (gated_mlp) in a sequential pre-norm model")
    if cfg.experts_per_token is None or cfg.experts_per_token > cfg.n_experts:
        problems.append(f"experts_per_token must be an int in [1, n_experts={cfg.n_experts}], got {cfg.experts_per_token!r}")
    return problems


def config_expected(cfg, state_dict, call: str) -> str:
    """What to say when ``cfg`` is no circuitmath Config: the arguments swapped (``state_dict`` is
    the Config: name the right ``call``), a mapping of fields (build a Config from it), or else."""
    found = type(cfg).__name__
    if isinstance(state_dict, Config):
        return (f"the arguments are in the wrong order (a Config, then a {found}): call {call}, the state dict"
                " first and its Config second")
    if isinstance(cfg, Mapping) and cfg and all(hasattr(value, "dtype") for value in cfg.values()):
        return f"expected a circuitmath Config, got a state dict ({found} of tensors): call {call}"
    hint = " (build one with Config.from_dict)" if isinstance(cfg, Mapping) else ""
    return f"expected a circuitmath Config, got {found}{hint}"

