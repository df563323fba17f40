"""Moving shortformer positional embeddings into per-layer query and key tables."""

from __future__ import annotations

import torch

from .._config import Config
from .._errors import Precondition
from .._state import StateDict, attention_names, validate_state_dict
from ._common import require, rewrite

__all__ = ["shortformer_to_tables", "IS_SHORTFORMER"]

IS_SHORTFORMER = Precondition(
    "positional_embedding_type is shortformer",
    "positional_embedding_type is shortformer (W_pos added to ln1's output, queries and keys only)",
)


@rewrite
def shortformer_to_tables(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Replace ``W_pos`` by each layer's positional query and key tables.

    A shortformer layer computes ``q = (ln1(x) + W_pos) @ W_Q + b_Q``, which is
    ``ln1(x) @ W_Q + b_Q + pos_Q`` with ``pos_Q = W_pos @ W_Q`` (``[n_ctx, heads, d_head]``);
    the same for keys, with the key heads of grouped-query attention. Values and MLPs never see
    positions. After this rewrite every norm's output is read only by linear maps, so the
    LayerNorm fold is exact. Returns ``positional_embedding_type="shortformer_tables"``,
    records ``"shortformer_to_tables"``; ``pos_embed.W_pos`` is dropped. The
    tables (``n_ctx`` rows each) are summed in float64 and rounded once to the weights' dtype.
    """
    require(
        identity, IS_SHORTFORMER, cfg.positional_embedding_type == "shortformer",
        f"positional_embedding_type is {cfg.positional_embedding_type!r}: W_pos is not added to the query"
        " and key inputs only",
    )
    validate_state_dict(state_dict, cfg)
    out = dict(state_dict)
    W_pos = out.pop("pos_embed.W_pos")
    W_pos_up = W_pos.double()  # its tables are small: summed in float64 and rounded once
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        for name in "QK":
            weight, _bias, _heads = attention_names(cfg, name)
            W = state_dict[f"{p}.{weight}"]
            out[f"{p}.pos_{name}"] = torch.einsum("pd,hde->phe", W_pos_up, W.double()).to(W.dtype)
    return out, cfg.replace(positional_embedding_type="shortformer_tables")
