"""The rewrites quantisation pipelines make before they quantise: scale migration across a norm.

:func:`migrate_norm_scales` moves a per-channel scale ``s`` (``[d_model]``, one per norm) out of
a norm's gain and into the input rows of every map that reads that norm (SmoothQuant's
migration): ``w -> w / s``, ``b -> b / s`` (LayerNorm), ``W -> diag(s) W`` for ``W_Q``, ``W_K``,
``W_V``, ``W_in``, ``W_gate`` (and ``W_U`` behind ``ln_final``). :func:`recover_norm_scales`
finds the ``s`` that maps one model onto another, for the diagnosis.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .._config import Config
from .._errors import Precondition, PreconditionError
from .._state import StateDict, validate_state_dict
from ._common import readers, require, rewrite
from .layer_norm import reader_preconditions

__all__ = ["migrate_norm_scales", "recover_norm_scales", "HAS_A_NORM", "SCALES_PER_CHANNEL", "GAINS_AS_STORED"]

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


@rewrite("migrate_norm_scales")
def migrate_norm_scales(state_dict: StateDict, cfg: Config, scales) -> tuple[dict[str, torch.Tensor], Config]:
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
    identity = "migrate_norm_scales"
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
    return out, cfg.replace(normalization_type=_GAINED[kind], applied=cfg.applied + (identity,))


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
        gain = torch.ones(cfg.d_model, dtype=torch.float64) if gain is None else gain.double().cpu()
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
