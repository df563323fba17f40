"""The reference forward pass: the function every weight transform must preserve.

Written for clarity, not speed. Row-vector convention: a residual stream ``x`` of shape
``[batch, pos, d_model]`` is read by ``x @ W``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ._config import Config
from ._errors import InputError
from ._moe import clamped_swiglu, mixture
from ._state import StateDict, attention_names, per_query_head, validate_state_dict

__all__ = ["forward", "log_probs", "normalize", "pattern_from_scores", "alibi_slopes", "embed", "block", "unembed"]


def normalize(x: torch.Tensor, kind, w: torch.Tensor | None, b: torch.Tensor | None, eps: float,
              center: Callable[[torch.Tensor], torch.Tensor] | None = None, offset: float = 0.0) -> torch.Tensor:
    """Apply the norm ``kind`` over the last axis of ``x`` (``[..., d_model]`` to ``[..., d_model]``).

    ``LNPre(x) = (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)``; ``LN`` then scales by ``w``
    and adds ``b``. ``RMSPre(x) = x / sqrt(mean(x^2) + eps)``; ``RMS`` then scales by ``w``.
    ``center``: computes ``x - mean(x)`` in place of the plain formula (see :data:`Centering`).
    ``offset``: the gain is ``offset + w`` (``Config.norm_gain_offset``; Gemma stores ``w`` and
    scales by ``1 + w``).
    """
    if kind is None:
        return x
    if kind in ("LN", "LNPre"):
        x = x - x.mean(dim=-1, keepdim=True) if center is None else center(x)
    x = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    if kind in ("LN", "RMS"):
        x = x * (w if offset == 0 else offset + w)
    if kind == "LN":
        x = x + b
    return x


#: ``centering(name, x)``: ``x - mean(x)`` over the last axis of the residual stream ``x``
#: ``[batch, pos, d_model]`` that the LayerNorm ``name`` (``"blocks.0.ln1"``, ``"ln_final"``, ...)
#: reads, computed as the caller chooses. :func:`embed`, :func:`block` and :func:`unembed` take
#: one for their LayerNorms: the rounding sensitivity
#: (:func:`~circuitmath.testing.rounding_sensitivity`) models the rounding of the mean with it.
Centering = Callable[[str, torch.Tensor], torch.Tensor]


def _norm(params: StateDict, prefix: str, cfg: Config, x: torch.Tensor, centering: Centering | None = None) -> torch.Tensor:
    center = None if centering is None else (lambda v: centering(prefix, v))
    return normalize(x, cfg.normalization_type, params.get(f"{prefix}.w"), params.get(f"{prefix}.b"), cfg.eps, center,
                     cfg.norm_gain_offset)


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "relu":
        return torch.relu(x)
    if name == "gelu":
        return torch.nn.functional.gelu(x)
    if name == "silu":
        return torch.nn.functional.silu(x)
    return torch.nn.functional.gelu(x, approximate="tanh")  # gelu_new (GPT-2)


def rotate(x: torch.Tensor, cfg: Config, layer: int | None = None) -> torch.Tensor:
    """Rotary embedding of ``x: [batch, pos, head, d_head]``: the first ``rotary_dim`` entries
    rotate in pairs ``(i, i + rotary_dim / 2)`` (GPT-NeoX layout), or ``(2i, 2i + 1)`` with
    ``cfg.rotary_interleaved`` (GPT-J), pair ``i`` by the angle ``pos * base^(-i / (rotary_dim / 2))``
    (``base``: layer ``layer``'s, :meth:`~circuitmath.Config.rotary_base_at`)."""
    rotary_dim = cfg.rotary_dim or cfg.d_head
    half = rotary_dim // 2
    positions = torch.arange(x.shape[1], dtype=torch.float64, device=x.device)
    freqs = cfg.rotary_base_at(layer) ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angles = positions[:, None] * freqs[None, :]
    cos = torch.cos(angles).to(x.dtype)[None, :, None, :]
    sin = torch.sin(angles).to(x.dtype)[None, :, None, :]
    if cfg.rotary_interleaved:
        x1, x2, rest = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2], x[..., rotary_dim:]
        pairs = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([pairs, rest], dim=-1)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def project(params: StateDict, p: str, cfg: Config, name: str, x: torch.Tensor) -> torch.Tensor:
    """``x @ W_name + b_name`` per head: ``[batch, pos, d_model]`` to ``[batch, pos, n_heads, d_head]``.

    Grouped-query keys and values are computed once per key/value head and shared by the
    ``n_heads // n_key_value_heads`` query heads of their group.
    """
    weight, bias, heads = attention_names(cfg, name)
    W = params[f"{p}.{weight}"]  # [heads, d_model, d_head]: one [d_model, heads d_head] product
    out = (x @ W.transpose(0, 1).flatten(1)).unflatten(-1, (W.shape[0], W.shape[2])) + params[f"{p}.{bias}"]
    if cfg.positional_embedding_type == "shortformer_tables" and name != "V":
        out = out + params[f"{p}.pos_{name}"][: x.shape[1]]
    return per_query_head(out, cfg, heads, dim=2)


