"""Attention patterns and the path expansion of attention-only models, on the reference forward pass.

:func:`path_terms` and :func:`score_terms` run :func:`circuitmath.forward` once, with
``record=``, and freeze what it recorded (the attention patterns, and each norm's scale at the
residual stream it read): every other operation is then linear, and the logits (the scores)
split into a sum over paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._config import Config
from .._errors import InputError, Precondition
from .._processing._common import NO_LOGIT_SOFTCAP, NO_POST_NORMS, NO_QK_NORM, require
from .._reference import project, rotate, forward, pattern_from_scores
from .._state import StateDict, validated
from ._heads import layer_bias, layer_weight

__all__ = ["POSITIONS", "attention_patterns", "Path", "path_terms", "SCORE_TERMS", "score_terms", "PATH_MODEL"]


#: Positional embeddings the path expansion knows: ``standard`` writes ``W_pos`` into the stream
#: (a path source of its own); the others act on queries and keys only, inside the frozen patterns.
POSITIONS = ("standard", "rotary", "shortformer", "shortformer_tables")


#: What the path expansion needs of a model; every identity whose route runs it registers these.
PATH_MODEL = (
    Precondition("attention-only", "attention-only: no MLP, whose non-linearity would mix the paths"),
    Precondition("pre-norm", "pre-norm (or no norm): each norm's scale is frozen at the stream it read"),
    Precondition("known positional embedding", f"positional_embedding_type is one of {POSITIONS}"),
    NO_LOGIT_SOFTCAP,
    NO_POST_NORMS,
    Precondition("no embedding or logit scale",
                 "the stream starts at W_E's rows and the logits are the stream read by W_U, unscaled: no"
                 " embedding_scale or logit_scale (fold them into W_E and W_U first)"),
)


def _require_path_model(cfg: Config, identity: str) -> None:
    attention_only, pre_norm, known_positions, no_logit_softcap, no_post_norms, unscaled = PATH_MODEL
    require(identity, attention_only, cfg.attn_only, "the model has MLPs, which are not linear in the residual stream")
    require(identity, pre_norm, cfg.norm_position == "pre", "a post-norm model normalises the residual stream itself")
    require(identity, known_positions, cfg.positional_embedding_type in POSITIONS,
            f"positional_embedding_type is {cfg.positional_embedding_type!r}")
    require(identity, no_logit_softcap, cfg.logit_softcap is None,
            "the logits pass through a softcap, so they are not the sum of the path terms")
    require(identity, no_post_norms, not cfg.post_norms,
            "each layer writes through a sandwich norm of its own, which the path terms do not freeze")
    scales = [f"{name} is {getattr(cfg, name)}" for name in ("embedding_scale", "logit_scale") if getattr(cfg, name) is not None]
    require(identity, unscaled, not scales, " and ".join(scales))


@dataclass(frozen=True)
class FrozenNorm:
    """A norm with its scale frozen: ``N(x) = s * (x P) * w + b`` with ``P`` centering or not."""

    kind: str | None
    scale: torch.Tensor | None  # [batch, pos, 1]
    w: torch.Tensor | None
    b: torch.Tensor | None

    @classmethod
    def freeze(cls, state_dict: StateDict, cfg: Config, prefix: str, x: torch.Tensor) -> "FrozenNorm":
        kind = cfg.normalization_type
        if kind is None:
            return cls(None, None, None, None)
        centered = x - x.mean(dim=-1, keepdim=True) if kind in ("LN", "LNPre") else x
        scale = 1 / torch.sqrt(centered.pow(2).mean(dim=-1, keepdim=True) + cfg.eps)
        w = state_dict.get(f"{prefix}.w")
        if w is not None and cfg.norm_gain_offset:
            w = cfg.norm_gain_offset + w
        return cls(kind, scale, w, state_dict.get(f"{prefix}.b"))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The linear part, applied to one term of the residual stream."""
        if self.kind is None:
            return x
        if self.kind in ("LN", "LNPre"):
            x = x - x.mean(dim=-1, keepdim=True)
        x = x * self.scale
        return x * self.w if self.kind in ("LN", "RMS") else x

    def constant(self, like: torch.Tensor) -> torch.Tensor:
        """The constant part ``b`` (zero unless LN), broadcast to ``like``."""
        if self.kind != "LN":
            return torch.zeros((), dtype=like.dtype, device=like.device).expand_as(like)
        return self.b.to(like.dtype).expand_as(like)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.constant(x)


#: The reference forward pass's scores-to-pattern step (scale, causal mask, softmax).
_softmax_scores = pattern_from_scores


def embedding_terms(state_dict: StateDict, cfg: Config, tokens: torch.Tensor) -> dict["Path", torch.Tensor]:
    terms = {Path("embed"): state_dict["embed.W_E"][tokens]}
    if cfg.positional_embedding_type == "standard":
        pos = state_dict["pos_embed.W_pos"][: tokens.shape[1]]
        terms[Path("pos")] = pos.expand_as(terms[Path("embed")])
    return terms


