"""The rewrites quantisation pipelines make before they quantise: scale migration across a norm,
rotations inside the heads.

:func:`migrate_norm_scales` moves a per-channel scale ``s`` (``[d_model]``, one per norm) out of
a norm's gain and into the input rows of every map that reads that norm (SmoothQuant's
migration): ``w -> w / s``, ``b -> b / s`` (LayerNorm), ``W -> diag(s) W`` for ``W_Q``, ``W_K``,
``W_V``, ``W_in``, ``W_gate`` (and ``W_U`` behind ``ln_final``). :func:`recover_norm_scales`
finds the ``s`` that maps one model onto another, for the diagnosis. :func:`rotate_heads`
rotates each head's value/output space (``W_V R``, ``R^T W_O``) and query/key space (``W_Q R``,
``W_K R``, ``R`` commuting with a rotary embedding); :func:`recover_head_rotations` finds them.
:func:`scale_neurons` scales each neuron's input by ``s`` and its output by ``1 / s`` through a
gated MLP's product or a ReLU (cross-layer equalisation); :func:`recover_neuron_scales` finds ``s``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .._config import Config
from .._errors import Precondition, PreconditionError
from .._state import StateDict, attention_names, key_value_groups, validate_state_dict
from ._common import NO_QK_NORM, qk_normed, readers, require, require_dense_mlp, rewrite
from .layer_norm import reader_preconditions
from ._rotary import rotary_generator, rotary_pairs
from .rotation import HAS_MLPS, ORTHOGONALITY_SAFETY

__all__ = ["migrate_norm_scales", "recover_norm_scales", "rotate_heads", "recover_head_rotations", "nearest_commuting",
           "scale_neurons", "scaled_neurons", "recover_neuron_scales", "NEURON_SCALES", "SCALE_REACHES_OUTPUT_LINEARLY",
           "HAS_A_NORM", "SCALES_PER_CHANNEL", "GAINS_AS_STORED", "HEAD_ROTATIONS", "COMMUTES_WITH_ROTARY"]

HAS_A_NORM = Precondition(
    "every reader sits behind a norm whose gain can take 1/s",
    "normalization_type is LN, LNPre, RMS or RMSPre: the gain (1 for LNPre and RMSPre) divides by s",
)
SCALES_PER_CHANNEL = Precondition(
    "a finite nonzero scale per channel",
    "s maps norms of the model to finite, nonzero floating [d_model] tensors",
)
GAINS_AS_STORED = Precondition(
    "norm gains applied as stored",
    "each norm applies its stored gain w, not 1 + w (Gemma's gains, Config.norm_gain_offset): w / s is the migration only then",
)

_GAINED = {"LNPre": "LN", "RMSPre": "RMS", "LN": "LN", "RMS": "RMS"}


def _scales(identity: str, scales, cfg: Config) -> dict[str, torch.Tensor]:
    """``scales`` (a mapping of norm names to ``[d_model]`` tensors, or one tensor for every norm)
    as float64 CPU tensors, validated."""
    norms = [norm for norm, _pairs in readers(cfg)]
    if isinstance(scales, torch.Tensor):
        scales = dict.fromkeys(norms, scales)
    if not isinstance(scales, Mapping) or not scales:
        raise PreconditionError(identity, SCALES_PER_CHANNEL,
                                f"expected a tensor or a non-empty mapping of norm names to tensors, got {scales!r:.80}")
    unknown = sorted(set(scales) - set(norms))
    if unknown:
        raise PreconditionError(identity, SCALES_PER_CHANNEL, f"{unknown} are no norms of this model; its norms: {norms}")
    out = {}
    for norm, s in scales.items():
        where = f"the scale of {norm}"
        if not isinstance(s, torch.Tensor) or not s.is_floating_point():
            raise PreconditionError(identity, SCALES_PER_CHANNEL, f"{where} is a {type(s).__name__}, not a floating tensor")
        if tuple(s.shape) != (cfg.d_model,):
            raise PreconditionError(identity, SCALES_PER_CHANNEL, f"{where} has shape {list(s.shape)}, expected [{cfg.d_model}]")
        s = s.detach().to(device="cpu", dtype=torch.float64)
        bad = int((~torch.isfinite(s) | (s == 0)).sum())
        if bad:
            raise PreconditionError(identity, SCALES_PER_CHANNEL,
                                    f"{where} has {bad} zero, NaN or infinite entries: gain / s is not defined there")
        out[norm] = s
    return out


@rewrite
def migrate_norm_scales(
    state_dict: StateDict, cfg: Config, scales, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Migrate a per-channel scale out of each norm's gain into its readers' input rows.

    ``scales`` maps norm names (``"blocks.{l}.ln1"``, ``"blocks.{l}.ln2"``, ``"ln_final"``) to
    ``s`` ``[d_model]`` (finite, nonzero), or is one ``[d_model]`` tensor for every norm. For
    each such norm the gain ``w`` ``[d_model]`` becomes ``w / s`` (a LayerNorm's bias ``b``
    becomes ``b / s``) and every weight that reads the norm's output, ``W_Q``, ``W_K``, ``W_V``
    ``[heads, d_model, d_head]``, ``W_in``, ``W_gate`` ``[d_model, d_mlp]``, ``W_U``
    ``[d_model, d_vocab]``, becomes ``diag(s) W`` (its rows times ``s``): ``(n(x) diag(w / s) +
    b / s) diag(s) W = (n(x) diag(w) + b) W``. The normaliser ``n`` sees the stream, which is
    unchanged. Identity ``migrate_norm_scales``.

    An ``LNPre`` or ``RMSPre`` model has the gain 1 (and no bias): it becomes ``LN`` / ``RMS``
    with gain ``1 / s`` (1 for the norms ``scales`` leaves out, bias 0). Refused: no norm,
    post-norm models, a shortformer ``W_pos`` added to ``ln1``'s output (not a linear reader),
    a second application. Computed in float64 and rounded once; dtypes and devices kept.

    >>> import torch
    >>> from circuitmath import Config, migrate_norm_scales, random_state_dict
    >>> from circuitmath.testing import assert_equivalent
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16,
    ...              normalization_type="RMS", gated_mlp=True, act_fn="silu")
    >>> sd = random_state_dict(cfg, seed=0, dtype=torch.float64)
    >>> s = torch.linspace(0.5, 4.0, 8, dtype=torch.float64)
    >>> out, out_cfg = migrate_norm_scales(sd, cfg, {"blocks.0.ln1": s, "blocks.0.ln2": s})
    >>> out_cfg.applied, bool(torch.allclose(out["blocks.0.ln1.w"] * s, sd["blocks.0.ln1.w"]))
    (('migrate_norm_scales',), True)
    >>> _ = assert_equivalent(sd, out, cfg, after_cfg=out_cfg)
    """
    reader_preconditions(identity, cfg)
    require(identity, HAS_A_NORM, cfg.normalization_type in _GAINED,
            f"normalization_type is {cfg.normalization_type!r}: the readers see the stream itself, no gain takes 1 / s")
    require(identity, GAINS_AS_STORED, cfg.norm_gain_offset == 0,
            f"the norms apply {cfg.norm_gain_offset:g} + w (gains stored as w, Gemma); dividing the stored w by s is not"
            " dividing the gain 1 + w")
    validate_state_dict(state_dict, cfg)
    scales = _scales(identity, scales, cfg)
    kind = cfg.normalization_type
    like = state_dict["embed.W_E"]
    out = dict(state_dict)
    for norm, pairs in readers(cfg):
        s = scales.get(norm)
        for suffix in ("w", "b") if _GAINED[kind] == "LN" else ("w",):
            old = state_dict.get(f"{norm}.{suffix}")
            if old is None:  # LNPre / RMSPre: the gain 1 and bias 0 made explicit
                old = torch.full((cfg.d_model,), 1.0 if suffix == "w" else 0.0, dtype=like.dtype, device=like.device)
            out[f"{norm}.{suffix}"] = old if s is None else (old.double() / s.to(old.device)).to(old.dtype)
        if s is None:
            continue
        for weight, _bias in pairs:
            W = state_dict[weight]
            out[weight] = (W.double() * s.to(W.device)[:, None]).to(W.dtype)
    return out, cfg.replace(normalization_type=_GAINED[kind])