def pattern_from_scores(scores: torch.Tensor, cfg: Config, layer: int | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The attention pattern from raw scores ``q k^T`` ``[..., query, key]``: scaled by
    ``1/sqrt(d_head)``, the future masked (causal models) and, in a layer with a sliding window
    (``cfg.window(layer)``), the keys ``sliding_window`` or more positions back; softmax over keys.
    ``cfg.attention_scale`` replaces ``1/sqrt(d_head)``; ``cfg.attn_softcap`` caps the scaled
    scores, ``cap * tanh(scores / cap)``, before the mask. With ALiBi positions (``"alibi"``)
    head ``h`` adds ``slope_h * k`` to its scaled score of key ``k``, computed in float32 and
    rounded to the scores' dtype as transformers' BLOOM does; ``scores`` then has its head axis
    before ``[query, key]``. ``sinks`` ``[n_heads]`` (scores ``[..., n_heads, query, key]``,
    ``Config.attn_sinks``): each head's softmax has that logit too, and its weight is dropped."""
    scores = scores / math.sqrt(cfg.d_head) if cfg.attention_scale is None else scores * cfg.attention_scale
    if cfg.positional_embedding_type == "alibi":  # [heads, 1, key] added to [..., heads, query, key]
        if scores.ndim < 3 or scores.shape[-3] != cfg.n_heads:
            raise ValueError(f"ALiBi scores need a head axis of {cfg.n_heads} before [query, key], got {tuple(scores.shape)}")
        keys = torch.arange(scores.shape[-1], dtype=torch.float32, device=scores.device)
        scores = scores + (alibi_slopes(cfg.n_heads, scores.device)[:, None, None] * keys).to(scores.dtype)
    if cfg.attn_softcap is not None:
        scores = _softcap(scores, cfg.attn_softcap)
    if cfg.causal:
        n = scores.shape[-1]
        future = torch.triu(torch.ones(n, n, dtype=torch.bool, device=scores.device), diagonal=1)
        window = cfg.window(layer)
        if window is not None:
            future |= torch.tril(torch.ones(n, n, dtype=torch.bool, device=scores.device), diagonal=-window)
        scores = scores.masked_fill(future, float("-inf"))
    if sinks is not None:
        sink = sinks[:, None, None].expand(*scores.shape[:-1], 1).to(scores.dtype)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.softmax(scores, dim=-1)


def alibi_slopes(n_heads: int, device=None) -> torch.Tensor:
    """ALiBi's slope of each head, ``[n_heads]`` float32, as BLOOM computes them: for the largest
    power of two ``n <= n_heads`` the slopes ``2^(-8 i / n)``, ``i = 1..n``, then for the heads
    beyond it every other slope of ``2n`` heads, ``2^(-8 i / 2n)`` for odd ``i``."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32, device=device)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32, device=device))
    if closest != n_heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32, device=device)
        odd = torch.arange(1, 1 + 2 * min(closest, n_heads - closest), 2, dtype=torch.int32, device=device)
        slopes = torch.cat([slopes, torch.pow(extra, odd)])
    return slopes


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``, as transformers computes it (Gemma 2's attention and logit softcaps)."""
    return torch.tanh(x / cap) * cap


def _head_norm(params: StateDict, name: str, cfg: Config, x: torch.Tensor) -> torch.Tensor:
    """The QK-norm ``name`` (``...attn.q_norm``) of ``x: [batch, pos, head, d_head]`` (one per
    query head), with gain ``offset + w``: an RMSNorm over each head's ``d_head`` entries, or with
    ``cfg.qk_norm_over="projection"`` one over all heads' entries together, each entry with its
    own gain (``w``: ``[heads, d_head]``; grouped keys repeat each key head, which leaves the mean
    square of the projection as it is)."""
    w = params[f"{name}.w"]
    if cfg.qk_norm_over == "head":
        return normalize(x, "RMS", w, None, cfg.eps, offset=cfg.norm_gain_offset)
    w = per_query_head(w, cfg, w.shape[0], dim=0)
    return normalize(x.flatten(-2), "RMS", w.flatten(), None, cfg.eps, offset=cfg.norm_gain_offset).unflatten(-1, x.shape[-2:])


def _attention(params: StateDict, p: str, cfg: Config, q_in, k_in, v_in, record: dict | None = None,
               layer: int | None = None) -> torch.Tensor:
    q, k, v = (project(params, p, cfg, n, x) for n, x in (("Q", q_in), ("K", k_in), ("V", v_in)))
    if cfg.qk_norm:
        q, k = _head_norm(params, f"{p}.q_norm", cfg, q), _head_norm(params, f"{p}.k_norm", cfg, k)
    if cfg.positional_embedding_type == "rotary":
        q, k = rotate(q, cfg, layer), rotate(k, cfg, layer)
    pattern = pattern_from_scores(torch.einsum("bqhe,bkhe->bhqk", q, k), cfg, layer, params.get(f"{p}.sinks"))
    z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
    if record is None:  # one [n_heads d_head, d_model] product
        return z.flatten(2) @ params[f"{p}.W_O"].flatten(0, 1) + params[f"{p}.b_O"]
    per_head = torch.einsum("bqhe,hed->bqhd", z, params[f"{p}.W_O"])
    record["patterns"].append(pattern)
    record["head_outputs"].append(per_head)
    return per_head.sum(dim=2) + params[f"{p}.b_O"]


def _mlp(params: StateDict, p: str, cfg: Config, x: torch.Tensor, record: dict | None = None) -> torch.Tensor:
    if cfg.n_experts is not None:
        return mixture(params, p, cfg, x, lambda expert, v: _dense_mlp(params, expert, cfg, v),
                       None if record is None else record["routing"])
    return _dense_mlp(params, p, cfg, x)


def _dense_mlp(params: StateDict, p: str, cfg: Config, x: torch.Tensor) -> torch.Tensor:
    """A dense MLP (or one expert); a gate bias ``b_gate`` where the model has one (experts)."""
    hidden = x @ params[f"{p}.W_in"] + params[f"{p}.b_in"]
    if cfg.gated_mlp:
        gate = x @ params[f"{p}.W_gate"]
        gate = gate + params[f"{p}.b_gate"] if f"{p}.b_gate" in params else gate
        hidden = _activation(cfg.act_fn, gate) * hidden if cfg.swiglu_limit is None else \
            clamped_swiglu(gate, hidden, cfg.swiglu_limit, cfg.swiglu_alpha)
    else:
        hidden = _activation(cfg.act_fn, hidden)
    return hidden @ params[f"{p}.W_out"] + params[f"{p}.b_out"]


def check_tokens(cfg: Config, tokens, device: torch.device | None = None) -> torch.Tensor:
    """``tokens`` as an integer tensor ``[batch, pos]`` (on ``device`` when given) with
    ``1 <= pos <= n_ctx`` and every id a token of the vocabulary (:class:`~circuitmath.InputError`
    saying which fails)."""
    if not isinstance(tokens, torch.Tensor):
        try:
            tokens = torch.as_tensor(tokens, device=device)
        except (TypeError, ValueError, RuntimeError) as error:
            raise InputError(f"tokens must be an integer tensor [batch, pos]: {error}") from None
    elif device is not None:
        tokens = tokens.to(device)
    if tokens.ndim != 2 or tokens.dtype not in (torch.int32, torch.int64):
        raise InputError(f"tokens must be an integer tensor [batch, pos], got {tokens.dtype} {tuple(tokens.shape)}")
    if not 1 <= tokens.shape[1] <= cfg.n_ctx:
        raise InputError(f"sequence length {tokens.shape[1]} is outside [1, n_ctx={cfg.n_ctx}]")
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= cfg.d_vocab):
        raise InputError(f"token ids must lie in [0, d_vocab={cfg.d_vocab})")
    return tokens


