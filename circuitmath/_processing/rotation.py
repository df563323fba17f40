"""Symmetries of the residual stream and of the heads and neurons: rotations and permutations.

Three pure transforms and their recognition:

- :func:`rotate_residual_stream`: every writer ``W -> W Q``, every reader ``W -> Q^T W``
  (``Q`` orthogonal, ``[d_model, d_model]``), the function unchanged when every norm is
  ``RMSPre`` (or there is none), or ``LNPre`` with ``Q 1 = 1`` or ``Q 1 = -1``;
- :func:`permute_heads` and :func:`permute_neurons`: the heads of a layer, the neurons of an MLP,
  in another order;
- :func:`recover_rotation`, :func:`recover_head_permutation`, :func:`recover_neuron_permutation`:
  given a model and a processed model, the ``Q`` or the permutation that maps one onto the other,
  verified on every tensor, or ``None``.

Rotating or permuting twice is legitimate: two rotations compose into the rotation ``Q_1 Q_2``,
two permutations into a permutation. So none of these transforms refuses a second application;
each records itself in ``cfg.applied`` once per application.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._config import Config
from .._errors import Precondition, PreconditionError
from .._state import StateDict, attention_names, validate_state_dict
from ._orthogonal import (
    BlockOrthogonal,
    hadamard,
    orthogonal_fixing_ones,
    orthogonality_error,
    random_orthogonal,
)
from ._common import readers, require, require_dense_mlp, require_even_post_norms, rewrite
from .centering import center_writing_weights, require_pre_norm, writers
from .layer_norm import fold_layer_norm
from .norms import fold_rms_norm, layer_norm_to_rms_norm

__all__ = [
    "rotate_residual_stream", "permute_heads", "permute_neurons", "residual_writers", "residual_readers",
    "orthogonality_error", "rotated_tensors", "rotation_mismatches", "recover_rotation",
    "recover_head_permutation", "recover_neuron_permutation", "ORTHOGONALITY_SAFETY", "random_orthogonal",
    "hadamard", "orthogonal_fixing_ones", "procrustes", "NO_NORM_GAIN", "Q_SQUARE", "Q_ORTHOGONAL", "Q_FIXES_ONES",
    "A_HEAD_PERMUTATION", "GROUPS_MOVE_TOGETHER", "HAS_MLPS", "A_NEURON_PERMUTATION",
]

NO_NORM_GAIN = Precondition(
    "no norm gain or bias between the stream and its readers",
    "every norm is RMSPre, LNPre or none: a gain diag(w) or a bias does not commute with Q (fold it first)",
)
Q_SQUARE = Precondition("Q is a floating [d_model, d_model] tensor")
Q_ORTHOGONAL = Precondition("Q is orthogonal", "Q is orthogonal to the precision of the weights (of Q, where Q is given more precisely)")
Q_FIXES_ONES = Precondition(
    "Q maps the all-ones direction to itself (Q 1 = 1 or Q 1 = -1)",
    "Q 1 = 1 or Q 1 = -1: centering commutes with an orthogonal Q exactly then",
)
A_HEAD_PERMUTATION = Precondition("a permutation of the heads", "a permutation of 0..n_heads-1, per layer or for all")
HEADS_SEE_POSITIONS_ALIKE = Precondition(
    "every head sees positions alike",
    "no ALiBi: its slope belongs to the head's index, so a head moved to another index would get another slope",
)
GROUPS_MOVE_TOGETHER = Precondition(
    "each group of query heads moves with its key/value head",
    "with grouped-query attention, a query head stays with its key/value head",
)
HAS_MLPS = Precondition("the model has MLPs")
A_NEURON_PERMUTATION = Precondition("a permutation of the neurons", "a permutation of 0..d_mlp-1, per layer or for all")

#: ``Q`` counts as orthogonal for a model in ``dtype`` when ``max |Q^T Q - I|`` is at most
#: ``ORTHOGONALITY_SAFETY * d_model * eps(dtype)``: what computing an orthogonal matrix in that
#: precision leaves. ``torch.linalg.qr`` of Gaussian matrices, 3 seeds, float32 and float64:
#: at most ``1.25 * d * eps`` for ``d = 2``, ``0.25`` at 8, below ``0.1`` from 64 to 1024
#: (tests/test_rotation.py keeps the measurement).
ORTHOGONALITY_SAFETY = 4.0

#: Rotated tensors are compared with the tensors a rotation by ``Q`` gives, entry by entry, up to
#: ``RECOGNITION_SAFETY * d_model * eps(dtype) * M`` with ``M`` the tensor's largest entry.
RECOGNITION_SAFETY = 32.0


def residual_writers(cfg: Config) -> list[str]:
    """Tensors whose last axis is a vector of the residual stream, written to it or added to
    the normed stream: :func:`~circuitmath._processing.centering.writers`, and a shortformer
    ``pos_embed.W_pos`` (added to ``ln1``'s output, which a rotation rotates too)."""
    extra = ["pos_embed.W_pos"] if cfg.positional_embedding_type == "shortformer" else []
    return writers(cfg) + extra


def residual_readers(cfg: Config) -> list[str]:
    """Weights that read the residual stream (through a norm or, without pre-norms, as it is);
    their second to last axis is ``d_model``."""
    return [weight for _norm, pairs in readers(cfg, unnormed=True) for weight, _bias in pairs]


def rotated_tensors(state_dict: StateDict, cfg: Config, Q: "torch.Tensor | BlockOrthogonal") -> dict[str, torch.Tensor]:
    """The rotated tensors (writers ``W Q``, readers ``Q^T W``), computed in float64 and rounded
    once to each tensor's dtype; nothing is checked."""
    if isinstance(Q, BlockOrthogonal):
        out = {name: Q.times(state_dict[name]).to(state_dict[name].dtype) for name in residual_writers(cfg)}
        return out | {name: Q.transposed_times(state_dict[name]).to(state_dict[name].dtype) for name in residual_readers(cfg)}
    out = {}
    for name in residual_writers(cfg):
        W = state_dict[name]
        out[name] = (W.double() @ Q.to(device=W.device, dtype=torch.float64)).to(W.dtype)
    for name in residual_readers(cfg):
        W = state_dict[name]
        out[name] = (Q.to(device=W.device, dtype=torch.float64).T @ W.double()).to(W.dtype)
    return out


def _as_square(identity: str, Q, d_model: int) -> "torch.Tensor | BlockOrthogonal":
    if not isinstance(Q, (torch.Tensor, BlockOrthogonal)) or not Q.dtype.is_floating_point:
        raise PreconditionError(identity, Q_SQUARE,
                                f"got {type(Q).__name__}" + (f" of dtype {Q.dtype}" if isinstance(Q, torch.Tensor) else ""))
    if tuple(Q.shape) != (d_model, d_model):
        raise PreconditionError(identity, Q_SQUARE,
                                f"Q has shape {tuple(Q.shape)}, d_model is {d_model}")
    if isinstance(Q, torch.Tensor) and not bool(torch.isfinite(Q).all()):
        raise PreconditionError(identity, Q_SQUARE, "Q has NaN or Inf entries")
    return Q


@rewrite(composes=True, records=False)
def rotate_residual_stream(
    state_dict: StateDict, cfg: Config, Q: torch.Tensor, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Rotate the basis of the residual stream by the orthogonal ``Q`` (``[d_model, d_model]``).

    Every tensor that writes a vector of the stream is multiplied by ``Q`` on the right
    (``embed.W_E``, a standard ``pos_embed.W_pos``, ``attn.W_O``, ``attn.b_O``, ``mlp.W_out``,
    ``mlp.b_out``) and every weight that reads a norm's output by ``Q^T`` on the left (``W_Q``,
    ``W_K``, ``W_V`` ``[heads, d_model, d_head]``, ``W_in``, ``W_gate``, ``W_U``); the readers'
    biases are unchanged. The stream ``x`` becomes ``x Q`` everywhere, and ``RMSPre(x Q) =
    RMSPre(x) Q`` because ``|x Q| = |x|``: ``RMSPre(x Q) Q^T W = RMSPre(x) W``.

    Norms: ``RMSPre`` and no norm are rotated for any orthogonal ``Q``; ``LNPre`` only when
    ``Q 1 = ±1`` (identity ``layer_norm_rotation``): the centering ``C = I - 1 1^T / d``
    commutes with an orthogonal ``Q`` exactly then (``Q = -I`` is one). A norm with a gain (``LN``,
    ``RMS``) is refused: ``diag(w)`` does not commute with ``Q``; the SliceGPT route is
    :func:`fold_layer_norm`, :func:`center_writing_weights`, :func:`layer_norm_to_rms_norm`, then
    this (or :func:`fold_rms_norm`, then this). Post-norm models are refused. Grouped-query
    keys and values, the gate of a gated MLP and parallel attention and MLP are rotated like any
    reader; rotary embeddings and ``"shortformer_tables"`` act inside the heads, unchanged; a
    shortformer ``W_pos``, added to ``ln1``'s output before ``W_Q`` and ``W_K``, is rotated with it.

    :func:`random_orthogonal` and :func:`hadamard` make such a ``Q``, :func:`orthogonal_fixing_ones`
    one for an ``LNPre`` model; the numeric checks pass a structured one that is cheaper to apply
    (:class:`~circuitmath._processing._orthogonal.BlockOrthogonal`). ``Q`` must be orthogonal to the precision of the model: ``max |Q^T Q - I| <=``
    :data:`ORTHOGONALITY_SAFETY` ``* d_model * eps(dtype)`` (a float32 ``Q`` does not rotate a
    float64 model exactly; orthogonalise it in float64). Computed in float64, rounded once to the
    model's dtype; every tensor keeps its dtype and device; tensors not rotated are shared with
    the input. Rotating twice is rotating once by ``Q_1 Q_2``, exact too: a second application is
    not refused, and ``cfg.applied`` records the identity once per rotation.

    >>> import torch
    >>> from circuitmath import Config, random_state_dict, rotate_residual_stream
    >>> from circuitmath.testing import assert_equivalent
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16,
    ...              normalization_type="RMSPre")
    >>> sd = random_state_dict(cfg, seed=0, dtype=torch.float64)
    >>> Q = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    >>> rotated, rotated_cfg = rotate_residual_stream(sd, cfg, Q)
    >>> rotated_cfg.applied
    ('rotate_residual_stream',)
    >>> _ = assert_equivalent(sd, rotated, cfg, after_cfg=rotated_cfg)
    """
    require_pre_norm(identity, cfg)
    _require_no_norm_gain(identity, cfg)
    dtype = validate_state_dict(state_dict, cfg)
    require_even_post_norms(identity, state_dict, cfg)
    Q = _as_square(identity, Q, cfg.d_model)
    tolerance = _require_orthogonal(identity, Q, dtype, cfg.d_model)
    if cfg.normalization_type == "LNPre":
        identity = "layer_norm_rotation"
        _require_fixing_ones(identity, Q, tolerance)
    out = dict(state_dict)
    out.update(rotated_tensors(state_dict, cfg, Q))
    return out, cfg.replace(applied=cfg.applied + (identity,))


def _require_no_norm_gain(identity: str, cfg: Config) -> None:
    """Refuse a norm with a gain (``LN``, ``RMS``), which does not commute with a rotation."""
    kind = cfg.normalization_type
    require(
        identity, NO_NORM_GAIN, kind not in ("LN", "RMS"),
        {
            "LN": "normalization_type is 'LN': its gain diag(w) and bias do not commute with Q; fold it"
                  f" ({fold_layer_norm.identity}), center the writes ({center_writing_weights.identity}) and switch"
                  f" to RMSNorm ({layer_norm_to_rms_norm.identity}) first: the SliceGPT route",
            "RMS": "normalization_type is 'RMS': its gain diag(w) does not commute with Q; fold it first"
                   f" ({fold_rms_norm.identity})",
        }.get(kind, ""),
    )


def _require_orthogonal(identity: str, Q: torch.Tensor, dtype: torch.dtype, d_model: int) -> float:
    """Refuse a ``Q`` that is not orthogonal to the precision of a ``dtype`` model; returns that tolerance."""
    # the weights' precision, or Q's where Q is given more precisely: a float64 Q for a bfloat16
    # model is held to float64's (d_model eps of bfloat16 would let 1.2 I through)
    precision = min(torch.finfo(dtype).eps, torch.finfo(Q.dtype).eps)
    tolerance = ORTHOGONALITY_SAFETY * d_model * precision
    error = orthogonality_error(Q)
    require(
        identity, Q_ORTHOGONAL, error <= tolerance,
        f"max |Q^T Q - I| is {error:.3g}, above {tolerance:.3g} for a {str(Q.dtype).removeprefix('torch.')} Q and a"
        f" {str(dtype).removeprefix('torch.')} model with d_model {d_model}: the norms see |x Q| != |x|"
        + (" (orthogonalise Q in the model's precision, e.g. torch.linalg.qr in float64)" if error < 1e-3 else ""),
    )
    return tolerance


def _require_fixing_ones(identity: str, Q: torch.Tensor, tolerance: float) -> None:
    """Refuse, for an ``LNPre`` model, a ``Q`` that maps the all-ones vector to neither 1 nor -1."""
    ones = torch.ones(Q.shape[0], dtype=torch.float64, device=getattr(Q, "device", "cpu"))
    image = Q.image_of_ones() if isinstance(Q, BlockOrthogonal) else Q.double() @ ones
    plus, minus = float((image - ones).abs().max()), float((image + ones).abs().max())
    require(
        identity, Q_FIXES_ONES, min(plus, minus) <= tolerance * math.sqrt(Q.shape[0]),
        f"normalization_type is 'LNPre' and Q 1 is neither 1 nor -1 (max |Q 1 - 1| is {plus:.3g},"
        f" max |Q 1 + 1| is {minus:.3g}): LNPre centers, and centering commutes with an orthogonal Q"
        " exactly when Q 1 = 1 or Q 1 = -1. Center the writes and switch to RMSNorm first"
        f" ({center_writing_weights.identity}, {layer_norm_to_rms_norm.identity})",
    )


# -- permutations -----------------------------------------------------------------------------


def _per_layer(identity: str, permutation, n_layers: int, size: int, what: str, precondition: Precondition) -> torch.Tensor:
    """``permutation`` (``[size]`` for every layer, or ``[n_layers, size]``) as ``[n_layers, size]`` longs."""
    try:
        perm = permutation if isinstance(permutation, torch.Tensor) else torch.as_tensor(permutation, device="cpu")
    except (TypeError, ValueError, RuntimeError) as error:
        raise PreconditionError(identity, precondition, f"cannot read {permutation!r}: {error}") from None
    if perm.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        raise PreconditionError(identity, precondition, f"expected integers, got dtype {perm.dtype}")
    perm = perm.to(device="cpu", dtype=torch.long)
    if perm.ndim == 1:
        perm = perm.expand(n_layers, -1)
    if tuple(perm.shape) != (n_layers, size):
        raise PreconditionError(
            identity, precondition,
            f"expected shape [{size}] or [{n_layers}, {size}], got {list(perm.shape)}",
        )
    expected = torch.arange(size, device="cpu")
    for layer in range(n_layers):
        if not torch.equal(perm[layer].sort().values, expected):
            raise PreconditionError(
                identity, precondition,
                f"layer {layer}: {perm[layer].tolist()} does not list each of 0..{size - 1} once",
            )
    return perm


def _take(tensor: torch.Tensor, index: torch.Tensor, axis: int) -> torch.Tensor:
    return tensor.index_select(axis, index.to(tensor.device))


def _key_value_permutation(cfg: Config, perm: torch.Tensor, layer: int) -> torch.Tensor:
    """The permutation of the key/value heads that ``perm`` (of the query heads) implies, or a
    :class:`PreconditionError` when it splits a group."""
    kv_heads = attention_names(cfg, "K")[2]
    size = cfg.n_heads // kv_heads
    groups = (perm // size).reshape(kv_heads, size)
    if not bool((groups == groups[:, :1]).all()):
        raise PreconditionError(
            permute_heads.identity, GROUPS_MOVE_TOGETHER,
            f"layer {layer}: the permutation {perm.tolist()} mixes query heads of different groups"
            f" (groups of {size}); a query head must stay with the keys and values it shares",
        )
    return groups[:, 0].contiguous()


@rewrite(composes=True, check_output=False)
def permute_heads(
    state_dict: StateDict, cfg: Config, permutation, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Reorder the heads of every attention layer: new head ``i`` is old head ``permutation[i]``.

    ``permutation`` is ``[n_heads]`` (the same for every layer) or ``[n_layers, n_heads]``. A
    layer's output is the sum of its heads plus ``b_O``, and a sum does not depend on the order
    of its terms; each head keeps its own ``W_Q, W_K, W_V, W_O``, biases and sink (``[heads, ...]``,
    axis 0) and positional tables (``pos_Q``, ``pos_K``, ``[n_ctx, heads, d_head]``, axis 1), so
    its pattern moves with it. With grouped-query attention a query head must stay in the group
    of the key/value head it reads: the permutation must move whole groups (reordering heads
    inside a group is fine), and the key/value heads follow their groups; any other permutation
    is refused. Rotary embeddings rotate every head alike and are unaffected; ALiBi gives each
    head index its own slope, so under ALiBi a permutation that moves a head is refused. A QK-norm
    over the whole projection (``cfg.qk_norm_over="projection"``) divides by a root mean square
    that no order of the heads changes, and its gains ``[heads, d_head]`` move with their heads.

    Data movement only: every entry is copied exactly; dtype and device are kept. Permuting twice
    is permuting once by the composition, so a second application is not refused; each records
    ``"permute_heads"``.
    """
    validate_state_dict(state_dict, cfg)
    perms = _per_layer(identity, permutation, cfg.n_layers, cfg.n_heads, "heads", A_HEAD_PERMUTATION)
    moved = [layer for layer in range(cfg.n_layers) if cfg.positional_embedding_type == "alibi"
             and not torch.equal(perms[layer].cpu(), torch.arange(cfg.n_heads))]
    require(identity, HEADS_SEE_POSITIONS_ALIKE, not moved,
            f"ALiBi positions (BLOOM): each head's slope is fixed by its index, and the permutation moves heads of layers {moved}")
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        perm = perms[layer]
        kv_perm = _key_value_permutation(cfg, perm, layer)
        for side in "QKV":
            weight, bias, heads = attention_names(cfg, side)
            index = perm if heads == cfg.n_heads else kv_perm
            out[f"{p}.{weight}"] = _take(state_dict[f"{p}.{weight}"], index, 0)
            out[f"{p}.{bias}"] = _take(state_dict[f"{p}.{bias}"], index, 0)
            if f"{p}.pos_{side}" in state_dict:
                out[f"{p}.pos_{side}"] = _take(state_dict[f"{p}.pos_{side}"], index, 1)
        for name in ["W_O"] + (["sinks"] if cfg.attn_sinks else []):
            out[f"{p}.{name}"] = _take(state_dict[f"{p}.{name}"], perm, 0)
        if cfg.qk_norm and cfg.qk_norm_over == "projection":  # a gain per entry: it moves with its head
            out[f"{p}.q_norm.w"] = _take(state_dict[f"{p}.q_norm.w"], perm, 0)
            out[f"{p}.k_norm.w"] = _take(state_dict[f"{p}.k_norm.w"], kv_perm, 0)
    return out, cfg


