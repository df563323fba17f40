"""What several test modules share (on the path through ``pythonpath`` in pyproject.toml)."""

import math
from dataclasses import dataclass

import torch
from hypothesis import assume, event, note

import circuitmath as cm
from circuitmath._identities._circuit_checks import compare_logits
from circuitmath._registry import Identity as RegisteredIdentity

# Sizeable biases, and weights small enough that no softmax saturates: a saturated softmax is
# one-hot whatever its scores, so it hides a wrong change of the scores (post-norm models read
# the raw embeddings, whose outlier dimensions would otherwise give scores in the hundreds).
DISCRIMINATING_WEIGHTS = dict(min_bias_scale=0.5, max_gain_spread=0.3, max_outlier_scale=3.0)


#: What :mod:`circuitmath.strategies` drew by default before its defaults were narrowed to what a
#: TransformerLens-format library of the common case expects (issue 16): 0-layer and
#: grouped-query models too. The suite's property tests draw them as before.
EVERY_SHAPE = dict(min_layers=0, grouped_query=(False, True))


def wide(**options):
    """``options`` for ``models`` or ``configs``, drawing 0-layer and grouped-query models too
    unless ``options`` set ``min_layers`` or ``grouped_query`` themselves."""
    return {**EVERY_SHAPE, **options}


def snapshot(state_dict):
    """A copy of every tensor, to show later that a transform left its input alone."""
    return {k: v.clone() for k, v in state_dict.items()}


def same(a, b):
    """Same names, dtypes and every entry equal."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# -- negative controls: can this draw tell the wrong rewrite from the right one? ----------------

#: How large a measured :class:`Discrimination` quantity must be for a negative control to
#: require its failure: the controls run in float64, whose log-prob tolerances stay near 1e-13
#: (see circuitmath.testing.SAFETY), so a change of 1e-6 in an attention weight, a relative weight
#: or the logits is seen with a margin of several orders of magnitude, and a draw below it is too
#: close to the wrong rewrite being no change at all to count either way.
VISIBLE = 1e-6


@dataclass(frozen=True)
class Discrimination:
    """How far an identity's wrong rewrite departs from its exact one on one draw, measured in
    float64 on the way to the log-probs, before the check runs (``nan``: does not apply).

    - ``weights``: the largest change of a tensor entry, relative to the largest entry of that
      tensor in either rewrite (``inf`` when they hold different tensors); 0 when the wrong
      rewrite only differs through a zero bias or a gain of one.
    - ``pattern``: the largest change of an attention weight between the two models' runs; 0
      when a wrong term moves every score of a row alike, or the softmax is saturated.
    - ``headroom``: the most weight a row of the exact run's patterns (a row with at least two
      keys) puts off its largest entry; 0 when every pattern is one-hot, so no change of scores
      shows.
    - ``logits``: the largest spread over the vocabulary of ``wrong - exact`` logits at one
      position (a shift common to the vocabulary is no change of the log-probs).
    - ``result``: for an identity that licenses a computation (``identity.compare``) instead of
      a rewrite, how far the wrong computation's result is from the exact one's: the spread of
      their logits as above when they compute logits, else the largest change of an entry
      (entrywise, complex entries included) relative to the largest entry of either result.
    """

    weights: float = math.nan
    pattern: float = math.nan
    headroom: float = math.nan
    logits: float = math.nan
    result: float = math.nan


def _tensors(result):
    """The tensors of a computation's result (a tensor, or a dict or sequence of them), in order."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, dict):
        return [t for k in sorted(result, key=str) for t in _tensors(result[k])]
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in _tensors(item)]
    return []


def _relative_change(exact, wrong) -> float:
    exact, wrong = _tensors(exact), _tensors(wrong)
    if len(exact) != len(wrong) or any(e.shape != w.shape for e, w in zip(exact, wrong)):
        return math.inf
    largest = 0.0
    for e, w in zip(exact, wrong):
        if e.numel() == 0:
            continue
        wide = torch.complex128 if e.is_complex() or w.is_complex() else torch.float64  # eigenvalues
        e, w = e.to(wide), w.to(wide)
        scale = max(float(e.abs().nan_to_num().max()), float(w.abs().nan_to_num().max()), torch.finfo(torch.float64).tiny)
        largest = max(largest, float((w - e).abs().nan_to_num(nan=0.0).max()) / scale)
    return largest


def _logit_spread(exact: torch.Tensor, wrong: torch.Tensor) -> float:
    if exact.shape != wrong.shape:
        return math.inf
    change = wrong.double() - exact.double()
    return float((change.amax(dim=-1) - change.amin(dim=-1)).max())


def _headroom(patterns, causal: bool) -> float:
    room = 0.0
    for pattern in patterns:  # [batch, head, query, key]
        rows = 1 - pattern.amax(dim=-1)
        if causal:
            rows = rows[..., 1:]  # the first query sees one key only
        elif pattern.shape[-1] < 2:
            continue
        if rows.numel():
            room = max(room, float(rows.max()))
    return room