def recover_norm_scales(before: StateDict, after: StateDict, cfg: Config) -> dict[str, torch.Tensor] | None:
    """The scales ``s`` (float64 ``[d_model]`` by norm name) with ``after`` close to
    ``migrate_norm_scales(before, cfg, s)``, or ``None`` when no norm's gain or readers changed.

    A gain that changed gives ``s_i = w_i / w'_i``: the parameter, whatever the readers did
    (left alone, divided by ``s``: the wrong rewrites the diagnosis then names). Each reader that
    changed gives, per channel ``i``, the least-squares ratio ``<W'_i, W_i> / |W_i|^2`` of its
    ``i``-th input row after and before, precise where the gain's ratio is not (a bfloat16 gain
    holds ``w / s`` to ``2**-9``): the median of those within ``2**-7`` of the gain's ratio
    refines it, so one reader scaled wrongly does not move it. A gain left alone: the median of
    the readers' ratios. Not verified here: the diagnosis compares the rewrite with ``after``.
    """
    if cfg.normalization_type not in _GAINED or cfg.norm_position != "pre":
        return None
    found = {}
    for norm, pairs in readers(cfg):
        estimates = []  # of the readers that changed: one left alone is no vote for s = 1
        for weight, _bias in pairs:
            if weight not in before or weight not in after or before[weight].shape != after[weight].shape:
                return None
            W, V = before[weight].double().cpu(), after[weight].double().cpu()
            if torch.equal(W, V):
                continue
            rows = tuple(a for a in range(W.ndim) if a != W.ndim - 2)
            den = (W * W).sum(dim=rows)
            estimates.append(torch.where(den > 0, (W * V).sum(dim=rows) / den.clamp_min(1e-300), torch.nan))
        gain_after = after.get(f"{norm}.w")
        if gain_after is None or tuple(gain_after.shape) != (cfg.d_model,):
            return None
        gain = before.get(f"{norm}.w")
        gain = torch.ones(cfg.d_model, dtype=torch.float64, device="cpu") if gain is None else gain.double().cpu()
        gain_after = gain_after.double().cpu()
        if not estimates and torch.equal(gain, gain_after):
            continue
        median = torch.stack(estimates).nanmedian(dim=0).values if estimates else torch.full_like(gain, torch.nan)
        if torch.equal(gain, gain_after):
            anchor = median
        else:  # the gain carries s alone (the readers' median where it is 0); the readers refine it
            anchor = torch.where(gain_after != 0, gain / gain_after, median)
        s = anchor
        if estimates:
            votes = torch.stack(estimates)
            votes = torch.where((votes - anchor).abs() <= 2.0**-7 * anchor.abs(), votes, torch.nan)
            s = torch.where(torch.isnan(votes).all(dim=0), anchor, votes.nanmedian(dim=0).values)
        found[norm] = torch.where(torch.isfinite(s) & (s != 0), s, torch.ones_like(s))
    return found or None


