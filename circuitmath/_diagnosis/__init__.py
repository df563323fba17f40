"""Checking another project's weight processing: which identities it applied, and what went wrong.

A processed state dict ``after`` is explained by replaying the registered identities on
``before``: each identity's exact rewrite is computed and compared with ``after`` tensor by
tensor. The replay follows ``after``'s recorded ``cfg.applied`` when it has one; otherwise every
weight-rewriting identity is tried, in registry order, and kept when its rewrite reproduces more
of ``after``'s tensors than leaving the model alone does. Where the exact rewrite does not
reproduce a tensor, the identity's known wrong rewrites (its registered ``wrong_rewrites``, and
the wrong rewrites of other identities that claim to perform it) are tried; one that reproduces the tensor names the mistake. Where an identity refuses the model
(a :class:`~circuitmath.PreconditionError`), its rewrite applied regardless is tried too: if
that reproduces ``after``, the broken precondition is the finding.

Only then are log-probabilities compared: ``before`` against ``after`` always, and, when
anything was found, every replayed state against the next, so that each identity's row shows
the change in log-probs it is responsible for. A replay in which every identity's exact rewrite
reproduces ``after`` needs no more than the two forward passes of ``before`` and ``after``.

The package: ``_inputs`` resolves each input once (a validated :class:`Model`), ``_replay``
replays the identities, ``_tensors`` compares tensors, ``_logprobs`` computes each state's
log-probs once, ``_report`` builds the rows; this module holds the entry points. The wrong
rewrites are the registry's (``Identity.wrong_rewrites``): none is listed here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from .. import _identities
from .._compare import Comparison, compute_dtype, in_dtype
from .._config import Config
from .._errors import InputError, PreconditionError
from .._processing._memory import without_huge_pages
from .._state import marked_as, vouched
from ._inputs import Model, resolve, resolve_model, resolve_pair, resolve_tokens
from ._names import speak
from ._exact import float64_chain, float64_rewrite, identity_row, in_float64, rewrite_mismatches
from ._logprobs import coarser, _LogProbs, sensitivity_window
from ._replay import _Replay, weight_identities
from ._report import Diagnosis, Finding, _config_differences, _identity_finding, _residual_finding
from ._tensors import ParameterMismatch, _mismatch, Thresholds
from ._unexplained import changes_of, judge_changes

__all__ = [
    "ParameterMismatch",
    "Finding",
    "Diagnosis",
    "Model",
    "resolve_model",
    "diagnose",
    "check_identity",
    "check_model",
    "replay_and_explain",
    "weight_identities",
    "tensor_verdict",
    "TensorVerdict",
]

Progress = Callable[[int, int, str], None]


def _replayed(first: Model, second: Model, plan):
    """``(replay, replay.explain(...))``: the registered identities replayed on ``first`` (in the
    compute dtype) against ``second``, ``plan`` as for :func:`replay_and_explain`."""
    dtype = coarser(first.dtype, second.dtype)
    replay = _Replay(second.state_dict, Thresholds.of(dtype, first.cfg))
    with without_huge_pages():  # the replayed tensors live as long as the check
        return replay, replay.explain(_in_compute_dtype(first.state_dict, dtype), first.cfg, plan)


def replay_and_explain(first: Model, second: Model, tokens, plan, notes, progress=None, computed=(),
                       replayed=None) -> Diagnosis:
    """The diagnosis of ``second`` as a processing of ``first`` (both resolved): replay ``plan``
    (identities; ``None``: infer it), then compare log-probs where needed. ``computed`` holds
    ``(state_dict, log_probs)`` pairs already computed on ``tokens`` and ``replayed`` the replay
    already made (a failed :func:`~circuitmath.testing.assert_equivalent` hands over its two
    forward passes and, from :func:`tensor_verdict`, its replay)."""
    before, before_cfg, after, after_cfg = first.state_dict, first.cfg, second.state_dict, second.cfg
    dtype = coarser(first.dtype, second.dtype)
    report = progress or (lambda done, total, what: None)
    total = 5
    report(0, total, "replaying identities")
    replay, (stages, final, final_cfg, residual) = replayed or _replayed(first, second, plan)
    thresholds = replay.thresholds
    lp = _LogProbs(tokens, dtype)
    for state, computed_log_probs in computed:
        lp.seed(state, computed_log_probs)
    report(2, total, "forward pass of the model")
    lp(before, before_cfg)
    report(3, total, "forward pass of the processed model")
    overall = None
    lp(after, after_cfg)
    report(4, total, "rounding sensitivity")
    lp.set_reference(before, before_cfg)
    overall = lp.compare(before, before_cfg, after, after_cfg)
    config_differences = _config_differences(final_cfg, after_cfg)
    anything_found = residual or config_differences or any(s.rewrites or s.refusal or not s.recognised for s in stages)
    measure = bool(anything_found) or not overall.passed
    last_writer = {}
    for stage in stages:
        for name in stage.touched:
            last_writer[name] = stage.name
    residual_error = {}
    for name in set(final) & set(after):
        if name in last_writer and name not in residual:
            residual_error[name] = replay.relative(name, final[name], before.get(name))
    findings = []
    states = [(before, before_cfg)] + [(s.state, s.cfg) for s in stages]
    unexplained = _unexplained(residual, final, before, after, replay, last_writer)
    near, changed = _judged(replay, residual, final, final_cfg, after, tokens)
    residual_comparison = None
    if measure:  # the changes no identity explains, in float64, decide where they can be run alone
        residual_comparison = changed if changed is not None and not _structural(unexplained, config_differences) \
            else lp.compare(final, final_cfg, after, after_cfg)
    for i, stage in enumerate(stages):
        if measure:
            report(4, total, f"log-probs after {stage.name}")
        comparison = lp.compare(*states[i], *states[i + 1]) if measure else None
        mine = [residual_error[n] for n, writer in last_writer.items() if writer == stage.name and n in residual_error]
        # the tensors this identity wrote last that no rewrite reproduces (beyond precision loss): not exact;
        # wrong when, all such tensors together changing the function, these alone change it too
        unknown = [p for p in unexplained if p.written_by == stage.name
                   and not (dtype == torch.float64 and p.relative_error <= thresholds.float32_rounding)]
        effect = None
        if unknown and residual_comparison is not None and not residual_comparison.passed:
            effect = _effect_of(unknown, final, final_cfg, after, lp)
        kept = residual_comparison is None or residual_comparison.passed
        findings.append(_identity_finding(stage, before, replay, comparison, max(mine, default=0.0), unknown,
                                          effect, function_kept=kept))
    if residual or measure:
        findings.append(_residual_finding(unexplained, residual_comparison, replay, dtype,
                                          config_differences, near))
    findings.append(Finding(
        name="before -> after",
        kind="equivalence",
        applicable=True,
        status="holds" if overall.passed else "violated",
        max_abs_error=overall.max_abs_error,
        tolerance=overall.tolerance,
    ))
    report(total, total, "done")
    return Diagnosis(tuple(findings), overall, tuple(s.name for s in stages), tuple(notes))


def _unexplained(residual, final, before, after, replay, last_writer) -> tuple[ParameterMismatch, ...]:
    """The residual tensors of ``after`` against the replay's end, each naming the identity that
    last rewrote it (``written_by``)."""
    return tuple(
        _mismatch(n, after.get(n), final.get(n), before.get(n), replay.thresholds.exact, last_writer.get(n),
                  "the replay")
        for n in residual
    )


def _effect_of(wrong, final, final_cfg, after, lp):
    """The change in log-probs that ``wrong``'s tensors alone make: the replay's end against it
    with those tensors taken from ``after`` (``None`` when one is missing or of another shape)."""
    if any(p.problem for p in wrong):
        return None
    patched = marked_as(final, dict(final, **{p.name: after[p.name].to(final[p.name].dtype) for p in wrong}))
    return lp.compare(final, final_cfg, patched, final_cfg)


def _recorded_plan(before_cfg: Config, after_cfg: Config, notes: list[str]):
    """The identities ``after_cfg.applied`` records beyond ``before_cfg.applied`` (``None``: infer)."""
    applied, done = after_cfg.applied, before_cfg.applied
    if not applied[len(done):] or applied[: len(done)] != done:
        return None
    names = {identity.name: identity for identity in _identities.identities()}
    unknown = [n for n in applied[len(done):] if n not in names]
    if unknown:
        notes.append(f"cfg.applied records {unknown}, which are no registered identities: inferring the replay instead")
        return None
    notes.append("replaying the identities recorded in the processed model's cfg.applied")
    return [names[n] for n in applied[len(done):]]


@torch.no_grad()  # weights that require grad are compared as plain tensors
def diagnose(
    before, after, cfg=None, *, after_cfg=None, tokens=None, progress: Progress | None = None, device=None
) -> Diagnosis:
    """Explain ``after`` as a processing of ``before``: which identities, which went wrong, where.

    ``before`` and ``after`` are state dicts (TransformerLens or Hugging Face format) or paths of
    safetensors files; ``cfg`` is ``before``'s :class:`~circuitmath.Config` or Hugging Face config
    (``None``: read from the file). ``after_cfg`` defaults to the file's metadata, else to
    ``before``'s config or the first processed form of it the tensors fit (a folded LayerNorm is
    ``"LNPre"``; a norm kept with unit gain and zero bias is read as none). ``tokens``
    ``[batch, pos]`` default to :func:`~circuitmath.testing.default_tokens`. ``progress(done,
    total, what)`` is called as the work proceeds. ``device``: where the check runs (default:
    where the tensors are; a file is read onto the CPU).

    Rows: one per replayed identity; ``residual`` (tensors no replayed rewrite reproduces, each
    naming the identity that last rewrote it) when there is any; ``before -> after`` last. See
    the module documentation of :mod:`circuitmath.testing` for how the replay is chosen. The
    diagnosis names the tensors as ``after`` does.
    """
    first, second, notes = resolve_pair(before, after, cfg, after_cfg)
    first, second = _on(first, device), _on(second, device)
    plan = _recorded_plan(first.cfg, second.cfg, notes)
    found = replay_and_explain(first, second, resolve_tokens(tokens, first.cfg), plan, notes, progress)
    return speak(found, second.names)


@torch.no_grad()  # weights that require grad are compared as plain tensors
def check_identity(name: str, before, after, cfg=None, *, after_cfg=None, tokens=None) -> Diagnosis:
    """Check that ``after`` is the registered identity ``name`` applied to ``before``.

    Like :func:`diagnose`, but the replay is this identity alone (after the identity's own
    preparation, e.g. the LayerNorm fold that centering the reading weights needs). Its row is
    ``"not recognised"`` when none of the tensors the identity rewrites matches its rewrite.
    The diagnosis names the tensors as ``after`` does.
    """
    identity = _identities.get_identity(name)
    if identity.compare is not None:
        raise InputError(f"{name} licenses a computation, not a weight rewrite: there is no processed model to check")
    first, second, notes = resolve_pair(before, after, cfg, after_cfg)
    plan = [identity]
    try:  # the identities its preparation and its transform record (a pipeline records its steps)
        prepared, prepared_cfg = identity.prepared(first.state_dict, first.cfg)
        recorded = identity.transform(prepared, prepared_cfg)[1].applied[len(first.cfg.applied):]
        plan = [_identities.get_identity(n) for n in recorded]
    except PreconditionError:
        pass
    found = replay_and_explain(first, second, resolve_tokens(tokens, first.cfg), plan, notes)
    return speak(dataclasses.replace(found, recognition_required=True), second.names)


@dataclasses.dataclass(frozen=True)
class TensorVerdict:
    """What the replay says of ``after``'s tensors, beside the log-probs of the two models:
    ``named`` (a tensor is a named wrong rewrite's), ``near`` (tensors that are near misses of
    the rewrite, refused entry by entry) and ``changes`` (the float64 comparison of the changes
    no identity explains, ``None`` when there are none; see :mod:`._unexplained`), and
    ``replayed``, the replay (handed to :func:`replay_and_explain` on failure)."""

    named: bool
    near: tuple[str, ...]
    changed: tuple[str, ...]
    changes: Comparison | None
    replayed: tuple

    @property
    def ok(self) -> bool:
        return not self.named and not self.near and (self.changes is None or self.changes.passed)


def tensor_verdict(first: Model, second: Model, plan, tokens) -> TensorVerdict:
    """The replay of ``second`` on ``first`` (resolved; ``plan`` as for :func:`replay_and_explain`),
    tensor by tensor, and the changes it leaves judged in float64 on ``tokens`` (the first
    positions of them: :func:`sensitivity_window`)."""
    replayed = _replayed(first, second, plan)
    replay, (stages, final, final_cfg, residual) = replayed
    named = any(stage.rewrites and stage.recognised for stage in stages)
    near, changes = _judged(replay, residual, final, final_cfg, second.state_dict, tokens)
    problems = [n for n in residual if n not in near and not _comparable(n, final, second.state_dict)]
    changed = tuple(n for n in residual if n not in near)
    if problems or _config_differences(final_cfg, second.cfg):
        changes = None  # the log-probs of the two models decide (a tensor missing, another config)
    return TensorVerdict(named, tuple(near), changed, changes, replayed)


def _comparable(name: str, final, after) -> bool:
    return name in final and name in after and final[name].shape == after[name].shape


def _structural(unexplained, config_differences) -> bool:
    """Whether the replay's end and ``after`` differ beyond their tensors' values (a tensor
    missing or of another shape, a config field): then their own log-probs decide."""
    return bool(config_differences) or any(p.problem for p in unexplained)


def _judged(replay: _Replay, residual, final, final_cfg, after, tokens) -> tuple[list[str], Comparison | None]:
    """``(near misses, float64 comparison of the changes)`` of the tensors ``residual`` (those
    the replay does not reproduce) of ``after`` against ``final`` (see :mod:`._unexplained`)."""
    comparable = [n for n in residual if _comparable(n, final, after)]
    changes = changes_of(comparable, after, final, replay.thresholds, replay.widenings.of_names(final, comparable))
    rows, positions = sensitivity_window(tokens)
    return [c.name for c in changes if c.near], judge_changes(changes, final, final_cfg, tokens[:rows, :positions])


def _in_compute_dtype(state_dict, dtype: torch.dtype):
    """``state_dict`` as the replay takes it: a half-precision model is replayed in float32 (as
    :func:`~circuitmath.process_weights` processes it), so that each replayed tensor is rounded
    once, by the comparison, not after every identity."""
    return in_dtype(state_dict, compute_dtype(dtype)) if state_dict.dtype != torch.float64 else state_dict


@torch.no_grad()  # weights that require grad are compared as plain tensors
def check_model(model, cfg=None, *, tokens=None, progress: Progress | None = None, device=None) -> Diagnosis:
    """Apply every weight identity that applies to ``model`` and compare log-probs, one row each.

    ``model`` and ``cfg`` as for :func:`diagnose`. Each identity runs on the model after its own
    preparation (e.g. centering the reading weights after the LayerNorm fold); an identity that
    refuses the model is ``"not applicable"``, with the broken precondition as its reason. The
    tolerance is the model's (:class:`_LogProbs`). Below float64 each identity is also checked
    in float64 and its rewrite certified (:mod:`~circuitmath._diagnosis._exact`): a row holds
    when all three pass. ``progress(done, total, what)`` is called
    before each identity; ``device`` as for :func:`diagnose`. The diagnosis names the tensors as
    ``model`` does.
    """
    resolved = resolve(model, cfg)
    return speak(_check_resolved(_on(resolved, device), tokens, progress), resolved.names)


def _on(model: Model, device) -> Model:
    """``model`` with its tensors on ``device`` (``None``: where they are)."""
    if device is None:
        return model
    moved = {name: t.to(device) for name, t in model.state_dict.items()}
    moved = vouched(moved, model.cfg, model.dtype, entries=model.state_dict.entries)
    return dataclasses.replace(model, state_dict=moved)


def _check_resolved(resolved: Model, tokens, progress: Progress | None) -> Diagnosis:
    state, model_cfg = resolved.state_dict, resolved.cfg
    tokens = resolve_tokens(tokens, model_cfg)
    chosen = weight_identities(symmetries=True)
    report = progress or (lambda done, total, what: None)
    total = len(chosen) + 1
    report(0, total, "rounding sensitivity")
    lp = _LogProbs(tokens, resolved.dtype)
    lp.set_reference(state, model_cfg)
    exact = None  # below float64: each identity in float64 too, and its rewrite certified (see _exact)
    if resolved.dtype != torch.float64:
        rows, positions = sensitivity_window(tokens)
        exact = _LogProbs(tokens[:rows, :positions], torch.float64), in_float64(state)
        exact[0].set_reference(exact[1], model_cfg)
    findings = []
    for i, identity in enumerate(chosen, 1):
        report(i, total, identity.name)
        with without_huge_pages():  # its models live as long as its row takes
            findings.append(_identity_row(identity, resolved, lp, exact))
    report(total, total, "done")
    return Diagnosis(tuple(findings))


def _identity_row(identity, resolved: Model, lp: _LogProbs, exact: tuple[_LogProbs, dict] | None) -> Finding:
    """The row of ``identity`` in :func:`check_model` of ``resolved``: compared by ``lp`` in the
    model's dtype and, below float64, by ``exact`` (float64 log-probs and the model in float64,
    their reference) too, its rewrite certified. Its models in the model's dtype stay in ``lp``
    until the next identity's row is made."""
    state, model_cfg = resolved.state_dict, resolved.cfg
    try:
        prepared, prepared_cfg = identity.prepared(state, model_cfg)
        processed, processed_cfg = identity.transform(prepared, prepared_cfg)
    except PreconditionError as error:
        return Finding(identity.name, "identity", False, "not applicable", reason=str(error),
                       precondition=error.precondition)
    comparison = lp.compare(prepared, prepared_cfg, processed, processed_cfg)
    # each identity's models go once the next is checked: the next one's preparation may be
    # one of them (center_reading_weights prepares by fold_layer_norm), its log-probs taken
    lp.forget_all_but(state, prepared, processed)
    if exact is None:
        return identity_row(identity.name, comparison, None)
    exact, state64 = exact
    chain, reference = _float64_of(identity, (state, state64), model_cfg, prepared, prepared_cfg)
    mismatches = rewrite_mismatches(identity, prepared, prepared_cfg, processed, chain,
                                    Thresholds.of(resolved.dtype, model_cfg), reference=reference)
    prepared = processed = reference = None
    float64 = exact.compare(*chain) if chain else None
    exact.forget_all_but(state64)
    return identity_row(identity.name, comparison, float64, mismatches, refused_in_float64=chain is None)


def _float64_of(identity, model: tuple[Mapping, Mapping], cfg, prepared, prepared_cfg):
    """``(chain, reference)``: ``identity`` checked in float64 (``chain``, as :func:`float64_chain`
    gives it) and the float64 rewrite its certificate compares with (``reference``; ``None``:
    the transform refuses the prepared model in float64). An identity without a preparation has
    one of each: its transform of the model in float64. An identity with one is checked on its
    preparation in the model's dtype, converted, which its certificate compares with anyway;
    where the transform refuses that, on the model prepared in float64 (see :mod:`._exact`).
    ``model``: the model and its float64 copy."""
    state64 = model[1]
    if not identity.prepare:
        chain = float64_chain(identity, state64, cfg)
        return chain, None if chain is None else chain[2]
    rewrite = float64_rewrite(identity, prepared, prepared_cfg, known=model)
    if rewrite is not None:
        return rewrite, rewrite[2]
    return float64_chain(identity, state64, cfg), None
