"""Pure weight transforms: a state dict and config in, a new state dict and config out.

Every transform validates its input, refuses a model it cannot rewrite exactly (raising
:class:`PreconditionError` naming the identity and the broken precondition), keeps every dtype,
records itself in ``cfg.applied`` and refuses to run twice. Inputs are never mutated; tensors a
transform does not change are shared with the input, not copied.
"""

from __future__ import annotations

import torch

from ._config import Config
from ._errors import AlreadyAppliedError, PreconditionError
from ._state import StateDict, attention_names, validate_state_dict

__all__ = ["fold_layer_norm", "center_reading_weights", "readers"]


def readers(cfg: Config) -> list[tuple[str, list[tuple[str, str]]]]:
    """For each norm, the (weight, bias) pairs that read its output (bias ``None``: W_gate has none).

    Attention weights are ``[n_heads, d_model, d_head]``, MLP and unembed ``[d_model, out]``;
    in both the residual axis is the second to last.
    """
    out = []
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        names = [attention_names(cfg, n) for n in "QKV"]
        out.append((f"{p}.ln1", [(f"{p}.attn.{w}", f"{p}.attn.{b}") for w, b, _ in names]))
        if not cfg.attn_only:
            mlp = [(f"{p}.mlp.W_in", f"{p}.mlp.b_in")] + ([(f"{p}.mlp.W_gate", None)] if cfg.gated_mlp else [])
            out.append((f"{p}.ln2", mlp))
    out.append(("ln_final", [("unembed.W_U", "unembed.b_U")]))
    return out


def _require(identity: str, cfg: Config, precondition: str, holds: bool, detail: str) -> None:
    if not holds:
        raise PreconditionError(identity, precondition, detail)


def _common_preconditions(identity: str, cfg: Config) -> None:
    if identity in cfg.applied:
        raise AlreadyAppliedError(identity)
    _require(
        identity, cfg, "pre-norm", cfg.norm_position == "pre",
        "the model is post-norm: each norm's output is the residual stream itself, read again by"
        " the next norm (a non-linear reader), so there is no linear map to fold into",
    )
    _require(
        identity, cfg, "norm output read only by linear maps",
        cfg.positional_embedding_type != "shortformer" or cfg.n_layers == 0,
        "with shortformer embeddings W_pos is added to ln1's output before W_Q and W_K read it,"
        " so rewriting W_Q and W_K would rewrite W_pos's contribution too",
    )


def fold_layer_norm(
    state_dict: StateDict, cfg: Config, *, center_reading_weights: bool = False
) -> tuple[dict[str, torch.Tensor], Config]:
    """Fold every LayerNorm's gain ``w`` and bias ``b`` into the linear maps that read it.

    ``LN(x) @ W + b_W = LNPre(x) @ (w[:, None] * W) + (b_W + b @ W)`` for each reader: ``W_Q``,
    ``W_K``, ``W_V`` (``[n_heads, d_model, d_head]``), ``W_in`` (``[d_model, d_mlp]``) and
    ``W_U`` (``[d_model, d_vocab]``). ``eps`` stays inside ``LNPre``, so the fold is exact.
    The returned config has ``normalization_type="LNPre"`` and records ``"layer_norm_fold"``.

    With ``center_reading_weights=True`` the result is then passed through
    :func:`center_reading_weights`.

    >>> import torch
    >>> from circuitmath import Config, fold_layer_norm, forward
    >>> from circuitmath.strategies import random_state_dict
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
    _common_preconditions(identity, cfg)
    validate_state_dict(state_dict, cfg)
    _require(
        identity, cfg, "normalization_type is LN", cfg.normalization_type == "LN",
        f"normalization_type is {cfg.normalization_type!r}; there is no LayerNorm gain and bias"
        + (" (RMSNorm gains fold by a different identity)" if cfg.normalization_type == "RMS" else ""),
    )
    for norm, pairs in readers(cfg):
        for weight, bias in pairs:
            _require(
                identity, cfg, "every reader has a bias to absorb b @ W",
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
                out[bias] = state_dict[bias] + torch.matmul(b, W)
    new_cfg = cfg.replace(normalization_type="LNPre", applied=cfg.applied + (identity,))
    return _center_reading(out, new_cfg) if center_reading_weights else (out, new_cfg)


def center_reading_weights(state_dict: StateDict, cfg: Config) -> tuple[dict[str, torch.Tensor], Config]:
    """Subtract from every reader its mean over the residual axis: ``W - 1 mean_d(W)``.

    Exact because every reader's input is ``LNPre(x)``, which is orthogonal to the all-ones
    vector. Needs ``normalization_type="LNPre"`` (fold the LayerNorm first). Records
    ``"center_reading_weights"``.
    """
    validate_state_dict(state_dict, cfg)
    return _center_reading(state_dict, cfg)


def _center_reading(state_dict: StateDict, cfg: Config) -> tuple[dict[str, torch.Tensor], Config]:
    identity = "center_reading_weights"
    _common_preconditions(identity, cfg)
    _require(
        identity, cfg, "readers see LNPre(x), which is orthogonal to 1", cfg.normalization_type == "LNPre",
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
            out[weight] = W - W.mean(dim=-2, keepdim=True)
    return out, cfg.replace(applied=cfg.applied + (identity,))