@dataclass(frozen=True)
class _Run:
    """A forward pass of an attention-only model, with what the path expansion freezes."""

    patterns: tuple[torch.Tensor, ...]  # per layer [batch, n_heads, pos, pos]
    norms: tuple[FrozenNorm, ...]  # ln1 of every layer, then ln_final
    inputs: tuple[torch.Tensor, ...]  # residual stream entering every layer, then ln_final


def recorded_run(state_dict: StateDict, cfg: Config, tokens: torch.Tensor, identity: str) -> _Run:
    """The reference forward pass (:func:`circuitmath.forward`), with the patterns and the
    residual streams it records, and each norm's scale frozen at the stream it read."""
    state_dict = validated(state_dict, cfg)
    _require_path_model(cfg, identity)
    record: dict = {}
    forward(state_dict, cfg, tokens, record=record)
    inputs = (*record["residuals"], record["final_residual"])
    norms = [FrozenNorm.freeze(state_dict, cfg, f"blocks.{layer}.ln1", x) for layer, x in enumerate(inputs[:-1])]
    norms.append(FrozenNorm.freeze(state_dict, cfg, "ln_final", inputs[-1]))
    return _Run(tuple(record["patterns"]), tuple(norms), inputs)


def _head_outputs(state_dict, cfg, layer, pattern, normed, with_bias: bool = True) -> torch.Tensor:
    """``A^h (normed W_V^h + b_V^h) W_O^h`` for every head: ``[batch, pos, n_heads, d_model]``."""
    v = torch.einsum("bpd,hde->bphe", normed, layer_weight(state_dict, cfg, layer, "V"))
    if with_bias:
        v = v + layer_bias(state_dict, cfg, layer, "V")
    z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
    return torch.einsum("bqhe,hed->bqhd", z, state_dict[f"blocks.{layer}.attn.W_O"])


def attention_patterns(state_dict: StateDict, cfg: Config, tokens: torch.Tensor) -> torch.Tensor:
    """The attention patterns of a forward pass: ``[n_layers, batch, n_heads, query, key]``.

    Recorded by the reference forward pass (:func:`circuitmath.forward`), for any model it
    runs; rows sum to 1 and causal models put zero weight on future keys. A model without
    layers has none: ``[0, batch, n_heads, query, key]``.
    """
    record: dict = {}
    logits = forward(state_dict, cfg, tokens, record=record)
    if not record["patterns"]:
        batch, pos = logits.shape[:2]
        return logits.new_zeros(0, batch, cfg.n_heads, pos, pos)
    return torch.stack(record["patterns"])


@dataclass(frozen=True, order=True)
class Path:
    """A path through an attention-only model: where it starts, and the heads it passes through.

    ``source`` is ``"embed"`` (the token embedding ``W_E[t]``), ``"pos"`` (``W_pos``, standard
    positional embeddings), ``"bias L"`` (the constants layer ``L`` writes: ``b_O``, and
    ``b_V`` and the ``ln1`` bias through every head) or ``"bias out"`` (``b_U`` and the final
    norm's bias); ``heads`` lists ``(layer, head)`` pairs in increasing layer order. ``str``
    gives e.g. ``embed → L0H1 → L1H0``.
    """

    source: str
    heads: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        return " → ".join([self.source, *(f"L{l}H{h}" for l, h in self.heads)])

    @property
    def order(self) -> int:
        """How many heads the path passes through: 0 direct, 1 a head, 2 a virtual head, …"""
        return len(self.heads)


def path_terms(
    state_dict: StateDict, cfg: Config, tokens: torch.Tensor, *, max_paths: int = 10_000
) -> dict[Path, torch.Tensor]:
    """The logits of an attention-only model as a sum of paths: ``{path: [batch, pos, d_vocab]}``.

    With every attention pattern ``A^{l,h}`` and every norm's scale fixed at the values the
    forward pass on ``tokens`` computes, the model is linear, and its logits expand into

        Σ_paths  (A^{l_k,h_k} ... A^{l_1,h_1} ⊗ W_U W_OV^{l_k,h_k} ... W_OV^{l_1,h_1} W_E)·t

    (the paper's notation, norms' linear parts included), plus the same for positional
    embeddings and biases. The values sum to :func:`circuitmath.forward`'s logits up to
    rounding (identities ``one_layer_path_expansion`` and ``two_layer_path_expansion``).
    Pre-norm attention-only models (any norm, any positional embedding, grouped-query
    attention). There are about ``(n_heads + 1) ** n_layers`` paths per source;
    more than ``max_paths`` is an error.
    """
    run = recorded_run(state_dict, cfg, tokens, "two_layer_path_expansion")
    sources = 2 + cfg.n_layers
    count = sources * (cfg.n_heads + 1) ** cfg.n_layers
    if count > max_paths:
        raise InputError(f"about {count} paths (more than max_paths={max_paths}); raise max_paths to expand anyway")
    terms = embedding_terms(state_dict, cfg, tokens)
    for layer in range(cfg.n_layers):
        terms = through_layer(state_dict, cfg, layer, run, terms)
    final = run.norms[-1]
    W_U = state_dict["unembed.W_U"]
    logits = {path: final.linear(x) @ W_U for path, x in terms.items()}
    some = next(iter(terms.values()))
    logits[Path("bias out")] = final.constant(some) @ W_U + state_dict["unembed.b_U"]
    return logits


