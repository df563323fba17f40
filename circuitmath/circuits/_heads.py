"""Per-head circuits read off the weights: OV and QK circuits, the full OV circuit, the bigram
table, virtual weights. Grouped-query keys and values are repeated to one per query head."""

from __future__ import annotations

import torch

from .._config import Config
from .._errors import InputError, Precondition
from .._processing._common import require
from .._state import StateDict, attention_names, per_query_head, validate_state_dict
from ._factored import FactoredMatrix, _t

__all__ = ["ov_circuits", "qk_circuits", "full_ov_circuits", "bigram_table", "virtual_weights",
           "HAS_ATTENTION", "ONE_QK_PER_HEAD"]

#: The preconditions the per-head circuits refuse a model by; the identities that use these
#: functions register the same objects.
HAS_ATTENTION = Precondition(
    "the model has attention layers", "the model has attention layers (any architecture the reference runs)"
)
ONE_QK_PER_HEAD = Precondition(
    "one QK matrix per head", "no rotary embedding: a head's score x_i W_QK x_j^T does not depend on the offset j - i"
)


#: The identity that composition scores and the QK circuits are checked by (its refusals name it).
SCORES_CHECKED_BY = "composition_scores_from_factors"

def _per_head(state_dict: StateDict, cfg: Config, name: str) -> torch.Tensor:
    """``W_name`` of every layer, one per query head: ``[n_layers, n_heads, d_model, d_head]``."""
    weight, _bias, heads = attention_names(cfg, name)
    stacked = torch.stack([state_dict[f"blocks.{l}.attn.{weight}"] for l in range(cfg.n_layers)])
    return per_query_head(stacked, cfg, heads, dim=1)


def layer_weight(state_dict: StateDict, cfg: Config, layer: int, name: str) -> torch.Tensor:
    """``W_name`` of one layer, one per query head: ``[n_heads, d_model, d_head]``."""
    weight, _bias, heads = attention_names(cfg, name)
    return per_query_head(state_dict[f"blocks.{layer}.attn.{weight}"], cfg, heads, dim=0)


def layer_bias(state_dict: StateDict, cfg: Config, layer: int, name: str) -> torch.Tensor:
    """``b_name`` of one layer, one per query head: ``[n_heads, d_head]``."""
    _weight, bias, heads = attention_names(cfg, name)
    return per_query_head(state_dict[f"blocks.{layer}.attn.{bias}"], cfg, heads, dim=0)


def _require_attention(cfg: Config, identity: str) -> None:
    require(identity, HAS_ATTENTION, cfg.n_layers != 0, "n_layers is 0")


def _require_position_free_scores(cfg: Config, identity: str) -> None:
    require(
        identity, ONE_QK_PER_HEAD, cfg.positional_embedding_type != "rotary",
        "with rotary embeddings the score of query i and key j is x_i W_Q R_(j-i) W_K^T x_j^T:"
        " it depends on the offset j - i, so there is no single W_QK",
    )


def ov_circuits(state_dict: StateDict, cfg: Config) -> FactoredMatrix:
    """Every head's ``W_OV = W_V @ W_O`` as a :class:`FactoredMatrix` ``[n_layers, n_heads, d_model, d_model]``.

    Factors ``W_V: [n_layers, n_heads, d_model, d_head]`` and ``W_O: [n_layers, n_heads,
    d_head, d_model]``. The paper's ``W_O W_V`` is its transpose (``.T``).
    """
    validate_state_dict(state_dict, cfg)
    _require_attention(cfg, "attention_head_tensor_form")
    W_O = torch.stack([state_dict[f"blocks.{l}.attn.W_O"] for l in range(cfg.n_layers)])
    return FactoredMatrix(_per_head(state_dict, cfg, "V"), W_O)


def qk_circuits(state_dict: StateDict, cfg: Config) -> FactoredMatrix:
    """Every head's ``W_QK = W_Q @ W_K^T`` as a :class:`FactoredMatrix` ``[n_layers, n_heads, d_model, d_model]``.

    The attention score of query ``x_i`` and key ``x_j`` (rows ``[d_model]``) is ``x_i W_QK
    x_j^T / sqrt(d_head)`` plus bias terms; the paper's ``W_Q^T W_K`` is the same matrix.
    Refused for rotary models, whose scores depend on the offset between positions.
    """
    validate_state_dict(state_dict, cfg)
    _require_attention(cfg, SCORES_CHECKED_BY)
    _require_position_free_scores(cfg, SCORES_CHECKED_BY)
    return FactoredMatrix(_per_head(state_dict, cfg, "Q"), _t(_per_head(state_dict, cfg, "K")))


def full_ov_circuits(state_dict: StateDict, cfg: Config) -> FactoredMatrix:
    """``W_E @ W_OV @ W_U`` per head, factored as ``(W_E W_V)(W_O W_U)``: ``[n_layers, n_heads, d_vocab, d_vocab]``.

    Row ``a`` holds the logits head ``(layer, head)`` adds when it attends to token ``a``
    (through this path alone, norms ignored). The paper's ``W_U W_OV W_E`` is its transpose.
    Inner size ``d_head``.
    """
    ov = ov_circuits(state_dict, cfg)
    return FactoredMatrix(state_dict["embed.W_E"] @ ov.left, ov.right @ state_dict["unembed.W_U"])


def bigram_table(state_dict: StateDict, cfg: Config) -> torch.Tensor:
    """``W_E @ W_U: [d_vocab, d_vocab]``, the zero-layer transformer ``T = (Id ⊗ W_U W_E)·t``.

    Row ``a`` is the logits a token ``a`` predicts through the direct path. Without a norm and
    positional embeddings a zero-layer model's logits are exactly ``bigram_table[tokens] + b_U``
    (identity ``zero_layer_bigram``).
    """
    validate_state_dict(state_dict, cfg)
    return state_dict["embed.W_E"] @ state_dict["unembed.W_U"]


def virtual_weights(writer: torch.Tensor, reader: torch.Tensor) -> torch.Tensor:
    """The virtual weights ``writer @ reader`` between a layer that writes to the residual stream
    and a later one that reads it (the paper's ``W_I^B W_O^A``, transposed).

    ``writer: [*w, a, d_model]`` (``W_O: [n_heads, d_head, d_model]``, ``W_out``, ``W_E``) and
    ``reader: [*r, d_model, b]`` (``W_Q``, ``W_K``, ``W_V: [n_heads, d_model, d_head]``,
    ``W_in``, ``W_U``); every batch of one meets every batch of the other:
    returns ``[*w, *r, a, b]``. The reader sees ``x @ reader`` where ``x`` is the sum of all
    earlier writes, so a write ``r @ writer`` reaches it as ``r @ virtual_weights(writer, reader)``
    (identity ``virtual_weights``).
    """
    if writer.shape[-1] != reader.shape[-2]:
        raise InputError(
            f"the writer's output axis ({writer.shape[-1]}) is not the reader's input axis"
            f" ({reader.shape[-2]}): pass W_O-like [..., a, d_model] and W_V-like [..., d_model, b]"
        )
    w_batch, r_batch = writer.shape[:-2], reader.shape[:-2]
    w = writer.reshape(*w_batch, *([1] * len(r_batch)), *writer.shape[-2:])
    return w @ reader
