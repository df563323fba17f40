"""Centering the weights that write to the residual stream, and centering the unembed."""

from __future__ import annotations

import torch

from .._compare import compute_dtype
from .._config import Config
from .._errors import Precondition
from .._moe import mixture_writers
from .._state import StateDict, validate_state_dict
from ._common import NO_LOGIT_SOFTCAP, PRE_NORM, require, rewrite
from ._memory import new_tensor, rows_per_block, scratch

__all__ = ["writers", "center_writing_weights", "center_unembed", "centered_last_axis", "CENTERING_NORM"]

CENTERING_NORM = Precondition(
    "every reader sits behind a centering norm",
    "the norm centers: normalization_type is LN or LNPre (not RMS, RMSPre or None)",
)


def writers(cfg: Config) -> list[str]:
    """Every tensor that writes to the residual stream; its last axis is ``d_model``.

    ``embed.W_E`` ``[d_vocab, d_model]``, ``pos_embed.W_pos`` ``[n_ctx, d_model]`` (standard
    positional embeddings only: a shortformer ``W_pos`` is added to the query and key inputs
    after ``ln1`` and never enters the stream), and per layer ``attn.W_O`` ``[n_heads, d_head,
    d_model]``, ``attn.b_O`` ``[d_model]``, ``mlp.W_out`` ``[d_mlp, d_model]`` and ``mlp.b_out``
    ``[d_model]``.
    """
    names = ["embed.W_E"] + (["pos_embed.W_pos"] if cfg.positional_embedding_type == "standard" else [])
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        names += [f"{p}.attn.W_O", f"{p}.attn.b_O"]
        if not cfg.attn_only:
            names += [f"{p}.mlp.W_out", f"{p}.mlp.b_out"] if cfg.n_experts is None else mixture_writers(cfg, f"{p}.mlp")
    return names


def require_pre_norm(identity: str, cfg: Config) -> None:
    """Refuse a post-norm model: there the sub-layers read the residual stream with no norm; and a
    pre-norm model whose embeddings pass through a norm (BLOOM) before the stream starts."""
    require(
        identity, PRE_NORM, cfg.norm_position == "pre",
        "the model is post-norm: attention and MLPs read the residual stream directly, not through"
        " a norm, so what is written to it is not only seen through a norm",
    )
    require(
        identity, PRE_NORM, not cfg.embedding_norm,
        "the token embeddings pass through a LayerNorm (embed.ln, BLOOM) before the first block: the"
        " stream starts at that norm's output, not at W_E; the LayerNorm fold folds it into W_E first",
    )