def forward(state_dict: StateDict, cfg: Config, tokens: torch.Tensor, *, record: dict | None = None) -> torch.Tensor:
    """Logits ``[batch, pos, d_vocab]`` for integer ``tokens: [batch, pos]``.

    Pre-norm block: ``x += attn(norm1(x)); x += mlp(norm2(x))`` (parallel: ``x += attn(norm1(x))
    + mlp(norm2(x))``; with ``post_norms`` each sub-layer's output is RMS-normed before it is added;
    without ``pre_norms``, ``norm1`` and ``norm2`` are the identity),
    then ``norm_final``, the unembed and the logit softcap. Post-norm block: ``x = norm1(x + attn(x)); x = norm2(x + mlp(x))``, no final norm;
    with ``embedding_norm`` the embeddings are normed (``embed.ln``) before the first block.
    With shortformer embeddings ``W_pos`` is added to the query and key inputs after ``ln1``
    and never enters the residual stream.

    ``record``, a dict, receives what analyses of the run need: ``"patterns"``, per layer the
    attention pattern ``[batch, n_heads, query, key]``; ``"head_outputs"``, per layer each head's
    write ``[batch, pos, n_heads, d_model]`` (without ``b_O``; they sum, with it, to the
    layer's output); ``"residuals"``, per layer of a pre-norm model the residual stream entering
    it ``[batch, pos, d_model]`` (what its first norm reads); ``"final_residual"``, the
    residual stream ``[batch, pos, d_model]`` after the last block (what a pre-norm model's
    final norm reads); and for a mixture-of-experts model ``"routing"``, per layer the weight of
    each expert at each position ``[batch, pos, n_experts]`` (zero for the experts not chosen).
    """
    validate_state_dict(state_dict, cfg)
    if record is not None:
        record.update(patterns=[], head_outputs=[], residuals=[], **({"routing": []} if cfg.n_experts else {}))
    tokens = check_tokens(cfg, tokens, state_dict["embed.W_E"].device)
    x, pos = embed(state_dict, cfg, tokens)
    for layer in range(cfg.n_layers):
        x = block(state_dict, layer, cfg, x, pos, record)
    if record is not None:
        record["final_residual"] = x
    return unembed(state_dict, cfg, x)