def _head_rows(sd: StateDict, cfg: Config, layer: int, group: int, heads, side: str) -> list[torch.Tensor]:
    """The row blocks ``[rows, d_head]`` of key/value head ``group`` (query heads ``heads``) that a
    rotation of ``side`` multiplies on the right: ``W_V``, ``b_V``, each ``W_O^T``; or each
    ``W_Q``, ``b_Q``, then ``W_K``, ``b_K`` (and positional tables)."""
    p = f"blocks.{layer}.attn"
    if side == "value":
        weight, bias, _h = attention_names(cfg, "V")
        return [sd[f"{p}.{weight}"][group], sd[f"{p}.{bias}"][group][None]] + [sd[f"{p}.W_O"][h].T for h in heads]
    rows = []
    for letter, index in (("Q", list(heads)), ("K", [group])):
        weight, bias, _h = attention_names(cfg, letter)
        rows += [sd[f"{p}.{weight}"][h] for h in index] + [sd[f"{p}.{bias}"][h][None] for h in index]
        if f"{p}.pos_{letter}" in sd:
            rows += [sd[f"{p}.pos_{letter}"][:, h] for h in index]
    return rows


# -- per-head rotations -----------------------------------------------------------------------

HEAD_ROTATIONS = Precondition(
    "an orthogonal rotation per key/value head",
    "each rotation is a floating [n_layers, kv_heads, d_head, d_head] (or [d_head, d_head]) tensor, orthogonal"
    " to the precision of the weights (of R, where R is given more precisely); a group of query heads shares its"
    " key/value head's",
)
COMMUTES_WITH_ROTARY = Precondition(
    "the query/key rotation commutes with the rotary embedding",
    "on a rotary model the query/key rotation turns each rotary pair (i, i + rotary_dim/2), or (2i, 2i + 1) when"
    " interleaved, within itself"
    " ([[c, s], [-s, c]]) and the dimensions past rotary_dim among themselves",
)


