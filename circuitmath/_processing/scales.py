"""Folding a model's constant multipliers into its weights: the embedding scale and the logit scale."""

from __future__ import annotations

import torch

from .._config import Config
from .._errors import Precondition
from .._state import StateDict, validate_state_dict
from ._common import require, rewrite
from ._memory import new_tensor, rows_per_block

__all__ = [
    "fold_embedding_scale", "fold_logit_scale", "embedding_multiplier", "EMBEDDING_SCALED", "LOGIT_SCALED",
]

EMBEDDING_SCALED = Precondition(
    "the token embeddings are scaled",
    "the forward pass multiplies the token embeddings by a number (embedding_scale is set, Gemma's sqrt(d_model))",
)
LOGIT_SCALED = Precondition(
    "the logits are scaled",
    "the forward pass multiplies the logits by a number before any softcap (logit_scale is set, Cohere)",
)


def embedding_multiplier(cfg: Config, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The number the forward pass multiplies the token embeddings by, as a 0-d tensor of ``dtype``:
    ``cfg.embedding_scale`` rounded to the model's dtype, as ``transformers`` rounds it
    (``sqrt(3072) = 55.43`` is ``55.5`` in bfloat16)."""
    return torch.tensor(cfg.embedding_scale, dtype=torch.float64, device=device).to(dtype)


@rewrite
def fold_embedding_scale(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Multiply ``W_E`` ``[d_vocab, d_model]`` by the embedding scale and drop the scale.

    The forward pass of a model with ``embedding_scale`` (Gemma's ``sqrt(d_model)``) computes
    ``W_E[t] * s`` for each token ``t``; here ``W_E`` becomes ``W_E * s`` and the returned config
    has ``embedding_scale=None`` (no multiplier), so each embedded token is the same vector.

    What exact means in every dtype: ``s`` is the multiplier the forward pass uses, the scale
    rounded to ``W_E``'s dtype first (:func:`embedding_multiplier`, as ``transformers`` does:
    in bfloat16 ``sqrt(3072)`` is ``55.5``, not ``55.43``), and each entry is the product the
    forward pass computes, ``W_E[i, j] * s`` rounded once to that dtype. The folded model's
    embeddings are therefore the unfolded model's bit for bit, in float32, float16 and bfloat16
    alike. Folding the unrounded ``sqrt(d_model)`` instead changes a bfloat16 model.

    A model whose unembedding is tied to the embedding (``W_U = W_E^T``: Gemma) comes back
    untied: ``W_U`` keeps the unscaled matrix (scaling it too would scale the logits by ``s``),
    so a checkpoint layout that stores one matrix for both cannot hold the result.
    ``cfg.applied`` records ``"fold_embedding_scale"``; a second application is refused (the
    scale is gone, and folding it again would scale the embeddings by ``s^2``).
    Needs ``cfg.embedding_scale`` to be set.

    >>> import torch
    >>> from circuitmath import Config, fold_embedding_scale, log_probs, random_state_dict
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16,
    ...              embedding_scale=8 ** 0.5)
    >>> sd = random_state_dict(cfg, seed=0, dtype=torch.bfloat16)
    >>> folded, folded_cfg = fold_embedding_scale(sd, cfg)
    >>> folded_cfg.embedding_scale, folded_cfg.applied
    (None, ('fold_embedding_scale',))
    >>> tokens = torch.tensor([[1, 4, 2, 7]])
    >>> bool(torch.equal(log_probs(sd, cfg, tokens), log_probs(folded, folded_cfg, tokens)))
    True
    """
    require(identity, EMBEDDING_SCALED, cfg.embedding_scale is not None,
            "embedding_scale is None: the token embeddings reach the residual stream as they are, there is no"
            " multiplier to fold")
    validate_state_dict(state_dict, cfg)
    W_E = state_dict["embed.W_E"]
    out = dict(state_dict)
    out["embed.W_E"] = W_E * embedding_multiplier(cfg, W_E.dtype, W_E.device)
    return out, cfg.replace(embedding_scale=None)


@rewrite
def fold_logit_scale(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Multiply ``W_U`` ``[d_model, d_vocab]`` and ``b_U`` ``[d_vocab]`` by the logit scale and drop the scale.

    A model with ``logit_scale`` (Cohere) computes ``(y W_U + b_U) * s`` before any softcap;
    ``y (s W_U) + s b_U`` is the same, so the returned config has ``logit_scale=None``. A logit
    softcap acts on the scaled logits afterwards and is left as it is. Each entry is the product
    with the float64 ``s`` rounded once to the weights' dtype; the logits agree within the
    rounding of the products (the multiplication moves from the logits to the weights).
    ``cfg.applied`` records ``"fold_logit_scale"``; a second application is refused (it would
    scale the logits by ``s^2``). Needs ``cfg.logit_scale`` to be set.
    """
    require(identity, LOGIT_SCALED, cfg.logit_scale is not None,
            "logit_scale is None: the logits are not multiplied by a number, there is none to fold")
    validate_state_dict(state_dict, cfg)
    out = dict(state_dict)
    for name in ("unembed.W_U", "unembed.b_U"):
        out[name] = scaled(state_dict[name], cfg.logit_scale)
    return out, cfg.replace(logit_scale=None)


def scaled(W: torch.Tensor, s: float) -> torch.Tensor:
    """``s * W`` for ``W: [..., n]``, each entry the float64 product rounded once to ``W``'s
    dtype, a block of rows at a time (no float64 copy of a large unembedding)."""
    rows = W.reshape(-1, W.shape[-1]) if W.dim() > 1 else W[None]
    out = new_tensor(rows.shape, W.dtype, W.device)
    per_block = rows_per_block(rows.shape[0], rows.shape[1] * 8, W.device, staged=True)
    for start in range(0, rows.shape[0], per_block):
        out[start : start + per_block] = rows[start : start + per_block].double() * s
    return out.view(W.shape)
