"""RMSNorm folding, LayerNorm to RMSNorm once every write is centered, and rescaling the stream."""

from __future__ import annotations

import math

import torch

from .._config import Config
from .._errors import InputError, Precondition
from .._state import StateDict, Validated, validate_state_dict
from ._common import NO_POST_NORMS, readers, require, rewrite
from .centering import center_writing_weights, require_pre_norm, writers
from .layer_norm import fold_layer_norm, reader_preconditions

__all__ = ["fold_rms_norm", "layer_norm_to_rms_norm", "rescale_residual_stream", "uncentered_writers", "writer_means",
           "writer_scale", "IS_RMS",
           "IS_LNPRE", "WRITES_CENTERED", "SCALE_POSITIVE", "BEHIND_A_NORM", "EPS_ZERO"]

IS_RMS = Precondition("normalization_type is RMS")
IS_LNPRE = Precondition("normalization_type is LNPre", "normalization_type LNPre (fold a LayerNorm first)")
WRITES_CENTERED = Precondition(
    "every write to the residual stream is centered",
    "every write to the residual stream is centered (checked on the weights, to rounding)",
)
SCALE_POSITIVE = Precondition("scale > 0")
BEHIND_A_NORM = Precondition("every reader sits behind a norm", "every reader behind a norm (LN, LNPre, RMS or RMSPre)")
EPS_ZERO = Precondition("eps == 0")


@rewrite
def fold_rms_norm(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Fold every RMSNorm gain ``w`` into the linear maps that read it: ``W -> w[:, None] * W``.

    ``RMS(x) @ W = RMSPre(x) @ (w[:, None] * W)`` for each reader: ``W_Q``, ``W_K``, ``W_V``
    (``[n_heads, d_model, d_head]``), ``W_in`` and, in a gated MLP, ``W_gate`` (``[d_model,
    d_mlp]``), and ``W_U`` (``[d_model, d_vocab]``). An RMSNorm has no bias, so no reader's bias
    changes and ``W_gate`` needs none (a gain stored as ``w`` and applied as ``1 + w``,
    ``cfg.norm_gain_offset = 1``, folds as ``1 + w``, added in float64); nothing is centered (``RMSPre(x)`` is not orthogonal to the
    all-ones vector). ``eps`` stays inside ``RMSPre``. Returns ``normalization_type="RMSPre"``
    and records ``"fold_rms_norm"``.

    >>> import torch
    >>> from circuitmath import Config, fold_rms_norm, random_state_dict
    >>> from circuitmath.testing import assert_equivalent
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16,
    ...              normalization_type="RMS", gated_mlp=True, act_fn="relu")
    >>> sd = random_state_dict(cfg, seed=0, dtype=torch.float64)
    >>> folded, folded_cfg = fold_rms_norm(sd, cfg)
    >>> folded_cfg.normalization_type, "blocks.0.ln2.w" in folded
    ('RMSPre', False)
    >>> _ = assert_equivalent(sd, folded, cfg, after_cfg=folded_cfg)
    """
    reader_preconditions(identity, cfg)
    require(
        identity, IS_RMS, cfg.normalization_type == "RMS",
        f"normalization_type is {cfg.normalization_type!r}; there is no RMSNorm gain to fold"
        + (f" (LayerNorm folds by {fold_layer_norm.identity})" if cfg.normalization_type == "LN" else ""),
    )
    validate_state_dict(state_dict, cfg)
    out = dict(state_dict)
    for norm, pairs in readers(cfg):
        w = out.pop(f"{norm}.w")
        for weight, _bias in pairs:
            out[weight] = _scaled(state_dict[weight], w, cfg.norm_gain_offset)
    return out, cfg.replace(normalization_type="RMSPre")


def _scaled(W: torch.Tensor, w: torch.Tensor, offset: float) -> torch.Tensor:
    """``(offset + w)[:, None] * W`` (``W: [..., d_model, m]``, ``w: [d_model]``) rounded once to
    ``W``'s dtype: a gain stored as ``w`` and applied as ``1 + w`` (Gemma) is added in float64, as
    rounding ``1 + w`` to a half precision first would lose the bits of ``w`` below ``1``'s."""
    if offset == 0:
        return W * w[:, None]
    return (W.double() * (offset + w.double())[:, None]).to(W.dtype)


def uncentered_writers(state_dict: StateDict, cfg: Config) -> dict[str, float]:
    """The writers (see :func:`~circuitmath._processing.centering.writers`) whose mean over ``d_model`` is not zero.

    Maps each such tensor's name to its largest ``|mean over d_model|``. A mean counts as zero
    when it is at most ``d_model * eps(dtype) * M``, with ``M`` the largest ``|entry|`` of any
    writer: what centering leaves from rounding, measured against the scale of the residual
    stream (a small bias with a large common offset keeps a rounding error of the offset's size,
    so its own size is no yardstick).

    A part of a model cut into parts (a :class:`~circuitmath._state.Validated` with ``writers``,
    made by ``circuitmath._streaming_check_model``) is decided on ``writers(means, M)``: the whole
    model's writers, named as in the whole model, as the whole model is decided in memory.
    """
    means, scale = writer_means(state_dict, cfg), writer_scale(state_dict, cfg)
    given = state_dict.writers if isinstance(state_dict, Validated) else None
    means, scale = (means, scale) if given is None else given(means, scale)
    return {name: mean for name, (mean, eps) in means.items() if mean > cfg.d_model * eps * scale}


