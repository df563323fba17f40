"""The steps of :func:`~circuitmath.process_weights`: their order, keywords and defaults, and
which later rewrites make an earlier step's record false."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .._config import Config
from .._errors import ArgumentTypeError
from .._state import StateDict
from ._common import refuse_reapplication, undone_by
from .attention import fold_value_biases, refactor_factored_attn_matrices, remove_key_biases
from .centering import center_unembed, center_writing_weights
from .layer_norm import center_reading_weights, fold_layer_norm
from .norms import fold_rms_norm, rescale_residual_stream
from .quantisation import migrate_norm_scales
from .shortformer import shortformer_to_tables

__all__ = [
    "Transform", "PIPELINE_STEPS", "STEPS", "StepDefaults", "DEFAULTS", "FUSABLE_STEPS", "AFTER_FUSED", "KEYWORD_OF",
    "requested", "leaving_out", "steps_between",
]

Transform = Callable[[StateDict, Config], tuple[dict[str, torch.Tensor], Config]]


def _fold_norm(state_dict: StateDict, cfg: Config) -> tuple[dict[str, torch.Tensor], Config]:
    """Fold the norm's parameters into its readers; behind a LayerNorm, also center the readers.

    ``"LN"``: :func:`~circuitmath.fold_layer_norm` with ``center_reading_weights=True`` (a
    shortformer model first moves ``W_pos`` into per-layer query and key tables); ``"RMS"``:
    :func:`~circuitmath.fold_rms_norm`, and no centering (``RMSPre(x)`` is not orthogonal to 1).
    Any other norm has no parameters to fold: refused like :func:`~circuitmath.fold_layer_norm`.
    """
    for done in (fold_layer_norm, fold_rms_norm):
        refuse_reapplication(done.identity, cfg)
    if cfg.normalization_type == "RMS":
        return fold_rms_norm(state_dict, cfg)
    return fold_layer_norm(state_dict, cfg, center_reading_weights=True)


# Rewrites that make an earlier step's record false, which is then applied again after them
# (``cfg.applied`` is always true of the weights): the LayerNorm fold adds ``ln1.b @ W_V`` and
# ``ln1.b @ W_K`` to zeroed value and key biases; every rewrite of W_Q, W_K, W_V, W_O or their
# biases unbalances the refactor's factors (a rotation or a permutation keeps them balanced).
# Rewrites that move the weights off an earlier record's normal form by design are not listed:
# a rotation of the residual basis (centering refers to the basis it was made in), a scale
# migrated into a folded norm's gain (the gain comes back as 1 / s); the record is their history.
undone_by(fold_value_biases, fold_layer_norm)
undone_by(remove_key_biases, fold_layer_norm)
undone_by(
    refactor_factored_attn_matrices, fold_layer_norm, fold_rms_norm, center_reading_weights, fold_value_biases,
    remove_key_biases, center_writing_weights, rescale_residual_stream, shortformer_to_tables, migrate_norm_scales,
)


#: The steps of :func:`~circuitmath.process_weights`, in the order it applies them:
#: ``(keyword, transform)``. A step's keyword is the name of the identity its transform applies
#: (one name per thing), but for the norm fold's ``fold_ln``, which applies the fold of whichever
#: norm the model has. Why this order:
#:
#: 1. the norm fold first, because centering the readers is exact only once they read
#:    ``LNPre(x)``: centering behind an unfolded ``LN(x) = LNPre(x) diag(w) + b`` changes the
#:    model (behind an RMSNorm the readers are not centered: ``RMSPre(x)`` is not orthogonal to
#:    the all-ones vector);
#: 2. the value biases after the fold, which adds ``ln1.b @ W_V`` to ``b_V``: folded earlier,
#:    that part would stay in ``b_V``;
#: 3. the centering of the writers after the value-bias fold, so the final ``b_O`` is centered
#:    once, in the same pass as the other writers;
#: 4. the unembedding's centering after the fold, which rewrites ``W_U`` and moves
#:    ``ln_final.b @ W_U`` into ``b_U``;
#: 5. the refactor last, because every earlier step rewrites ``W_Q``, ``W_K``, ``W_V`` or
#:    ``W_O`` and would undo the balanced factorisation, and because with ``b_V = 0`` the value
#:    side needs no bias row and ``b_V`` stays exactly zero.
PIPELINE_STEPS: tuple[tuple[str, Transform], ...] = (
    ("fold_ln", _fold_norm),
    *((step.identity, step) for step in (
        fold_value_biases, center_writing_weights, center_unembed, refactor_factored_attn_matrices,
    )),
)

#: The keywords of :func:`~circuitmath.process_weights`, in the order it applies them.
STEPS = tuple(keyword for keyword, _step in PIPELINE_STEPS)



@dataclass(frozen=True)
class StepDefaults:
    """Each keyword's default in :func:`~circuitmath.process_weights`' signature: ``None``
    (apply where it applies) for the first four steps, ``False`` for the refactor."""

    fold_ln: bool | None = None
    fold_value_biases: bool | None = None
    center_writing_weights: bool | None = None
    center_unembed: bool | None = None
    refactor_factored_attn_matrices: bool | None = False


#: The keywords' defaults, in the order of :data:`STEPS`.
DEFAULTS: dict[str, bool | None] = asdict(StepDefaults())

#: The steps that ``circuitmath/_processing/fused.py`` may run composed, and the steps after them.
FUSABLE_STEPS, AFTER_FUSED = PIPELINE_STEPS[:4], PIPELINE_STEPS[4:]

#: The transforms whose identities the norm fold (:func:`_fold_norm`) records.
_NORM_FOLD_RECORDS = (shortformer_to_tables, fold_layer_norm, center_reading_weights, fold_rms_norm)

#: The keyword of :func:`~circuitmath.process_weights` that applies each identity it records.
KEYWORD_OF = {
    **{step.identity: STEPS[0] for step in _NORM_FOLD_RECORDS},
    **{keyword: keyword for keyword in STEPS[1:]},
}


def requested(cfg: Config, keywords: dict) -> dict[str, bool | None]:
    """Each step's keyword of :func:`~circuitmath.process_weights` (``keywords``, the others at
    :data:`DEFAULTS`) as it is applied: a step refused by ``cfg`` alone (the refactor of a rotary
    model) that was left to apply where it can (``None``) is ``False``: it would not apply
    anyway, and the fused steps alone may then run in half precision. Raises
    :class:`~circuitmath.ArgumentTypeError` for a value other than ``True``, ``False`` or ``None``."""
    asked = DEFAULTS | keywords
    for keyword, value in asked.items():
        if not any(value is allowed for allowed in (True, False, None)):
            raise ArgumentTypeError(f"{keyword} must be True, False or None (if applicable), got {value!r}")
    refactor = refactor_factored_attn_matrices.identity
    if cfg.positional_embedding_type == "rotary" and asked[refactor] is None:
        asked[refactor] = False
    return asked


def steps_between(applied: tuple[str, ...], other: tuple[str, ...]) -> frozenset[str]:
    """The keywords of :func:`~circuitmath.process_weights` whose steps one of two parts of a
    model applied and the other did not (``applied`` and ``other``: their configs' ``applied``):
    the whole model leaves them out when they were left to apply where they can. Raises
    ``RuntimeError`` for an identity that is no step of it (a transform that applies to part of a
    model and not to the rest cannot happen elsewhere: the others apply or refuse)."""
    differ = set(applied) ^ set(other)
    if not differ <= KEYWORD_OF.keys():
        raise RuntimeError(f"parts of a model applied {applied} and {other}")
    return frozenset(KEYWORD_OF[name] for name in differ)


def leaving_out(keywords: dict, left_out: frozenset[str]) -> dict[str, bool | None]:
    """``keywords`` with each step of ``left_out`` that they leave to apply where it can
    (``None``, also by default) set to ``False``: for a caller that processes a model a part at a
    time and has found a part where the step does not apply, so the whole model leaves it out."""
    asked = DEFAULTS | keywords
    return asked | {keyword: False for keyword in left_out if asked[keyword] is None}