@rewrite(composes=True, check_output=False)
def permute_neurons(
    state_dict: StateDict, cfg: Config, permutation, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Reorder the neurons of every MLP: new neuron ``i`` is old neuron ``permutation[i]``.

    ``permutation`` is ``[d_mlp]`` (every layer) or ``[n_layers, d_mlp]``. ``W_in`` and
    ``W_gate`` (``[d_model, d_mlp]``) have their columns permuted, ``b_in`` (``[d_mlp]``) its
    entries and ``W_out`` (``[d_mlp, d_model]``) its rows: ``f(x W_in P + b_in P) P^T W_out =
    f(x W_in + b_in) W_out`` because every activation here (and the gate's product) acts entry by
    entry, so it commutes with a permutation ``P`` of the entries. Attention-only models have no
    neurons and are refused. Data movement only; dtype and device are kept. A second application
    is a permutation too and is not refused; each records ``"permute_neurons"``.
    """
    require(identity, HAS_MLPS, not cfg.attn_only, "the model is attention-only: there are no neurons to permute")
    require_dense_mlp(identity, cfg)
    validate_state_dict(state_dict, cfg)
    perms = _per_layer(identity, permutation, cfg.n_layers, cfg.d_mlp, "neurons", A_NEURON_PERMUTATION)
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        p, perm = f"blocks.{layer}.mlp", perms[layer]
        out[f"{p}.W_in"] = _take(state_dict[f"{p}.W_in"], perm, 1)
        out[f"{p}.b_in"] = _take(state_dict[f"{p}.b_in"], perm, 0)
        if cfg.gated_mlp:
            out[f"{p}.W_gate"] = _take(state_dict[f"{p}.W_gate"], perm, 1)
        out[f"{p}.W_out"] = _take(state_dict[f"{p}.W_out"], perm, 0)
    return out, cfg


# -- recognition ------------------------------------------------------------------------------


def _same_layout(before: StateDict, after: StateDict) -> bool:
    return before.keys() == after.keys() and all(
        isinstance(after[k], torch.Tensor) and after[k].shape == before[k].shape and after[k].dtype == before[k].dtype
        for k in before
    )


def rotation_mismatches(before: StateDict, after: StateDict, cfg: Config, Q: torch.Tensor) -> dict[str, float]:
    """The tensors of ``after`` that are not those of ``before`` rotated by ``Q``.

    Maps each such name to its largest entrywise difference divided by the allowed one,
    :data:`RECOGNITION_SAFETY` ``* d_model * eps(dtype) * M`` (``M`` the largest entry of the
    expected tensor, at least 1). Tensors a rotation leaves alone (biases of readers, norms'
    parameters, positional tables) must be unchanged to the same tolerance. Empty when ``after``
    is ``before`` rotated by ``Q`` to rounding. ``Q`` is ``[d_model, d_model]``; ``before`` and
    ``after`` have the same keys. Where :func:`recover_rotation` finds no rotation, this names
    the tensors that are not the one meant.

    >>> import torch
    >>> from circuitmath import Config, random_state_dict
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, normalization_type="RMSPre")
    >>> before, Q = random_state_dict(cfg, seed=0, dtype=torch.float64), random_orthogonal(8, seed=0)
    >>> after, _cfg = rotate_residual_stream(before, cfg, Q)
    >>> rotation_mismatches(before, after, cfg, Q)
    {}
    >>> after["blocks.0.attn.W_O"] = before["blocks.0.attn.W_O"]  # forget one writer
    >>> list(rotation_mismatches(before, after, cfg, Q))
    ['blocks.0.attn.W_O']
    """
    expected = dict(before)
    expected.update(rotated_tensors(before, cfg, Q))
    out = {}
    for name, want in expected.items():
        got = after[name]
        eps = torch.finfo(want.dtype).eps
        allowed = RECOGNITION_SAFETY * cfg.d_model * eps * max(1.0, float(want.double().abs().max()) if want.numel() else 1.0)
        diff = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
        if not diff <= allowed:
            out[name] = diff / allowed
    return out


def recover_rotation(before: StateDict, after: StateDict, cfg: Config) -> torch.Tensor | None:
    """The orthogonal ``Q`` (float64, ``[d_model, d_model]``) with ``after`` = ``before`` rotated
    by ``Q`` (see :func:`rotate_residual_stream`), or ``None`` when there is none.

    Orthogonal Procrustes: ``Q`` minimises ``|A Q - B|`` over orthogonal matrices, with ``A`` the
    rows of every writer of ``before`` (``W_E`` first; a writer's rows are vectors of the stream)
    and of every reader's transpose, and ``B`` the same rows of ``after``; ``Q = U V^T`` for
    ``A^T B = U S V^T``. Then every tensor is verified (:func:`rotation_mismatches`). Whether the
    rotation is exact for this model's norms is not judged here: ``rotate_residual_stream(before,
    cfg, Q)`` refuses it when it is not. ``before`` and ``after`` must share names, shapes and
    dtypes (``None`` otherwise).
    """
    if not _same_layout(before, after):
        return None
    Q = procrustes(before, after, cfg)
    return None if rotation_mismatches(before, after, cfg, Q) else Q


def procrustes(before: StateDict, after: StateDict, cfg: Config, names: Sequence[str] | None = None) -> torch.Tensor:
    """The orthogonal ``Q`` (float64, on the CPU) that best maps ``before``'s writer rows and
    reader columns onto ``after``'s (orthogonal Procrustes, see :func:`recover_rotation`), not
    verified: :func:`rotation_mismatches` names the tensors it does not explain. ``names``: only
    these writers and readers (e.g. ``["embed.W_E"]``, which the usual processing before a
    rotation leaves as it is once the writes are centered). Directions no tensor has a component
    along (the all-ones direction of a centered model) are mapped arbitrarily: no tensor depends on them."""
    rows_before, rows_after, readers = [], [], residual_readers(cfg)
    for name in residual_writers(cfg) if names is None else [n for n in names if n not in readers]:
        rows_before.append(before[name].double().reshape(-1, cfg.d_model).cpu())
        rows_after.append(after[name].double().reshape(-1, cfg.d_model).cpu())
    for name in readers if names is None else [n for n in names if n in readers]:
        rows_before.append(before[name].double().transpose(-1, -2).reshape(-1, cfg.d_model).cpu())
        rows_after.append(after[name].double().transpose(-1, -2).reshape(-1, cfg.d_model).cpu())
    U, _S, Vh = torch.linalg.svd(torch.cat(rows_before).T @ torch.cat(rows_after))
    return U @ Vh


def _signatures(tensors: Sequence[torch.Tensor], axes: Sequence[int], count: int) -> list[bytes]:
    """For each index ``i < count``: the bytes of every tensor's slice ``i`` along its axis."""
    slices = [t.movedim(axis, 0).reshape(count, -1).cpu().contiguous() for t, axis in zip(tensors, axes)]
    return [b"".join(s[i].numpy().tobytes() if s.dtype != torch.bfloat16 else s[i].view(torch.int16).numpy().tobytes()
                     for s in slices) for i in range(count)]


def _match(before: list[bytes], after: list[bytes]) -> torch.Tensor | None:
    """``perm`` with ``after[i] == before[perm[i]]`` for every ``i``, each index used once, or ``None``."""
    where: dict[bytes, list[int]] = {}
    for j, key in enumerate(before):
        where.setdefault(key, []).append(j)
    perm = []
    for key in after:
        free = where.get(key)
        if not free:
            return None
        perm.append(free.pop(0))
    return torch.tensor(perm, dtype=torch.long, device="cpu")


def _verified(before: StateDict, expected: StateDict, after: StateDict, verify_all: bool) -> bool:
    """``after`` equals ``expected`` exactly: on every tensor, or (``verify_all=False``) on those
    the permutation moved (the rest may have been rewritten by another step)."""
    return all(torch.equal(expected[k], after[k]) for k in before if verify_all or expected[k] is not before[k])


def recover_head_permutation(
    before: StateDict, after: StateDict, cfg: Config, *, verify_all: bool = True
) -> torch.Tensor | None:
    """``[n_layers, n_heads]``: the permutation with ``after = permute_heads(before, cfg, perm)``
    (exactly: a permutation copies entries), or ``None`` when there is none.

    Each head of ``after`` is matched to the head of ``before`` with the same bytes in ``W_Q``,
    ``b_Q``, ``W_O`` (and ``pos_Q``), then the result is verified on every tensor, keys and
    values included (``verify_all=False``: only the tensors it moves). The identity permutation
    is returned when nothing moved.
    """
    if not _same_layout(before, after):
        return None

    def matched(layer):
        p = f"blocks.{layer}.attn"
        return [(f"{p}.W_Q", 0), (f"{p}.b_Q", 0), (f"{p}.W_O", 0)] + ([(f"{p}.pos_Q", 1)] if f"{p}.pos_Q" in before else [])

    return _recover_permutation(before, after, cfg, cfg.n_heads, matched, permute_heads, verify_all)


def recover_neuron_permutation(
    before: StateDict, after: StateDict, cfg: Config, *, verify_all: bool = True
) -> torch.Tensor | None:
    """``[n_layers, d_mlp]``: the permutation with ``after = permute_neurons(before, cfg, perm)``,
    or ``None`` (no dense MLPs, or no such permutation). Neurons are matched by the bytes of their
    ``W_in`` column, ``b_in`` entry, ``W_gate`` column and ``W_out`` row; every tensor is then
    verified (``verify_all=False``: only the tensors it moves)."""
    if cfg.attn_only or cfg.n_experts is not None or not _same_layout(before, after):
        return None

    def matched(layer):
        p = f"blocks.{layer}.mlp"
        return [(f"{p}.W_in", 1), (f"{p}.b_in", 0), (f"{p}.W_out", 0)] + ([(f"{p}.W_gate", 1)] if cfg.gated_mlp else [])

    return _recover_permutation(before, after, cfg, cfg.d_mlp, matched, permute_neurons, verify_all)


def _recover_permutation(before, after, cfg, size, matched, permute, verify_all) -> torch.Tensor | None:
    """Per layer, the permutation of ``size`` units that maps the units of ``before`` to those of
    ``after`` with the same bytes in the tensors ``matched(layer)`` lists (``(name, unit axis)``),
    verified by applying ``permute``; ``None`` when there is none."""
    perms = []
    for layer in range(cfg.n_layers):
        names = matched(layer)
        axes = [axis for _name, axis in names]
        signatures = [_signatures([sd[name] for name, _axis in names], axes, size) for sd in (before, after)]
        perm = _match(*signatures)
        if perm is None:
            return None
        perms.append(perm)
    perms = torch.stack(perms) if perms else torch.zeros(0, size, dtype=torch.long, device="cpu")
    try:
        expected, _cfg = permute(before, cfg, perms)
    except PreconditionError:
        return None
    return perms if _verified(before, expected, after, verify_all) else None