def writer_means(state_dict: StateDict, cfg: Config) -> dict[str, tuple[float, float]]:
    """Each writer's largest ``|mean over d_model|`` and its dtype's ``eps``, as
    :func:`uncentered_writers` measures them, in the order of ``writers(cfg)``."""
    return {name: (float(state_dict[name].double().mean(dim=-1).abs().max()),
                   torch.finfo(state_dict[name].dtype).eps) for name in writers(cfg)}


def writer_scale(state_dict: StateDict, cfg: Config) -> float:
    """``M`` of :func:`uncentered_writers`: the largest ``|entry|`` of any writer of ``state_dict``.
    A model cut into parts has as ``M`` the largest of its parts' (a part's stand-ins are zeros)."""
    return max(float(state_dict[name].double().abs().max()) for name in writers(cfg))


@rewrite
def layer_norm_to_rms_norm(
    state_dict: StateDict, cfg: Config, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Replace every ``LNPre`` by ``RMSPre`` (same ``eps``) in a model whose writes are all centered.

    When every write to the residual stream has mean zero over ``d_model`` the stream ``x``
    satisfies ``x C = x`` (``C = I - 1 1^T / d_model``), so ``LNPre(x) = n(x C) = n(x) =
    RMSPre(x)``. The weights are unchanged; only ``normalization_type`` becomes ``"RMSPre"``.
    Records ``"layer_norm_to_rms_norm"``.

    Centering is verified on the weights themselves, not read from ``cfg.applied``: a model
    centered elsewhere qualifies, and one whose writes a later rewrite un-centered does not. Each
    writer's mean must be zero up to rounding (see :func:`uncentered_writers`); run
    :func:`~circuitmath.center_writing_weights` first. Needs a pre-norm ``LNPre`` model (fold a
    LayerNorm's gain and bias first: an RMSNorm has no bias).
    """
    require_pre_norm(identity, cfg)
    require(
        identity, IS_LNPRE, cfg.normalization_type == "LNPre",
        f"normalization_type is {cfg.normalization_type!r}"
        + (f"; fold the LayerNorm's gain and bias first ({fold_layer_norm.identity})"
           if cfg.normalization_type == "LN" else ": there is no LayerNorm to replace"),
    )
    validate_state_dict(state_dict, cfg)
    uncentered = uncentered_writers(state_dict, cfg)
    worst = max(uncentered, key=uncentered.get, default=None)
    require(
        identity, WRITES_CENTERED, not uncentered,
        f"{len(uncentered)} writer(s) have a nonzero mean over d_model, largest |mean| {uncentered.get(worst, 0):.3g}"
        f" in {worst}; center them first ({center_writing_weights.identity})",
    )
    return dict(state_dict), cfg.replace(normalization_type="RMSPre")


@rewrite
def rescale_residual_stream(
    state_dict: StateDict, cfg: Config, *, scale: float, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Multiply every write to the residual stream by ``scale > 0``; exact only when ``eps == 0``.

    The stream ``x`` becomes ``scale * x``. Every norm (``LN``, ``LNPre``, ``RMS``, ``RMSPre``)
    divides by the root mean square of its (centered) input, which is invariant to a positive
    scale exactly when ``eps = 0``: with ``eps > 0``, ``LNPre(s x) != LNPre(x)``, so such models
    are refused. The writers are those of :func:`~circuitmath.center_writing_weights`. Needs a
    pre-norm model with a norm. Records ``"rescale_residual_stream"``.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise InputError(f"scale must be a finite number, got {scale!r}")
    require(
        identity, SCALE_POSITIVE, scale > 0,
        f"scale is {scale!r}: the norms are odd, LNPre(-x) = -LNPre(x), so a sign flip reaches every reader",
    )
    require_pre_norm(identity, cfg)
    require(
        identity, BEHIND_A_NORM, cfg.normalization_type is not None,
        "normalization_type is None: the readers see the residual stream's scale",
    )
    require(
        identity, NO_POST_NORMS, not cfg.post_norms,
        "each sub-layer writes through a sandwich norm of its own, which undoes a scale of W_O, b_O, W_out, b_out"
        " but not of the embeddings" if cfg.post_norms else "",
    )
    require(
        identity, EPS_ZERO, cfg.eps == 0,
        f"eps is {cfg.eps!r}: LNPre(s x) = s x C / sqrt(s^2 |x C|^2 / d + eps) differs from LNPre(x)"
        " unless eps = 0",
    )
    validate_state_dict(state_dict, cfg)
    out = dict(state_dict)
    for name in writers(cfg):
        out[name] = state_dict[name] * scale
    return out, cfg
