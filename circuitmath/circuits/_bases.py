"""The change of basis inside attention heads, written once.

``W_Q N, W_K N^{-T}, W_V M, M^{-1} W_O`` (biases alike) leaves every head's scores and output
unchanged (identity ``refactor_factored_attn_matrices``). The identities' numeric checks and
wrong rewrites, the tests and the book all change bases through :func:`change_head_bases` or the
private :func:`change_bases` under it.
"""

from __future__ import annotations

import torch

from .._config import Config
from .._errors import InputError
from .._processing._common import NOT_ROTARY, require
from .._processing._rotary import rotary_generator
from .._processing.attention import refactor_factored_attn_matrices
from .._state import StateDict, attention_names, validate_state_dict

__all__ = ["change_head_bases"]


def _commutes_with_rotary(N: torch.Tensor, cfg: Config) -> bool:
    """Whether every ``N`` ``[..., d_head, d_head]`` (float64) commutes with the rotary embedding's
    generator (:func:`~circuitmath._processing._rotary.rotary_generator`), to float64's rounding
    of ``N``'s size."""
    if not N.numel():  # no layers: nothing to change
        return True
    J = rotary_generator(cfg).to(N.device)
    scale = max(float(N.abs().max()) * float(J.abs().max()), 1e-300)
    return float((N @ J - J @ N).abs().max()) <= 64 * cfg.d_head * torch.finfo(torch.float64).eps * scale


def change_bases(
    state_dict: StateDict, cfg: Config, *, query=None, key=None, value=None, output=None
) -> dict[str, torch.Tensor]:
    """Multiply each head's factors by per-head matrices, computed in float64, returned in the
    input dtype: ``W_Q, b_Q, pos_Q -> (.) query``, ``W_K, b_K, pos_K -> (.) key``,
    ``W_V, b_V -> (.) value``, ``W_O -> output W_O``.

    Each matrix argument is ``[n_layers, kv_heads, d_head, d_head]`` (``kv_heads``:
    ``n_key_value_heads`` or ``n_heads``), one per key/value head and shared by the query heads
    of its group; ``None`` leaves that factor as it is. Nothing is checked: a wrong pairing
    (``key`` not ``query^{-T}``) is how the wrong rewrites are built.
    """
    out = dict(state_dict)
    group = cfg.n_heads // attention_names(cfg, "K")[2]
    for side, matrices in (("Q", query), ("K", key), ("V", value), ("O", output)):
        if matrices is None:
            continue
        matrices = matrices.double()
        for layer in range(cfg.n_layers):
            p = f"blocks.{layer}.attn"
            per_head = matrices[layer]
            if side in "QO" and group != 1:  # query heads (and W_O's rows) share their group's matrix
                per_head = per_head.repeat_interleave(group, dim=0)
            if side == "O":
                names = ((f"{p}.W_O", 0, "left"),)
            else:
                weight, bias, _heads = attention_names(cfg, side)
                names = ((f"{p}.{weight}", 0, "right"), (f"{p}.{bias}", 0, "right"))
                if side != "V":
                    names += ((f"{p}.pos_{side}", 1, "right"),)
            for name, head_axis, where in names:
                if name not in state_dict:
                    continue
                tensor = state_dict[name].double().movedim(head_axis, 0)  # heads first
                if where == "left":  # W_O [heads, d_head, d_model]
                    changed = per_head @ tensor
                elif tensor.dim() == 2:  # a bias [heads, d_head]
                    changed = (tensor[:, None] @ per_head)[:, 0]
                else:  # a weight [heads, d_model, d_head] or a table [heads, n_ctx, d_head]
                    changed = tensor @ per_head
                out[name] = changed.movedim(0, head_axis).to(state_dict[name].dtype)
    return out


def change_head_bases(
    state_dict: StateDict, cfg: Config, *, query_key: torch.Tensor | None = None, value: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The same model with new bases inside its heads: ``W_Q N``, ``W_K N^{-T}``, ``W_V M``, ``M^{-1} W_O``.

    ``query_key`` (``N``) and ``value`` (``M``) are invertible ``[n_layers, kv_heads, d_head,
    d_head]`` matrices, one per key/value head (``kv_heads`` is ``n_key_value_heads`` or
    ``n_heads``) and shared by the query heads of its group; ``None`` leaves that side as it is.
    Biases change with their weights, and the positional query and key tables of a
    ``"shortformer_tables"`` model with the biases. Every head's scores ``q k^T`` and output
    ``A v W_O`` stay the same (identity ``refactor_factored_attn_matrices``, which picks ``N``
    and ``M`` from an SVD); this function takes any. Not a processing step: nothing is recorded
    in ``cfg.applied``. Computed in float64, returned in the input dtype.

    On a rotary model ``N`` must commute with the rotation by position between ``W_Q`` and
    ``W_K``: each rotary pair (``(i, i + rotary_dim / 2)``, or ``(2i, 2i + 1)`` interleaved)
    scaled and turned within itself (``[[a, b], [-b, a]]``), the dimensions past ``rotary_dim``
    mapped among themselves by any invertible block (identity ``rotate_rotary_pairs``). Any other
    ``N`` is refused (:class:`~circuitmath.PreconditionError`).

    >>> import torch, circuitmath as cm
    >>> cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=None)
    >>> sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    >>> M = 3.0 * torch.eye(4, dtype=torch.float64).expand(1, 2, 4, 4)
    >>> out = change_head_bases(sd, cfg, value=M)
    >>> bool(torch.allclose(out["blocks.0.attn.W_V"] @ out["blocks.0.attn.W_O"], sd["blocks.0.attn.W_V"] @ sd["blocks.0.attn.W_O"]))
    True
    """
    validate_state_dict(state_dict, cfg)
    shape = (cfg.n_layers, attention_names(cfg, "K")[2], cfg.d_head, cfg.d_head)
    device = state_dict["embed.W_E"].device
    for name, matrices in (("query_key", query_key), ("value", value)):
        if matrices is not None and (not isinstance(matrices, torch.Tensor) or tuple(matrices.shape) != shape):
            got = tuple(matrices.shape) if isinstance(matrices, torch.Tensor) else type(matrices).__name__
            raise InputError(f"change_head_bases: {name} must be a tensor of shape {list(shape)}, got {got}")
        if matrices is not None and matrices.device != device:
            raise InputError(f"change_head_bases: {name} is on {matrices.device}, the weights on {device}")
    changes = {}
    if query_key is not None:
        N = query_key.double()
        require(
            refactor_factored_attn_matrices.identity, NOT_ROTARY,
            cfg.positional_embedding_type != "rotary" or _commutes_with_rotary(N, cfg),
            "positional_embedding_type is 'rotary': a rotation by position sits between W_Q and W_K,"
            " and N does not commute with it (it must scale and turn each rotary pair within itself and"
            " map the dimensions past rotary_dim among themselves)",
        )
        changes |= {"query": N, "key": torch.linalg.inv(N).transpose(-1, -2)}
    if value is not None:
        M = value.double()
        changes |= {"value": M, "output": torch.linalg.inv(M)}
    return change_bases(state_dict, cfg, **changes)