@rewrite
def center_writing_weights(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Subtract from every write to the residual stream its mean over ``d_model``.

    Each tensor of :func:`writers` becomes ``W - W.mean(-1, keepdim=True)``: every write ``w``
    becomes ``w C`` with ``C = I - 1 1^T / d_model``, so the residual stream ``x`` becomes ``x C``.
    Every reader sees the stream through ``LNPre``, and ``LNPre(x) = n(x C)`` depends on ``x``
    only through ``x C = (x C) C``, ``eps`` included: the model computes the same function.

    Needs a pre-norm model whose norms center (``normalization_type`` ``"LN"`` or ``"LNPre"``;
    ``LN`` is fine unfolded, it sees ``x`` only through ``LNPre(x)``). RMS norms, no norm and
    post-norm models are refused. A shortformer ``W_pos`` is not a write to the stream and is
    left unchanged (centering it would change the queries and keys). Records
    ``"center_writing_weights"``.

    >>> import torch
    >>> from circuitmath import Config, center_writing_weights, random_state_dict
    >>> from circuitmath.testing import assert_equivalent
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    >>> sd = random_state_dict(cfg, seed=0, dtype=torch.float64)
    >>> centered, centered_cfg = center_writing_weights(sd, cfg)
    >>> float(centered["blocks.0.attn.W_O"].mean(-1).abs().max()) < 1e-15
    True
    >>> _ = assert_equivalent(sd, centered, cfg, after_cfg=centered_cfg)
    """
    require_pre_norm(identity, cfg)
    require(
        identity, CENTERING_NORM, cfg.normalization_type in ("LN", "LNPre"),
        {
            "RMS": "normalization_type is 'RMS': RMSNorm does not center, RMS(x C) != RMS(x)",
            "RMSPre": "normalization_type is 'RMSPre': RMSNorm does not center, RMSPre(x C) != RMSPre(x)",
            None: "normalization_type is None: the readers see the residual stream itself, mean included",
        }.get(cfg.normalization_type, f"normalization_type is {cfg.normalization_type!r}"),
    )
    validate_state_dict(state_dict, cfg)
    out = dict(state_dict)
    for name in writers(cfg):
        out[name] = centered_last_axis(state_dict[name])
    return out, cfg


def centered_last_axis(
    W: torch.Tensor, *, sums: list | None = None, dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W - W.mean(-1, keepdim=True)`` for ``W: [..., n]``, as a new tensor of ``W``'s shape in
    ``dtype`` (default ``W``'s), or written into ``out`` (contiguous, that shape and dtype;
    ``W`` itself may be given).

    Large tensors (an embedding) are centered in blocks of rows
    (:func:`~circuitmath._processing._memory.rows_per_block`), so on the CPU each block's mean
    and difference are computed while the block is in cache: one read of ``W`` from memory
    instead of two. A half-precision block is computed in float32 and rounded once to
    ``dtype``. Given ``sums``, each block's sum is appended to it, taken in cache.
    """
    dtype = dtype or W.dtype
    compute = compute_dtype(W.dtype)
    rows = W.reshape(-1, W.shape[-1]) if W.dim() > 1 else W[None]
    # a half-precision input or output is computed a block at a time in one reused scratch
    staged = not compute == W.dtype == dtype
    per_block = rows_per_block(rows.shape[0], rows.shape[1] * rows.element_size(), W.device, staged=staged)
    out = new_tensor(rows.shape, dtype, W.device) if out is None else out.view(rows.shape)
    up = None if not staged else scratch(
        (min(per_block, rows.shape[0]), rows.shape[1]), compute, W.device)
    for start in range(0, rows.shape[0], per_block):
        block = rows[start : start + per_block]
        if up is not None:
            block = up[: block.shape[0]].copy_(block)
        if compute == dtype:
            torch.sub(block, block.mean(dim=-1, keepdim=True), out=out[start : start + per_block])
        else:  # block is the scratch
            out[start : start + per_block] = block.sub_(block.mean(dim=-1, keepdim=True))
        if sums is not None:
            sums.append(out[start : start + per_block].sum())
    return out.view(W.shape)


@rewrite
def center_unembed(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Subtract from ``W_U`` (``[d_model, d_vocab]``) and ``b_U`` (``[d_vocab]``) their means over the vocabulary.

    Every position's logits ``l`` become ``l - mean(l)``: each raw logit of a position shifts by
    the same constant, and ``log_softmax(l + c) = log_softmax(l)``, so the log-probabilities are
    unchanged (the raw logits are not: compare log-probs). Holds for every architecture that reads
    the logits straight into the softmax; refused under a logit softcap (Gemma 2), which is not
    shift-invariant. Records ``"center_unembed"``. Half precision is centered in
    float32 and rounded once (:func:`centered_last_axis`).
    """
    require(identity, NO_LOGIT_SOFTCAP, cfg.logit_softcap is None,
            f"the logits pass through the softcap {cfg.logit_softcap:g} * tanh(l / {cfg.logit_softcap:g}) before the"
            " softmax, and a shift of l is not a shift of the capped logits" if cfg.logit_softcap else "")
    validate_state_dict(state_dict, cfg)
    out = dict(state_dict)
    W_U, b_U = state_dict["unembed.W_U"], state_dict["unembed.b_U"]
    out["unembed.W_U"] = centered_last_axis(W_U)
    out["unembed.b_U"] = centered_last_axis(b_U)
    return out, cfg
