"""An identity checked on a model below float64: in float64 on its weights, and its rounding.

``check MODEL`` applies each identity's transform in the model's dtype and compares log-probs
there. Below float64 that comparison is as blunt as the model's rounding: in bfloat16 a model's
tolerance is about a tenth of a nat on a 6-wide model, and wrong rewrites that move the
log-probs by a hundredth pass it. Two sharper checks go with it, for every dtype below float64:

- **the identity in float64**: the model's weights (exact in float64), prepared and transformed
  in float64, against the weights themselves, on the first tokens of the check
  (:func:`~circuitmath._diagnosis._logprobs.sensitivity_window`), within float64's tolerance:
  whether the identity holds for these weights, up to float64's rounding, not the model's;
- **the certificate of the rewrite**: each tensor the transform wrote in the model's dtype
  against the same transform of the same prepared weights in float64, entry by entry
  (:func:`~circuitmath._diagnosis._tensors.certificate`): whether the model's dtype got the
  exact rewrite, rounded once.

A row holds when all three pass (:func:`identity_row`). The in-memory and the streamed checks
(:mod:`circuitmath._streaming_check_model`) build their rows here.

In memory, an identity with a preparation is checked in float64 on its preparation in the
model's dtype, converted (exact), which is what its certificate compares with: one float64
transform serves both (:func:`float64_rewrite`); only where that refuses (a precondition the
preparation met to the model's rounding) is the model prepared in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .._compare import Comparison, in_dtype
from .._errors import PreconditionError
from .._state import Validated, vouched
from ._report import Finding
from ._tensors import ParameterMismatch, certified, _largest_entry, _mismatch, Thresholds

__all__ = ["in_float64", "float64_chain", "rewrite_mismatches", "identity_row", "float64_rewrite"]


def in_float64(state_dict: Mapping[str, torch.Tensor], known: tuple[Mapping, Mapping] | None = None) -> dict[str, torch.Tensor]:
    """``state_dict``'s tensors in float64 (exact: every dtype below it converts exactly); a
    validated state dict stays one (:func:`~circuitmath._compare.in_dtype`). ``known``: ``(model,
    model64)``, a model and its float64 copy: a tensor of ``state_dict`` that is one of
    ``model``'s (a preparation leaves most of them alone) is taken from ``model64``, not
    converted again."""
    if known is None or not isinstance(state_dict, Validated) or state_dict.dtype == torch.float64:
        return in_dtype(state_dict, torch.float64)
    model, model64 = known
    copy = {name: model64[name] if model.get(name) is tensor else tensor.double() for name, tensor in state_dict.items()}
    return vouched(copy, state_dict.cfg, torch.float64, entries=state_dict.entries, writers=state_dict.writers)


def rewrite_mismatches(
    identity, prepared: Mapping, prepared_cfg, processed: Mapping, chain: tuple | None, thresholds: Thresholds,
    keep: Callable[[str], str | None] = lambda name: name, *, reference=...,
) -> tuple[ParameterMismatch, ...]:
    """The tensors ``identity``'s transform wrote into ``processed`` from ``prepared`` (in a
    dtype below float64) that fail their certificate against the same transform of ``prepared``
    in float64: ``chain``'s (:func:`float64_chain` of the same model) where the identity has no
    preparation, else computed here. None is reported when that transform refuses: a
    precondition that holds only to the model's rounding (writes centered in bfloat16) leaves
    nothing to certify against. ``keep(name)``: the name to report for a tensor of
    ``processed`` (``None``: not certified here, e.g. a block part's stand-ins for the ends).
    ``reference``: the float64 rewrite of ``prepared`` already computed (:func:`float64_rewrite`'s
    processed tensors; ``None``: it refuses), instead of computing it here."""
    if reference is not ...:
        if reference is None:
            return ()
        exact = reference
    elif chain is not None and not identity.prepare:
        exact = chain[2]
    else:
        try:
            exact = identity.transform(in_float64(prepared), prepared_cfg)[0]
        except PreconditionError:
            return ()
    found = []
    for name, tensor in processed.items():
        if tensor is prepared.get(name) or keep(name) is None:
            continue
        expected = exact.get(name)
        if expected is None or expected.shape != tensor.shape or not certified(
                tensor, expected, max(_largest_entry(expected), _largest_entry(tensor)), thresholds):
            found.append(_mismatch(keep(name), tensor, expected, None, thresholds.exact, None, "the float64 rewrite"))
    return tuple(found)


def float64_rewrite(identity, prepared: Mapping, prepared_cfg, known: tuple[Mapping, Mapping] | None = None,
                    ) -> tuple[dict, object, dict, object] | None:
    """``(prepared64, prepared_cfg, processed64, processed_cfg)``: ``identity``'s transform of
    ``prepared`` (the model prepared in its own dtype) converted to float64 (``known`` as for
    :func:`in_float64`), the reference of its certificate and, for an identity with a
    preparation, its check in float64 too; ``None`` when the transform refuses it there (a
    precondition the preparation met only to the model's rounding: then :func:`float64_chain`
    prepares the model in float64)."""
    prepared64 = in_float64(prepared, known)
    try:
        return (prepared64, prepared_cfg, *identity.transform(prepared64, prepared_cfg))
    except PreconditionError:
        return None


def float64_chain(identity, state64: Mapping, cfg) -> tuple[dict, object, dict, object] | None:
    """``(prepared, prepared_cfg, processed, processed_cfg)``: ``identity`` prepared and
    transformed in float64 from ``state64`` (the model converted); ``None`` when it refuses
    there (a precondition that holds only to the model's rounding)."""
    try:
        prepared, prepared_cfg = identity.prepared(state64, cfg)
        return (prepared, prepared_cfg, *identity.transform(prepared, prepared_cfg))
    except PreconditionError:
        return None


def identity_row(name: str, comparison: Comparison, exact: Comparison | None,
                 mismatches: tuple[ParameterMismatch, ...] = (), *, refused_in_float64: bool = False) -> Finding:
    """The row of identity ``name``: ``comparison`` in the model's dtype, ``exact`` in float64
    (``None`` for a float64 model, or where the identity refuses the model in float64:
    ``refused_in_float64``, said in the row) and the rewrite's ``mismatches``. The |Δ log-prob|
    shown is the model dtype's, or float64's when that one fails."""
    notes, failures = [], []
    if refused_in_float64:
        notes.append("in float64 the identity refuses these weights (a precondition holds only to the model's"
                     " rounding): checked in the model's dtype alone")
    shown = comparison
    if exact is not None and not exact.passed:
        shown = exact
        failures.append(
            f"in float64 on the model's weights the log-probs moved by {exact.max_abs_error:.3g}, above float64's"
            f" tolerance {exact.tolerance:.3g}: the identity does not hold for these weights")
    if mismatches:
        failures.append(f"{len(mismatches)} tensor(s) written in the model's dtype are not the float64 rewrite rounded once")
    holds = comparison.passed and not failures
    lines = notes + failures
    return Finding(name, "identity", True, "holds" if holds else "violated", rewrite="exact",
                   max_abs_error=shown.max_abs_error, tolerance=shown.tolerance,
                   explanation="\n".join(lines) or None, parameters=mismatches)
