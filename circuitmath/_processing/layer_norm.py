"""LayerNorm folding and centring of reading weights."""

from __future__ import annotations

import torch

from .._config import Config
from .._state import StateDict, validate_state_dict
from ._common import common_preconditions, readers, require
from .shortformer import shortformer_to_tables

__all__ = ["fold_layer_norm", "center_reading_weights"]


def fold_layer_norm(
    state_dict: StateDict, cfg: Config, *, center_reading_weights: bool = False
) -> tuple[dict[str, torch.Tensor], Config]:
    """Fold every LayerNorm's gain ``w`` and bias ``b`` into the linear maps that read it.

    ``LN(x) @ W + b_W = LNPre(x) @ (w[:, None] * W) + (b_W + b @ W)`` for each reader: ``W_Q``,
    ``W_K``, ``W_V`` (``[n_heads, d_model, d_head]``), ``W_in`` (``[d_model, d_mlp]``) and
    ``W_U`` (``[d_model, d_vocab]``). ``eps`` stays inside ``LNPre``, so the fold is exact.
    The bias terms ``b @ W`` are accumulated in float64 and rounded once to the input dtype.
    The returned config has ``normalization_type="LNPre"`` and records ``"layer_norm_fold"``.
    A shortformer model first goes through :func:`shortformer_to_tables` (recorded too), since
    ``W_pos`` added after ``ln1`` must not be scaled by the gain.

    With ``center_reading_weights=True`` the result is then passed through
    :func:`center_reading_weights`.

    >>> import torch
    >>> from circuitmath import Config, fold_layer_norm, forward
    >>> from circuitmath import random_state_dict
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    >>> sd = random_state_dict(cfg, seed=0, dtype=torch.float64)
    >>> folded, folded_cfg = fold_layer_norm(sd, cfg)
    >>> folded_cfg.normalization_type, folded_cfg.applied
    ('LNPre', ('layer_norm_fold',))
    >>> tokens = torch.tensor([[1, 4, 2, 7]])
    >>> bool(torch.allclose(forward(sd, cfg, tokens), forward(folded, folded_cfg, tokens)))
    True
    """
    identity = "layer_norm_fold"
    require(
        identity, "normalization_type is LN", cfg.normalization_type == "LN",
        f"normalization_type is {cfg.normalization_type!r}; there is no LayerNorm gain and bias"
        + (" (RMSNorm gains fold by a different identity)" if cfg.normalization_type == "RMS" else ""),
    )
    if cfg.positional_embedding_type == "shortformer" and cfg.norm_position == "pre" and identity not in cfg.applied:
        state_dict, cfg = shortformer_to_tables(state_dict, cfg)
    common_preconditions(identity, cfg)
    validate_state_dict(state_dict, cfg)
    for norm, pairs in readers(cfg):
        for weight, bias in pairs:
            require(
                identity, "every reader has a bias to absorb b @ W",
                bias is not None or not torch.any(state_dict[f"{norm}.b"] @ state_dict[weight]),
                f"{weight} has no bias, so {norm}.b @ {weight} (nonzero) cannot be folded;"
                " its non-linearity sits right behind it",
            )
    out = dict(state_dict)
    for norm, pairs in readers(cfg):
        w, b = out.pop(f"{norm}.w"), out.pop(f"{norm}.b")
        for weight, bias in pairs:
            W = state_dict[weight]
            out[weight] = W * w[:, None]
            if bias is not None:
                out[bias] = (state_dict[bias].double() + _bias_through(b, W)).to(W.dtype)
    new_cfg = cfg.replace(normalization_type="LNPre", applied=cfg.applied + (identity,))
    return _center_reading(out, new_cfg, readers_are_fresh=True) if center_reading_weights else (out, new_cfg)


def _bias_through(b: torch.Tensor, W: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """``b @ W`` in float64 for ``b: [d_model]`` and ``W: [..., d_model, m]``.

    A float32 matrix-vector product accumulates all ``d_model`` terms in float32, and these
    biases feed every later layer. Here each block of ``rows`` terms is summed in ``W``'s dtype
    and the blocks in float64: no float64 copy of ``W`` is made, and the processed model's
    float32 error against the original drops (measured: by about a tenth).
    """
    return sum(
        torch.matmul(b[start : start + rows], W[..., start : start + rows, :]).double()
        for start in range(0, W.shape[-2], rows)
    )


def center_reading_weights(state_dict: StateDict, cfg: Config) -> tuple[dict[str, torch.Tensor], Config]:
    """Subtract from every reader its mean over the residual axis: ``W - 1 mean_d(W)``.

    Exact because every reader's input is ``LNPre(x)``, which is orthogonal to the all-ones
    vector. Needs ``normalization_type="LNPre"`` (fold the LayerNorm first). Records
    ``"center_reading_weights"``.
    """
    validate_state_dict(state_dict, cfg)
    return _center_reading(state_dict, cfg)


def _center_reading(
    state_dict: StateDict, cfg: Config, *, readers_are_fresh: bool = False
) -> tuple[dict[str, torch.Tensor], Config]:
    """``readers_are_fresh``: every reader of ``state_dict`` was just created by the fold and is
    owned by no one else, so it is centred in place instead of into a second copy."""
    identity = "center_reading_weights"
    common_preconditions(identity, cfg)
    require(
        identity, "readers see LNPre(x), which is orthogonal to 1", cfg.normalization_type == "LNPre",
        {
            "LN": "normalization_type is 'LN': LN(x) = LNPre(x) diag(w) + b is not orthogonal to 1;"
            " fold the LayerNorm first (layer_norm_fold)",
        }.get(
            cfg.normalization_type,
            f"normalization_type is {cfg.normalization_type!r}: the readers' input is not centred",
        ),
    )
    out = dict(state_dict)
    for _norm, pairs in readers(cfg):
        for weight, _bias in pairs:
            W = state_dict[weight]
            mean = W.mean(dim=-2, keepdim=True)
            out[weight] = W.sub_(mean) if readers_are_fresh else W - mean
    return out, cfg.replace(applied=cfg.applied + (identity,))
