"""The result of a check: one :class:`Finding` per row, gathered in a :class:`Diagnosis`.

``str(diagnosis)`` is the table and the explanations the CLI prints; ``as_dicts()`` its JSON
rows. The row builders turn a replayed stage and its log-prob comparison into a finding.
"""

from __future__ import annotations

import dataclasses
import re

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .._compare import Comparison
from .._config import Config
from ._tensors import CERTIFICATE_ULPS, ParameterMismatch, _json_number, _mismatch, _relative_difference
from ._unexplained import NEAR_ULPS

__all__ = ["Finding", "Diagnosis", "TABLE_COLUMNS", "in_input_names"]


@dataclass(frozen=True)
class Finding:
    """One row of a check: an identity, the residual the identities leave, or the whole model.

    ``kind`` is ``"identity"`` (a registered identity: in a check of one model, its transform
    applied to that model; in a check of a processed model, one step of the replay), ``"residual"``
    (what the replayed identities do not reproduce) or ``"equivalence"`` (``before`` against
    ``after`` as a whole). ``status`` is ``"holds"``, ``"violated"``, ``"not applicable"`` or
    ``"not recognised"`` (a check of one identity found no trace of it in ``after``).
    ``max_abs_error`` is the largest |Δ log-prob| this row is responsible for and ``tolerance``
    what rounding may explain; both are ``None`` for a replayed identity whose exact rewrite
    reproduced every tensor (then ``parameter_error``, the largest relative difference between
    ``after`` and that rewrite, is the evidence). ``rewrite`` is ``"exact"``, or the wrong rewrite
    that reproduced ``after`` as ``"identity.name"``.
    """

    name: str
    kind: str
    applicable: bool
    status: str
    reason: str | None = None
    rewrite: str | None = None
    max_abs_error: float | None = None
    tolerance: float | None = None
    explanation: str | None = None
    parameters: tuple[ParameterMismatch, ...] = ()
    parameter_error: float | None = None
    precondition: str | None = None

    @property
    def violated(self) -> bool:
        """A failure: the function changed beyond tolerance, or a tensor is a named wrong rewrite's
        (status ``"violated"`` either way). ``"not recognised"`` alone is no failure when the
        function is unchanged: an exact processing the registry does not know."""
        return self.status == "violated"

    def applicability(self, short: bool = False) -> str:
        """The "applicable" column: ``"yes"``, ``"-"`` for rows that are no identity, or what the
        identity needs and what this model has instead: ``"no: needs normalization_type is LN;
        this model: normalization_type is 'RMS'"`` (``short``: each part cut for a text table)."""
        if self.kind != "identity":
            return "-"
        if self.applicable:
            return "yes"
        if not self.precondition:
            return "no: " + (_shorten(self.reason or "", 48) if short else (self.reason or ""))
        text = "no: needs " + (_shorten(self.precondition, 42) if short else self.precondition)
        has = _what_the_model_has(self.reason)
        return text + ("; this model: " + (_shorten(has, 36) if short else has) if has else "")

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "applicable": self.applicable,
            "reason": self.reason,
            "precondition": self.precondition,
            "rewrite": self.rewrite,
            "max_abs_error": _json_number(self.max_abs_error),
            "tolerance": _json_number(self.tolerance),
            "status": self.status,
            "explanation": self.explanation,
            "parameter_error": _json_number(self.parameter_error),
            "parameters": [p.as_dict() for p in self.parameters],
        }


TABLE_COLUMNS = ("identity", "applicable", "rewrite", "max |Δ log-prob|", "tolerance", "status")