def embed(params: StateDict, cfg: Config, tokens: torch.Tensor, *,
          centering: Centering | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual stream before the first block, ``[batch, pos, d_model]``, and the positional
    embeddings ``[pos, d_model]`` a shortformer block adds to its query and key inputs (or ``None``).
    ``centering``: see :data:`Centering`."""
    positions = tokens.shape[1]
    x = params["embed.W_E"][tokens]
    if cfg.embedding_scale is not None:  # transformers rounds the multiplier to the model's dtype
        x = x * torch.tensor(cfg.embedding_scale, dtype=torch.float64, device=x.device).to(x.dtype)
    pos = params["pos_embed.W_pos"][:positions] if "pos_embed.W_pos" in params else None
    if cfg.positional_embedding_type == "standard":
        x = x + pos
    if cfg.embedding_norm:
        x = _norm(params, "embed.ln", cfg, x, centering)
    return x, pos


def block(params: StateDict, layer: int, cfg: Config, x: torch.Tensor, pos: torch.Tensor | None,
          record: dict | None = None, *, centering: Centering | None = None) -> torch.Tensor:
    """The residual stream ``[batch, pos, d_model]`` after block ``layer``; ``params`` needs only
    that block's tensors. ``centering``: see :data:`Centering`."""
    p = f"blocks.{layer}"
    if cfg.norm_position == "post":
        x = _norm(params, f"{p}.ln1", cfg, x + _attention(params, f"{p}.attn", cfg, x, x, x, record, layer), centering)
        if not cfg.attn_only:
            x = _norm(params, f"{p}.ln2", cfg, x + _mlp(params, f"{p}.mlp", cfg, x), centering)
        return x
    if record is not None:
        record["residuals"].append(x)
    normed = _norm(params, f"{p}.ln1", cfg, x, centering) if cfg.pre_norms else x
    qk_in = normed + pos if cfg.positional_embedding_type == "shortformer" else normed
    attn_out = _attention(params, f"{p}.attn", cfg, qk_in, qk_in, normed, record, layer)
    if cfg.parallel_attn_mlp:
        return x + attn_out + _mlp(params, f"{p}.mlp", cfg, _norm(params, f"{p}.ln2", cfg, x, centering))
    x = x + _post_norm(params, f"{p}.ln1_post", cfg, attn_out)
    if not cfg.attn_only:
        mlp_out = _mlp(params, f"{p}.mlp", cfg, _norm(params, f"{p}.ln2", cfg, x, centering) if cfg.pre_norms else x, record)
        x = x + _post_norm(params, f"{p}.ln2_post", cfg, mlp_out)
    return x


def _post_norm(params: StateDict, prefix: str, cfg: Config, out: torch.Tensor) -> torch.Tensor:
    """A sub-layer's output ``[batch, pos, d_model]`` through its sandwich RMSNorm (``cfg.post_norms``),
    with gain ``offset + w``; the output itself without one."""
    if not cfg.post_norms:
        return out
    return normalize(out, "RMS", params[f"{prefix}.w"], None, cfg.eps, offset=cfg.norm_gain_offset)


def unembed(params: StateDict, cfg: Config, x: torch.Tensor, *, centering: Centering | None = None) -> torch.Tensor:
    """Logits ``[batch, pos, d_vocab]`` from the residual stream after the last block.
    ``centering``: see :data:`Centering`."""
    if cfg.norm_position == "pre":
        x = _norm(params, "ln_final", cfg, x, centering)
    logits = x @ params["unembed.W_U"] + params["unembed.b_U"]
    if cfg.logit_scale is not None:
        logits = logits * cfg.logit_scale
    return logits if cfg.logit_softcap is None else _softcap(logits, cfg.logit_softcap)


def log_probs(state_dict: StateDict, cfg: Config, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` of :func:`forward` over the vocabulary: ``[batch, pos, d_vocab]``."""
    return torch.log_softmax(forward(state_dict, cfg, tokens), dim=-1)