def discrimination(identity, wrong_name: str, state_dict, cfg, tokens: torch.Tensor) -> Discrimination:
    """Measure, on ``tokens``, what tells ``identity``'s wrong rewrite ``wrong_name`` from its
    exact one on this model (both applied to the prepared model, as the check does)."""
    before, before_cfg = identity.prepare(state_dict, cfg) if identity.prepare else (state_dict, cfg)
    if identity.compare is not None:
        exact = identity.transform(before, before_cfg, tokens)
        wrong = identity.wrong_rewrites[wrong_name](before, before_cfg, tokens)
        if identity.compare is compare_logits:
            return Discrimination(result=_logit_spread(exact, wrong))
        return Discrimination(result=_relative_change(exact, wrong))
    exact, exact_cfg = identity.transform(before, before_cfg)
    wrong, wrong_cfg = identity.wrong_rewrites[wrong_name](before, before_cfg)
    shared = sorted(exact.keys() & wrong.keys())
    weights = math.inf if exact.keys() != wrong.keys() else _relative_change(
        [exact[k] for k in shared], [wrong[k] for k in shared])
    runs = []
    for sd, run_cfg in ((exact, exact_cfg), (wrong, wrong_cfg)):
        record = {}
        logits = cm.forward({k: v.double() for k, v in sd.items()}, run_cfg, tokens, record=record)
        runs.append((logits, record["patterns"]))
    (exact_logits, exact_patterns), (wrong_logits, wrong_patterns) = runs
    pattern = max((float((w - e).abs().max()) for e, w in zip(exact_patterns, wrong_patterns)), default=0.0)
    return Discrimination(
        weights=weights,
        pattern=pattern,
        headroom=_headroom(exact_patterns, cfg.causal),
        logits=_logit_spread(exact_logits, wrong_logits),
    )


def assume_above(label: str, measured: float, floor: float) -> None:
    """Note a measured discrimination quantity and go on only when it exceeds ``floor``.

    A draw that cannot discriminate is rejected (and counted in hypothesis's statistics), not
    passed: a control that passed on it would pass for the wrong reason, and one that required
    the failure on it would be flaky.
    """
    note(f"{label} = {measured:.3g} (a negative control needs > {floor:g})")
    if not measured > floor:
        event(f"cannot discriminate: {label} <= {floor:g}")
        assume(False)


def assume_discriminates(identity, wrong_name: str, state_dict, cfg, tokens: torch.Tensor, **minimum: float):
    """A registry-driven negative control's first step: measure :func:`discrimination` on the
    tokens the check will run on, note it, and go on only with draws on which each named quantity
    exceeds its ``minimum`` (``pattern=VISIBLE``, say). Returns the measurement."""
    found = discrimination(identity, wrong_name, state_dict, cfg, tokens)
    note(f"{identity.name}.{wrong_name} on this draw: {found}")
    for name, floor in minimum.items():
        assume_above(f"{identity.name}.{wrong_name}: {name}", getattr(found, name), floor)
    return found


def assert_caught(identity, wrong_name: str, state_dict, cfg, tokens: torch.Tensor, what: str, **minimum: float):
    """A registry-driven negative control: :func:`assume_discriminates` on the draw, then the
    check of the wrong rewrite must fail (``what`` names the mistake in the failure message)."""
    assume_discriminates(identity, wrong_name, state_dict, cfg, tokens, **minimum)
    result = identity.check_wrong_rewrite(wrong_name, state_dict, cfg, tokens)
    assert not result.passed, f"{what} went unnoticed: {result}"


class Identity:
    """An identity as the checks use it: a name, a preparation and a transform."""

    def __init__(self, name, transform, prepare=None):
        self.name, self.transform, self.prepare = name, transform, prepare

    prepared = RegisteredIdentity.prepared  # the registry's own: prepare's output, or the model itself


def with_identities(monkeypatch, *chosen):
    """The in-memory and the streamed ``check MODEL`` run ``chosen`` instead of the registry's identities."""
    from circuitmath import _diagnosis, _streaming_check_model

    monkeypatch.setattr(_diagnosis, "weight_identities", lambda symmetries: chosen)
    monkeypatch.setattr(_streaming_check_model, "weight_identities", lambda symmetries: chosen)


def same_rows(streamed, in_memory, tolerances: float | None = None):
    """The streamed check's rows agree with the in-memory check's: the same identities, statuses,
    refusals (precondition and reason) and rewrites; the same |Δ log-prob| up to a thousandth of
    the tolerance (the same tensors run through the same reference blocks; only a reduction
    order may differ: equal, bit for bit, on every model of the tests); and, given
    ``tolerances``, tolerances within that (relative). The rounding sensitivity is the same
    measurement, but the streaming pass draws each tensor's noise from a generator seeded by its
    name, the in-memory one from one generator: two samples of the same quantity. In float32,
    where the a-priori term dominates, they agreed within 0.3 % on the test models; in bfloat16,
    where the measured sensitivity dominates, within 25 %."""
    assert [f.name for f in streamed.findings] == [f.name for f in in_memory.findings]
    for s, m in zip(streamed.findings, in_memory.findings):
        assert (s.status, s.applicable, s.precondition, s.reason, s.rewrite) == \
               (m.status, m.applicable, m.precondition, m.reason, m.rewrite), s.name
        if m.tolerance is not None:
            assert abs(s.max_abs_error - m.max_abs_error) <= 1e-3 * m.tolerance, s.name
            if tolerances is not None:
                assert abs(s.tolerance - m.tolerance) <= tolerances * m.tolerance, s.name


def on_meta_by_default(work, *args):
    """``work(*args)`` with the default device set to ``meta``, then reset: the trap for a tensor
    made without ``device=`` (a hidden host tensor), which then fails to meet the inputs' tensors."""
    torch.set_default_device("meta")
    try:
        return work(*args)
    finally:
        torch.set_default_device(None)