def through_layer(state_dict, cfg, layer, run: _Run, terms: dict) -> dict:
    """Every term of the residual stream, plus each term passed through each head of ``layer``."""
    norm, pattern = run.norms[layer], run.patterns[layer]
    out = dict(terms)
    for path, x in terms.items():
        heads = _head_outputs(state_dict, cfg, layer, pattern, norm.linear(x), with_bias=False)
        for h in range(cfg.n_heads):
            out[Path(path.source, path.heads + ((layer, h),))] = heads[:, :, h]
    some = next(iter(terms.values()))
    constant = _head_outputs(state_dict, cfg, layer, pattern, norm.constant(some)).sum(dim=2)
    out[Path(f"bias {layer}")] = constant + state_dict[f"blocks.{layer}.attn.b_O"]
    return out


#: The groups :func:`score_terms` splits attention scores into.
SCORE_TERMS = ("direct", "q_composition", "k_composition", "qk_composition", "bias")


def score_terms(state_dict: StateDict, cfg: Config, tokens: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """The attention scores of ``layer`` split by where queries and keys read from:
    ``{group: [batch, n_heads, query, key]}``.

    The residual stream entering ``layer`` is a sum of paths (:func:`path_terms`, patterns and
    norm scales frozen): *direct* ones (the embeddings, no head), *composed* ones (through at
    least one earlier head) and *constant* ones (biases). Queries and keys are linear in it, so
    the scores ``q k^T`` split into

    - ``"direct"``: direct queries against direct keys (``x_0 W_QK x_0^T``);
    - ``"q_composition"``: composed queries, direct keys (``A x_0 W_OV W_QK x_0^T``);
    - ``"k_composition"``: direct queries, composed keys (``x_0 W_QK W_OV^T x_0^T A^T``);
    - ``"qk_composition"``: composed queries and keys;
    - ``"bias"``: every product with a constant part (biases, shortformer positions).

    They sum to the layer's scores before the ``1/sqrt(d_head)`` scale and the causal mask
    (identity ``qk_composition_terms``). V-composition is in the values, not the scores: it is
    the virtual heads of :func:`path_terms`. Rotary embeddings rotate each part (a linear map).
    """
    run = recorded_run(state_dict, cfg, tokens, "qk_composition_terms")
    require("qk_composition_terms", NO_QK_NORM, not cfg.qk_norm,
            "the model normalises each head's queries and keys (QK-norm), so the scores are not bilinear in the stream"
            " and do not split into direct and composed terms")
    if not 0 <= layer < cfg.n_layers:
        raise InputError(f"layer must lie in [0, n_layers={cfg.n_layers}), got {layer}")
    terms = embedding_terms(state_dict, cfg, tokens)
    for earlier in range(layer):
        terms = through_layer(state_dict, cfg, earlier, run, terms)
    norm = run.norms[layer]
    some = next(iter(terms.values()))
    direct = sum(x for p, x in terms.items() if p.order == 0 and not p.source.startswith("bias"))
    composed = [x for p, x in terms.items() if p.order > 0]
    constant = norm.constant(some) + sum((norm.linear(x) for p, x in terms.items() if p.order == 0 and p.source.startswith("bias")), torch.zeros_like(some))
    if cfg.positional_embedding_type == "shortformer":
        constant = constant + state_dict["pos_embed.W_pos"][: tokens.shape[1]]
    parts = {
        "direct": norm.linear(direct),
        "composed": norm.linear(sum(composed)) if composed else torch.zeros_like(some),
    }
    q = {name: _project_linear(state_dict, cfg, layer, "Q", x) for name, x in parts.items()}
    k = {name: _project_linear(state_dict, cfg, layer, "K", x) for name, x in parts.items()}
    p = f"blocks.{layer}.attn"
    q["constant"], k["constant"] = project(state_dict, p, cfg, "Q", constant), project(state_dict, p, cfg, "K", constant)
    if cfg.positional_embedding_type == "rotary":
        q = {name: rotate(x, cfg, layer) for name, x in q.items()}
        k = {name: rotate(x, cfg, layer) for name, x in k.items()}

    def scores(a, b):
        return torch.einsum("bqhe,bkhe->bhqk", q[a], k[b])

    return {
        "direct": scores("direct", "direct"),
        "q_composition": scores("composed", "direct"),
        "k_composition": scores("direct", "composed"),
        "qk_composition": scores("composed", "composed"),
        "bias": scores("constant", "direct") + scores("constant", "composed") + scores("direct", "constant")
        + scores("composed", "constant") + scores("constant", "constant"),
    }


def _project_linear(state_dict: StateDict, cfg: Config, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
    """``x @ W_name`` per query head, no bias: ``[batch, pos, d_model]`` to ``[batch, pos, n_heads, d_head]``."""
    return torch.einsum("bpd,hde->bphe", x, layer_weight(state_dict, cfg, layer, name))
