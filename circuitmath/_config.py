"""The architecture description every state dict is read against."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal

__all__ = ["Config"]

Normalization = Literal["LN", "LNPre", "RMS", "RMSPre"] | None
NORMALIZATIONS = ("LN", "LNPre", "RMS", "RMSPre", None)
POSITIONAL = ("standard", "shortformer", "shortformer_tables", "rotary")
ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu")
NORM_POSITIONS = ("pre", "post")


@dataclass(frozen=True)
class Config:
    """A transformer in TransformerLens conventions (row vectors, ``x @ W``).

    ``normalization_type`` is the norm before every reader (``ln1``, ``ln2``, ``ln_final``):
    ``"LN"`` (centre, normalise, gain ``w``, bias ``b``), ``"LNPre"`` (centre and normalise only),
    ``"RMS"`` (normalise, gain), ``"RMSPre"`` (normalise only) or ``None``. ``norm_position`` is
    ``"pre"`` (GPT-2: the norm feeds each reader) or ``"post"`` (BERT: the norm is applied to the
    residual stream after each sub-layer's sum, so it feeds the stream itself).

    ``positional_embedding_type``: ``"standard"`` adds ``W_pos`` to the residual stream;
    ``"shortformer"`` adds ``W_pos`` only to the query and key inputs (after ``ln1``);
    ``"shortformer_tables"`` is a shortformer model with ``W_pos`` folded into each layer's
    positional query and key tables ``attn.pos_Q = W_pos @ W_Q`` and ``attn.pos_K = W_pos @ W_K``
    (``[n_ctx, heads, d_head]``), added to the queries and keys after projection;
    ``"rotary"`` rotates queries and keys by position and has no ``W_pos``.

    ``gated_mlp``: the MLP computes ``act(x W_gate) * (x W_in + b_in)`` before ``W_out``
    (LLaMA). ``parallel_attn_mlp``: attention and MLP both read the block's input,
    ``x + attn(ln1(x)) + mlp(ln2(x))`` (GPT-J, GPT-NeoX). ``n_key_value_heads``: grouped-query
    attention, with keys and values (``attn._W_K``, ``attn._W_V``, ``[n_key_value_heads,
    d_model, d_head]``) shared by ``n_heads // n_key_value_heads`` query heads each.

    ``embedding_norm``: the embeddings pass through a norm (``embed.ln``, of
    ``normalization_type``) before the first block (BERT); only post-norm models have it here.

    ``applied`` records, in order, the weight transforms that produced the state dict.
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
    applied: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        for name in ("n_layers",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                problems.append(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        for name in ("d_model", "n_heads", "d_head", "d_vocab", "n_ctx"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be an int >= 1, got {value!r}")
        if self.d_mlp is not None and (not isinstance(self.d_mlp, int) or self.d_mlp < 1):
            problems.append(f"d_mlp must be None (attention-only) or an int >= 1, got {self.d_mlp!r}")
        if self.act_fn not in ACTIVATIONS:
            problems.append(f"act_fn must be one of {ACTIVATIONS}, got {self.act_fn!r}")
        if self.normalization_type not in NORMALIZATIONS:
            problems.append(f"normalization_type must be one of {NORMALIZATIONS}, got {self.normalization_type!r}")
        if self.norm_position not in NORM_POSITIONS:
            problems.append(f"norm_position must be one of {NORM_POSITIONS}, got {self.norm_position!r}")
        if self.norm_position == "post" and self.normalization_type is None:
            problems.append("norm_position='post' needs a normalization_type")
        if self.positional_embedding_type not in POSITIONAL:
            problems.append(f"positional_embedding_type must be one of {POSITIONAL}, got {self.positional_embedding_type!r}")
        if self.positional_embedding_type.startswith("shortformer") and self.norm_position == "post":
            problems.append("shortformer positional embeddings need a pre-norm model")
        if self.positional_embedding_type == "rotary":
            rotary_dim = self.rotary_dim if self.rotary_dim is not None else self.d_head
            if rotary_dim % 2 or not 0 < rotary_dim <= self.d_head:
                problems.append(f"rotary_dim must be even and in (0, d_head={self.d_head}], got {rotary_dim}")
        if self.gated_mlp and self.d_mlp is None:
            problems.append("gated_mlp needs d_mlp (an attention-only model has no MLP)")
        if self.parallel_attn_mlp and (self.d_mlp is None or self.norm_position == "post"):
            problems.append("parallel_attn_mlp needs an MLP and a pre-norm model")
        if self.embedding_norm and self.norm_position != "post":
            problems.append("embedding_norm is the post-norm (BERT) layout; it needs norm_position='post'")
        if self.n_key_value_heads is not None and (
            not isinstance(self.n_key_value_heads, int)
            or self.n_key_value_heads < 1
            or self.n_heads % self.n_key_value_heads
        ):
            problems.append(
                f"n_key_value_heads must be None or a divisor of n_heads={self.n_heads}, got {self.n_key_value_heads!r}"
            )
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            problems.append(f"eps must be a number >= 0, got {self.eps!r}")
        if problems:
            raise ValueError("invalid Config: " + "; ".join(problems))
        object.__setattr__(self, "applied", tuple(self.applied))

    @property
    def attn_only(self) -> bool:
        return self.d_mlp is None

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["applied"] = list(self.applied)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"invalid Config: unknown keys {unknown}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        return cls.from_dict(json.loads(text))