def _head_rotations(identity: str, R, cfg: Config, dtype: torch.dtype, side: str) -> torch.Tensor | None:
    """``R`` as float64 ``[n_layers, kv_heads, d_head, d_head]``, validated (``None`` stays ``None``)."""
    if R is None:
        return None
    kv_heads = cfg.n_key_value_heads or cfg.n_heads
    shape = (cfg.n_layers, kv_heads, cfg.d_head, cfg.d_head)
    if not isinstance(R, torch.Tensor) or not R.is_floating_point():
        raise PreconditionError(identity, HEAD_ROTATIONS, f"{side} is a {type(R).__name__}, not a floating tensor")
    if tuple(R.shape) == shape[2:]:
        R = R.expand(shape)
    if tuple(R.shape) != shape:
        raise PreconditionError(identity, HEAD_ROTATIONS, f"{side} has shape {list(R.shape)}, expected {list(shape)}"
                                f" or [{cfg.d_head}, {cfg.d_head}]")
    # orthogonal to the precision of the weights, or of R where R is given more precisely (a float64
    # R for a bfloat16 model is held to float64's: the model's 4 d_head eps would pass 1.2 I)
    given = min(torch.finfo(dtype).eps, torch.finfo(R.dtype).eps)
    R = R.detach().to(device="cpu", dtype=torch.float64)
    if not R.numel():  # no layers (the ends of a model cut into parts): nothing to rotate
        return R
    if not bool(torch.isfinite(R).all()):
        raise PreconditionError(identity, HEAD_ROTATIONS, f"{side} has NaN or infinite entries")
    tolerance = ORTHOGONALITY_SAFETY * cfg.d_head * given
    error = float((R.transpose(-1, -2) @ R - torch.eye(cfg.d_head, dtype=torch.float64, device="cpu")).abs().max())
    require(identity, HEAD_ROTATIONS, error <= tolerance,
            f"{side}: max |R^T R - I| is {error:.3g}, above {tolerance:.3g} for a {str(dtype).removeprefix('torch.')} model"
            " (orthogonalise it in float64, e.g. torch.linalg.qr)")
    if side == "query_key" and cfg.positional_embedding_type == "rotary":
        J = rotary_generator(cfg)
        error = float((R @ J - J @ R).abs().max()) / float(J.abs().max())
        require(identity, COMMUTES_WITH_ROTARY, error <= tolerance,
                f"max |R J - J R| / max |J| is {error:.3g}, above {tolerance:.3g}: R mixes rotary pairs, or turns a"
                " pair by a reflection, so it does not commute with the rotation by position between W_Q and W_K")
    return R