@dataclass(frozen=True)
class Diagnosis:
    """The findings of a check, one per row; ``str()`` gives the table and the explanations.

    ``comparison`` is ``before`` against ``after`` (``None`` when one model was checked on its
    own), ``replayed`` the identities the replay applied, in order, and ``notes`` how the inputs
    were read.
    """

    findings: tuple[Finding, ...]
    comparison: Comparison | None = None
    replayed: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: A check of one identity (:func:`check_identity`): a row ``"not recognised"`` fails it too.
    recognition_required: bool = False

    @property
    def ok(self) -> bool:
        """No row is violated and, when two models were compared, they agree: the function is
        unchanged and no tensor is a named wrong rewrite's (a check of one identity also needs
        it recognised)."""
        unrecognised = self.recognition_required and any(f.status == "not recognised" for f in self.findings)
        return not self.violations and not unrecognised and (self.comparison is None or self.comparison.passed)

    @property
    def violations(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.violated)

    def culprits(self) -> tuple[ParameterMismatch, ...]:
        """Every parameter named by a violated row, once (as the first such row names it: an
        identity's row and the residual row name the tensors it rewrote that nothing explains)."""
        named: dict[str, ParameterMismatch] = {}
        for f in self.violations:
            for p in f.parameters:
                named.setdefault(p.name, p)
        return tuple(named.values())

    def as_dicts(self) -> list[dict]:
        return [f.as_dict() for f in self.findings]

    def table(self) -> str:
        rows = [TABLE_COLUMNS]
        for f in self.findings:
            applicable = f.applicability(short=True)
            rows.append((
                f.name,
                applicable,
                f.rewrite or "-",
                "exact rewrite" if f.max_abs_error is None and f.rewrite == "exact" else _number(f.max_abs_error),
                _number(f.tolerance),
                f.status,
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __repr__(self) -> str:
        """One line, the verdict first, short enough for a test runner's assertion message
        (pytest cuts reprs at 240 characters); ``str()`` gives the table and the explanations."""
        if self.ok:
            return f"<Diagnosis ok: {len(self.findings)} rows hold>"
        parts = []
        if self.comparison is not None and not self.comparison.passed:
            parts.append(f"log-probs differ by {self.comparison.max_abs_error:.3g} > {self.comparison.tolerance:.3g}")
        failing = [f for f in self.findings if f.violated or f.status == "not recognised"]
        for f in failing:
            names = [p.name for p in f.parameters]
            shown = ", ".join(names[:2]) + (f" +{len(names) - 2} more" if len(names) > 2 else "")
            parts.append(f"{f.name} {f.status}" + (f" ({f.rewrite}: {shown})" if f.rewrite and shown else
                                                   f" ({shown})" if shown else ""))
        return _shorten(f"<Diagnosis FAILED: {'; '.join(parts)}; print it for the table>", 230)

    def __str__(self) -> str:
        lines = []
        if self.comparison is not None:
            c = self.comparison
            b, p, t = c.where
            verdict = "agree" if c.passed else "DIFFER"
            relation = "<=" if c.passed else ">"
            lines.append(
                f"before and after {verdict}: max |Δ log-prob| {c.max_abs_error:.3g} {relation} tolerance"
                f" {c.tolerance:.3g} (batch {b}, position {p}, token {t})"
            )
            lines.append("replayed: " + (" -> ".join(self.replayed) if self.replayed else "no identity"))
        lines += [f"note: {n}" for n in self.notes]
        lines += ["", self.table()]
        for f in self.findings:
            if not (f.violated or f.explanation or f.reason and f.kind == "identity" and f.applicable):
                continue
            if f.status == "not applicable":
                continue
            lines += ["", f"{f.name}: {f.status}"]
            if f.reason:
                lines.append(f"  {f.reason}")
            if f.explanation:
                lines += [f"  {line}" for line in f.explanation.splitlines()]
            lines += [f"    {p}" for p in f.parameters]
        return "\n".join(lines)


def _what_the_model_has(reason: str | None) -> str | None:
    """The first clause of a refusal's detail (``PreconditionError``: "... does not hold: DETAIL"),
    which states what the model has: "normalization_type is 'RMS'", "the model uses rotary
    embeddings"; ``None`` when the reason has no detail."""
    if not reason or "does not hold: " not in reason:
        return None
    detail = reason.split("does not hold: ", 1)[1]
    return re.split(r"[;:(]", detail, maxsplit=1)[0].strip().rstrip(",.") or None


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _identity_finding(stage: _Stage, before: Mapping, replay: _Replay, comparison: Comparison | None,
                      parameter_error: float | None, unexplained: tuple[ParameterMismatch, ...] | list = (),
                      effect: Comparison | None = None, function_kept: bool = True) -> Finding:
    """The row of one replayed identity.

    ``unexplained`` are the tensors this identity rewrote last in the replay that ``after`` holds
    otherwise, and no known rewrite explains; ``function_kept`` whether all unexplained tensors
    together leave the log-probs unchanged (an exact processing the registry does not know), and
    otherwise ``effect`` how much these alone move them (``None``: one is missing or misshapen).
    The row then names them and does not say ``"exact"`` (its rewrite is ``"unknown"``); it is
    violated when the function changes and these tensors alone change it (or cannot be measured)."""
    lines, parameters = [], []
    reference = stage.exact
    for rewrite, names in stage.rewrites.items():
        lines.append(f"the wrong rewrite {rewrite} explains {', '.join(names)}: {stage.descriptions[rewrite]}")
        for name in names:
            if reference is not None:
                expected, expected_in = reference.get(name), "the exact rewrite"
            else:  # the identity refuses the model: there is no exact rewrite, so measure the change
                expected, expected_in = before.get(name), "the original model"
            parameters.append(_mismatch(name, stage.state.get(name), expected, before.get(name),
                                        replay.thresholds.exact, stage.name, expected_in))
    if stage.refusal is not None and stage.recognised:
        lines = [line.replace(f"the wrong rewrite {stage.name}.regardless explains", "applied regardless, to", 1)
                 for line in lines]
    if not stage.recognised:
        lines.append(
            "not recognised: none of the tensors this identity rewrites matches its rewrite"
            + ("" if stage.refusal is None else " (and the identity refuses this model)")
        )
        if reference is not None:
            parameters += [
                _mismatch(n, replay.after.get(n), reference.get(n), before.get(n), replay.thresholds.exact, stage.name)
                for n in sorted(stage.touched)
            ]
    rewrite = "exact" if not stage.rewrites and stage.refusal is None else ", ".join(stage.rewrites) or "regardless"
    if unexplained:
        names = [p.name for p in unexplained]
        if function_kept:
            shown = "; with the residual's other tensors the log-probs do not change beyond rounding"
        elif effect is not None:
            shown = (f"; alone, {'they move' if len(names) > 1 else 'it moves'} the log-probs by"
                     f" {effect.max_abs_error:.3g} (tolerance {effect.tolerance:.3g})")
        else:
            shown = ""
        lines.append(f"no known rewrite reproduces {', '.join(names)}, which this identity rewrote last in the"
                     f" replay: {'they differ' if len(names) > 1 else 'it differs'} from its rewrite{shown}")
        parameters += list(unexplained)
        rewrite = "unknown" if rewrite == "exact" else f"{rewrite}, unknown"
    if not stage.recognised:
        status = "not recognised"
    elif unexplained and not function_kept and (effect is None or not effect.passed):
        status = "violated"
    elif stage.rewrites:  # a named wrong rewrite fails the check even where the check tokens do not show it
        status = "violated"
        if comparison is None or comparison.passed:
            lines.append("the log-probs on the check tokens do not show it, but these tensors are a known wrong"
                         " rewrite's, not the identity's: on other inputs (or other weights) the function changes")
    elif comparison is None:
        status = "holds"
    else:
        status = "holds" if comparison.passed else "violated"
    return Finding(
        name=stage.name,
        kind="identity",
        applicable=stage.refusal is None,
        status=status,
        reason=None if stage.refusal is None else str(stage.refusal),
        precondition=None if stage.refusal is None else stage.refusal.precondition,
        rewrite=rewrite,
        max_abs_error=None if comparison is None else comparison.max_abs_error,
        tolerance=None if comparison is None else comparison.tolerance,
        explanation="\n".join(lines) or None,
        parameters=tuple(parameters),
        parameter_error=parameter_error,
    )


def _config_differences(replayed: Config, processed: Config) -> list[str]:
    """The config fields (other than ``applied``) in which the processed model differs from the replay."""
    ours, theirs = replayed.to_dict(), processed.to_dict()
    return [f"{k}: {theirs[k]!r} (the replay gives {ours[k]!r})" for k in ours if k != "applied" and ours[k] != theirs[k]]


def _residual_finding(parameters, comparison: Comparison | None, replay, dtype,
                      config_differences, off=()) -> Finding:
    """What the replayed identities leave unexplained: tensors (``parameters``, against the
    replay's end), and config fields; ``comparison`` is the float64 comparison of the changes no
    identity explains (:mod:`._unexplained`), or the replay's end against ``after`` where a
    tensor is missing or misshapen or a config field differs (``None``: not measured). ``off``: the near misses, tensors that fail their certificate by at most
    :data:`~circuitmath._diagnosis._unexplained.NEAR_ULPS` units (``_unexplained``):
    they make the row violated whatever the log-probs say."""
    residual = [p.name for p in parameters]
    lines = []
    if residual:
        relative = [p.relative_error for p in parameters]
        rounded = [p for p in parameters
                   if dtype == torch.float64 and p.relative_error <= replay.thresholds.float32_rounding]
        if len(rounded) == len(parameters):
            lines.append(
                f"every difference is within float32 rounding (largest {max(relative):.2g} of a tensor's largest"
                " entry): the float64 weights were processed in float32 or lower precision"
            )
        elif rounded:  # precision loss beside real differences: name only the real ones
            largest = max(p.relative_error for p in rounded)
            lines.append(
                f"{len(rounded)} more tensors differ within float32 rounding (largest {largest:.2g} of a"
                " tensor's largest entry): the float64 weights were processed in float32 or lower precision"
            )
            parameters = tuple(p for p in parameters if p not in rounded)
        writers_ = sorted({p.written_by for p in parameters if p.written_by})
        if writers_:
            lines.append("these tensors differ from the exact rewrite of " + ", ".join(writers_)
                         + " (each parameter names the identity that last rewrote it)")
        if any(p.written_by is None for p in parameters):
            lines.append("tensors no replayed identity rewrites differ from the original model")
    if config_differences:
        lines.append("the processed model's config differs from the replay's: " + "; ".join(config_differences))
    if comparison is None:
        status = "holds"
    else:
        status = "holds" if comparison.passed else "violated"
    if off:
        status = "violated"
        lines.append(
            f"not the exact rewrite: {', '.join(off)} {'has' if len(off) == 1 else 'have'} entries more than"
            f" {CERTIFICATE_ULPS} unit in the last place of {replay.thresholds.dtype} from the replayed rewrite"
            f" (the tensor certificate) and none more than {NEAR_ULPS}: a slight change of the rewrite, which the log-probs"
            " cannot tell from rounding at this precision"
        )
    elif residual and comparison is not None and comparison.passed:
        lines.append("the differences do not change the log-probs beyond rounding")
    return Finding(
        name="residual",
        kind="residual",
        applicable=True,
        status=status,
        max_abs_error=None if comparison is None else comparison.max_abs_error,
        tolerance=None if comparison is None else comparison.tolerance,
        explanation="\n".join(lines) or None,
        parameters=parameters,
    )


@dataclass(frozen=True)
class _Named(ParameterMismatch):
    """A :class:`ParameterMismatch` named as the input names the tensor (``name``), with the
    entries of it this parameter (or its heads) takes (``where``: ``[8:16, :]``, empty for all of it)."""

    where: str = ""
    circuitmath_name: str = ""
    #: :attr:`at` as the input indexes its tensor (``"[5, 3]"``; empty when not known).
    stored_at: str = ""
    #: :attr:`rows` as the entries of the input's tensor they are (``"[:, 12:16], [:, 40]"``; empty when not known).
    stored_rows: str = ""

    def __str__(self) -> str:
        plain = ParameterMismatch(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ParameterMismatch)})
        text = str(dataclasses.replace(plain, name=self.name + self.where)).replace(
            f"the largest at {self._at()}", f"the largest at {self.stored_at}" if self.stored_at else "the largest"
            f" at {self._at()} of {self.circuitmath_name}")
        if self.rows:
            counted = self._rows().rsplit(" (", 1)[1]
            text = text.replace(self._rows(), f"entries {self.stored_rows} ({counted}"
                                if self.stored_rows else f"{self._rows()} of {self.circuitmath_name}")
        return text

    def as_dict(self) -> dict:
        return super().as_dict() | {"where": self.where, "circuitmath_name": self.circuitmath_name,
                                    "stored_at": self.stored_at, "stored_rows": self.stored_rows}


def _renamed(parameter: ParameterMismatch, names) -> ParameterMismatch:
    full = names.name(parameter.name, parameter.heads)
    if full == parameter.name:
        return parameter
    stored = names.name(parameter.name).split("[", 1)[0]
    fields = {f.name: getattr(parameter, f.name) for f in dataclasses.fields(ParameterMismatch)}
    return _Named(**(fields | {"name": stored}), where=full[len(stored):], circuitmath_name=parameter.name,
                  stored_at=names.index(parameter.name, parameter.at) if parameter.at else "",
                  stored_rows=names.rows(parameter))


def in_input_names(diagnosis: Diagnosis, names) -> Diagnosis:
    """``diagnosis`` speaking the input's names (``names``: an :class:`~._inputs.InputNames`; ``None``
    keeps circuitmath's, which the input used): every parameter, explanation and reason."""
    if names is None:
        return diagnosis
    findings = tuple(dataclasses.replace(
        f, parameters=tuple(_renamed(p, names) for p in f.parameters), explanation=names.text(f.explanation),
        reason=names.text(f.reason)) for f in diagnosis.findings)
    return dataclasses.replace(diagnosis, findings=findings)