@rewrite(composes=True)
def rotate_heads(
    state_dict: StateDict, cfg: Config, *, value=None, query_key=None, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Rotate the value/output space and the query/key space of every head.

    ``value`` and ``query_key`` are orthogonal ``R`` ``[n_layers, kv_heads, d_head, d_head]``
    (or one ``[d_head, d_head]`` for every head), one per key/value head (``kv_heads``:
    ``n_key_value_heads`` or ``n_heads``), shared by the query heads of its group; ``None``
    leaves that side alone. ``value``: ``W_V -> W_V R``, ``b_V -> b_V R`` and every query head's
    ``W_O -> R^T W_O`` (``[heads, d_head, d_model]``), so each head's ``A (x W_V + b_V) R R^T W_O``
    is what it was. ``query_key``: ``W_Q, b_Q, W_K, b_K`` (and positional tables) ``-> (.) R``, so
    the scores ``q R (k R)^T = q k^T``; on a rotary model ``R`` must commute with the rotation by
    position between them (turn each rotary pair within itself, ``[[c, s], [-s, c]]``, and the
    dimensions past ``rotary_dim`` among themselves). Identity ``rotate_heads``; the general
    invertible change of basis is ``refactor_factored_attn_matrices``'s.

    Norms play no part: any model with attention. Computed in float64 and rounded once; dtypes
    and devices kept. Two rotations compose into one, so a second application is not refused;
    each records ``"rotate_heads"``.
    """
    from ..circuits._bases import change_bases  # the one copy of the per-head products; circuits imports _processing

    dtype = validate_state_dict(state_dict, cfg)
    R_v = _head_rotations(identity, value, cfg, dtype, "value")
    R_qk = _head_rotations(identity, query_key, cfg, dtype, "query_key")
    if R_v is None and R_qk is None:
        raise PreconditionError(identity, HEAD_ROTATIONS, "neither value nor query_key is given")
    device = state_dict["embed.W_E"].device
    R_v, R_qk = (None if R is None else R.to(device) for R in (R_v, R_qk))
    changes = {}
    if R_v is not None:
        changes |= {"value": R_v, "output": R_v.transpose(-1, -2)}
    if R_qk is not None:
        require(identity, NO_QK_NORM, not cfg.qk_norm,
                f"the model normalises {qk_normed(cfg)}: its gain diag(w) sits between W_Q R and the scores and does"
                " not commute with R (a norm over the whole projection commutes with an orthogonal R per head, its"
                " gain only where it is one number on each head); rotate the values only")
        changes |= {"query": R_qk, "key": R_qk}
    return change_bases(state_dict, cfg, **changes), cfg


def _fit(pairs: list[tuple[torch.Tensor, torch.Tensor]], project=None) -> torch.Tensor:
    """The orthogonal ``R`` with ``A R`` closest to ``B`` for the row blocks ``pairs`` (``(A_t, B_t)``
    per tensor ``t``, float64): orthogonal Procrustes on all rows, and on each tensor's rows alone
    where they span the space; of these (each passed through ``project``), the one that leaves the
    fewest tensors off by more than ``2**-6`` of their largest entry, all rows on a tie. So one
    tensor rotated wrongly (a bias left alone, ``W_O`` by ``R`` instead of ``R^T``) does not bend
    the rotation the others show."""
    size = pairs[0][0].shape[1]
    subsets = [pairs] + [[pair] for pair in pairs if pair[0].shape[0] >= size]
    best, fewest = None, None
    for subset in subsets:
        A, B = torch.cat([a for a, _b in subset]), torch.cat([b for _a, b in subset])
        U, _S, Vh = torch.linalg.svd(A.T @ B)
        R = U @ Vh if project is None else project(U @ Vh)
        off = sum(float((a @ R - b).abs().max()) > 2.0**-6 * max(float(b.abs().max()), 1e-30) for a, b in pairs)
        if fewest is None or off < fewest:
            best, fewest = R, off
    return best


def nearest_commuting(R: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The rotation nearest ``R`` that commutes with the rotary embedding: each rotary pair's
    block made ``[[c, s], [-s, c]]`` and normalised, the rest orthogonalised, the rest cut off."""
    half = (cfg.rotary_dim or cfg.d_head) // 2
    out = torch.zeros_like(R)
    i, j = rotary_pairs(cfg, R.device)
    c = (R[..., i, i] + R[..., j, j]) / 2
    s = (R[..., i, j] - R[..., j, i]) / 2
    norm = torch.sqrt(c * c + s * s).clamp_min(1e-300)
    c, s = c / norm, s / norm
    out[..., i, i], out[..., j, j], out[..., i, j], out[..., j, i] = c, c, s, -s
    rest = slice(2 * half, cfg.d_head)  # past rotary_dim in both layouts
    if 2 * half < cfg.d_head:
        U, _S, Vh = torch.linalg.svd(R[..., rest, rest])
        out[..., rest, rest] = U @ Vh
    return out


def recover_head_rotations(before: StateDict, after: StateDict, cfg: Config) -> dict[str, torch.Tensor] | None:
    """``{"value": R_v, "query_key": R_qk}`` (float64 ``[n_layers, kv_heads, d_head, d_head]``, a side
    left out where nothing changed) with ``after`` close to ``rotate_heads(before, cfg, **them)``, or
    ``None`` when neither side changed. Per key/value head, orthogonal Procrustes (:func:`_fit`)
    on the rows of :func:`_head_rows`, on a rotary model's query/key side made the nearest rotation
    that commutes with the rotary embedding. Not verified here."""

    sides = {"value": ("V", "O"), "query_key": ("Q", "K")}
    found = {}
    for side, (first, second) in sides.items():
        names = [f"blocks.{l}.attn.{n}" for l in range(cfg.n_layers) for letter in (first, second)
                 for n in (attention_names(cfg, letter)[:2] if letter != "O" else ("W_O",))]
        if any(n not in before or n not in after or before[n].shape != after[n].shape for n in names):
            return None
        if all(torch.equal(before[n], after[n]) for n in names):
            continue
        R = torch.empty(cfg.n_layers, len(key_value_groups(cfg)), cfg.d_head, cfg.d_head, dtype=torch.float64,
                        device="cpu")
        project = (lambda Q: nearest_commuting(Q, cfg)) if side == "query_key" and cfg.positional_embedding_type == "rotary" else None
        for layer in range(cfg.n_layers):
            for g, heads in enumerate(key_value_groups(cfg)):
                rows = (_head_rows(before, cfg, layer, g, heads, side), _head_rows(after, cfg, layer, g, heads, side))
                if len(rows[0]) != len(rows[1]) or any(a.shape != b.shape for a, b in zip(*rows)):
                    return None  # other blocks (positional tables on one side only): no rotation maps one to the other
                R[layer, g] = _fit([(a.double().cpu(), b.double().cpu()) for a, b in zip(*rows)], project)
        found[side] = R
    return found or None


# -- scales through the MLP's product or its ReLU -------------------------------------------

NEURON_SCALES = Precondition(
    "a finite nonzero scale per neuron",
    "s is a floating [d_mlp] or [n_layers, d_mlp] tensor, finite and nonzero",
)
SCALE_REACHES_OUTPUT_LINEARLY = Precondition(
    "the scaled pre-activation reaches W_out linearly",
    "the MLP is gated (the up projection W_in enters the product act(x W_gate) * (x W_in) linearly), or its"
    " activation is ReLU and every scale positive (relu(s z) = s relu(z) for s > 0)",
)


@rewrite(composes=True)
def scale_neurons(
    state_dict: StateDict, cfg: Config, scales, *, identity: str
) -> tuple[dict[str, torch.Tensor], Config]:
    """Scale each MLP neuron's input by ``s`` and its output by ``1 / s``.

    ``scales`` is ``[d_mlp]`` (every layer) or ``[n_layers, d_mlp]``: ``W_in -> W_in diag(s)``
    (``[d_model, d_mlp]``), ``b_in -> b_in s``, ``W_out -> diag(1/s) W_out`` (``[d_mlp, d_model]``).
    A gated MLP computes ``act(x W_gate) * (x W_in + b_in)``: the up projection enters the product
    linearly, so any nonzero ``s`` is exact (SmoothQuant and AWQ between ``up`` and ``down``);
    ``W_gate`` is left alone, since ``act(z s) != act(z) s``. An ungated MLP is exact only through
    ReLU with ``s > 0`` (cross-layer equalisation: ``relu(s z) = s relu(z)``); GELU, SiLU and
    negative scales are refused. Identity ``scale_neurons``. Computed in float64 and rounded once;
    dtypes and devices kept. Two scalings are one, so a second application is not refused; each
    records ``"scale_neurons"``.
    """
    require(identity, HAS_MLPS, not cfg.attn_only, "the model is attention-only: there are no neurons to scale")
    require_dense_mlp(identity, cfg)
    validate_state_dict(state_dict, cfg)
    if not isinstance(scales, torch.Tensor) or not scales.is_floating_point():
        raise PreconditionError(identity, NEURON_SCALES, f"got {type(scales).__name__}, not a floating tensor")
    s = scales.detach().to(device="cpu", dtype=torch.float64)
    if s.ndim == 1:
        s = s.expand(cfg.n_layers, -1)
    if tuple(s.shape) != (cfg.n_layers, cfg.d_mlp):
        raise PreconditionError(identity, NEURON_SCALES,
                                f"shape {list(scales.shape)}, expected [{cfg.d_mlp}] or [{cfg.n_layers}, {cfg.d_mlp}]")
    bad = int((~torch.isfinite(s) | (s == 0)).sum())
    if bad:
        raise PreconditionError(identity, NEURON_SCALES, f"{bad} zero, NaN or infinite scales")
    if not cfg.gated_mlp:
        require(identity, SCALE_REACHES_OUTPUT_LINEARLY, cfg.act_fn == "relu",
                f"act_fn is {cfg.act_fn!r} in an ungated MLP: {cfg.act_fn}(s z) is not s {cfg.act_fn}(z)")
        negative = int((s < 0).sum())
        require(identity, SCALE_REACHES_OUTPUT_LINEARLY, negative == 0,
                f"{negative} negative scales through ReLU: relu(s z) = -s relu(-z), not s relu(z), when s < 0")
    return scaled_neurons(state_dict, cfg, s), cfg


def scaled_neurons(state_dict: StateDict, cfg: Config, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`scale_neurons`'s rewrite without its preconditions (``s`` ``[n_layers, d_mlp]`` or
    ``[d_mlp]``): ``W_in diag(s)``, ``b_in s``, ``diag(1/s) W_out``, in float64 on each tensor's
    device, rounded once to its dtype."""
    s = s.double().expand(cfg.n_layers, -1)
    out = dict(state_dict)
    for layer in range(cfg.n_layers):
        p, scale = f"blocks.{layer}.mlp", s[layer]
        for name, shaped in (("W_in", scale), ("b_in", scale), ("W_out", 1 / scale[:, None])):
            tensor = state_dict[f"{p}.{name}"]
            out[f"{p}.{name}"] = (tensor.double() * shaped.to(tensor.device)).to(tensor.dtype)
    return out


def recover_neuron_scales(before: StateDict, after: StateDict, cfg: Config) -> torch.Tensor | None:
    """``[n_layers, d_mlp]`` float64: the scales with ``after`` close to ``scale_neurons(before, cfg,
    s)``, or ``None`` when no MLP's ``W_in`` or ``W_out`` changed. Per neuron, the least-squares
    ratio of its ``W_in`` column (after over before), or, where that column did not change, the
    inverse ratio of its ``W_out`` row. Not verified here."""
    if cfg.attn_only:
        return None
    names = [f"blocks.{l}.mlp.{n}" for l in range(cfg.n_layers) for n in ("W_in", "W_out")]
    if any(n not in before or n not in after or before[n].shape != after[n].shape for n in names):
        return None
    if all(torch.equal(before[n], after[n]) for n in names):
        return None
    out = torch.ones(cfg.n_layers, cfg.d_mlp, dtype=torch.float64, device="cpu")
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.mlp"
        W, V = before[f"{p}.W_in"].double().cpu(), after[f"{p}.W_in"].double().cpu()
        if not torch.equal(W, V):
            out[layer] = (W * V).sum(0) / (W * W).sum(0).clamp_min(1e-300)
        else:
            W, V = before[f"{p}.W_out"].double().cpu(), after[f"{p}.W_out"].double().cpu()
            out[layer] = (W * W).sum(1) / (W * V).sum(1).where((W * V).sum(1) != 0, torch.tensor(1.0, dtype=torch.float64, device="cpu"))
    return torch.where(torch.isfinite(out) & (out != 0), out, torch.ones_like(out))
