"""Replaying identities on the original model, to tell which rewrite reproduces the processed one.

For each identity the exact rewrite is computed and compared with ``after`` tensor by tensor;
where it does not reproduce a tensor, the identity's registered wrong rewrites (and those of
other identities that claim to perform it) are tried; where the identity refuses the model,
its rewrite applied regardless.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from .. import _identities
from .._config import Config
from .._errors import AlreadyAppliedError, PreconditionError
from .._state import marked_as
from ._lessons import Lessons
from ._recover import slice_permutation, tensors_layer, unit_axis
from ._tensors import certified, _largest_entry, _natural_order, _relative_difference, Thresholds
from ._uncertain import Widenings, widened_certificate

__all__ = ["weight_identities", "SYMMETRIES"]

#: Identities with a free parameter (a rotation ``Q``, a permutation): the blind replay cannot try
#: them with a fixed one, so the diagnosis recovers the parameter from the tensors instead.
SYMMETRIES = tuple(identity.name for identity in _identities.identities()
                   if identity.free_parameter or identity.recover is not None)

#: How each symmetry recognised first (``Identity.recovered_first``: the residual rotation) is, once each.
FIRST = tuple({id(identity.recovered_first): identity.recovered_first for identity in _identities.identities()
               if identity.recovered_first is not None}.values())

#: The other symmetries whose identity recovers its own parameter (``Identity.recover``), in registry order:
#: tried after those of :data:`FIRST`.
RECOVERED = tuple(identity for identity in _identities.identities()
                  if identity.recover is not None and identity.recovered_first is None)


def weight_identities(*, symmetries: bool = False) -> tuple:
    """The registered identities whose transform rewrites weights (not a computation), each
    transform once (an identity sharing another's transform is left out); the
    :data:`SYMMETRIES` only with ``symmetries``."""
    seen, out = set(), []
    for identity in _identities.identities():
        if identity.name in SYMMETRIES and not symmetries:
            continue
        if identity.compare is None and id(identity.transform) not in seen:
            seen.add(id(identity.transform))
            out.append(identity)
    return tuple(out)


@dataclass
class _Candidate:
    rewrite: str  # "exact" or "identity.name"
    description: str
    state: dict
    cfg: Config


@dataclass
class _Stage:
    """One identity of the replay: what it changed, and which rewrite reproduced ``after``."""

    name: str
    state: dict
    cfg: Config
    touched: set[str]
    exact: dict | None
    refusal: PreconditionError | None
    rewrites: dict[str, list[str]] = field(default_factory=dict)  # wrong rewrite -> tensors it explains
    descriptions: dict[str, str] = field(default_factory=dict)
    recognised: bool = True


class _Replay:
    """Replays identities on ``before`` and tells which rewrite reproduces ``after``."""

    def __init__(self, after: Mapping[str, torch.Tensor], thresholds: Thresholds):
        self.after = after
        self.thresholds = thresholds
        self._wrong_cache: dict = {}  # (id(state), cfg) -> (state, {rewrite: candidates}), the last state's only
        self._lessons = Lessons()  # what each wrong rewrite records and touches, by (rewrite, cfg)
        #: The tensors a search is for (``None``: all): a stage whose exact rewrite touches none of them is not searched,
        #: unless its own wrong rewrites touch one of ``_orphans``.
        self._focus: set[str] | None = None
        #: Those of them no exact rewrite of the replay touched: a stage is searched where its own wrong rewrites touch one.
        self._orphans: set[str] = set()
        self._verdicts: dict = {}  # (name, id(tensor), id(reference), level) -> (tensor, reference, verdict)
        self._largest: dict = {}  # id(tensor) -> (tensor, largest |entry|)
        self._relative: dict = {}  # (name, id(tensor), id(reference)) -> (tensor, reference, relative difference)
        #: In half precision, the tensors rewritten with a recovered rotation and how their bound widens.
        self.widenings = Widenings(thresholds.dtype)

    def same(self, name: str, tensor, reference, level: str = "recognise") -> bool:
        """Whether ``tensor`` (``None``: absent) is ``after``'s tensor ``name``.

        Verdicts are cached by the tensors' identities: the replay compares the same tensors with
        ``after`` again and again, and big ones (the unembed) cost a pass each.
        """
        theirs = self.after.get(name)
        if tensor is None or theirs is None:
            return tensor is None and theirs is None
        if tensor.shape != theirs.shape:
            return False
        widening = self.widenings.of(tensor) if level == "exact" else []
        key = (name, id(tensor), id(reference), level, tuple(widening))
        hit = self._verdicts.get(key)
        if hit is None or hit[0] is not tensor or hit[1] is not reference:
            relative = self.relative(name, tensor, reference)
            verdict = relative <= getattr(self.thresholds, level)
            if level == "exact" and relative <= self.thresholds.recognise:  # entry by entry
                scale = max(self.largest(t) for t in (theirs, tensor) + ((reference,) if reference is not None else ()))
                verdict = relative == 0 or (
                    widened_certificate(theirs, tensor, scale, self.thresholds, widening) <= 1 if widening
                    else certified(theirs, tensor, scale, self.thresholds))
            hit = (tensor, reference, verdict)
            self._verdicts[key] = hit
        return hit[2]

    def relative(self, name: str, tensor: torch.Tensor, reference: torch.Tensor | None) -> float:
        """``after``'s tensor ``name`` against ``tensor`` (of its shape): the relative difference of
        :func:`_relative_difference`, computed once per pair of tensors."""
        key = (name, id(tensor), id(reference))
        hit = self._relative.get(key)
        if hit is None or hit[0] is not tensor or hit[1] is not reference:
            hit = (tensor, reference, _relative_difference(self.after[name], tensor, reference, self.largest)[1])
            self._relative[key] = hit
        return hit[2]

    def largest(self, tensor: torch.Tensor) -> float:
        """The tensor's largest |entry|, computed once per tensor."""
        hit = self._largest.get(id(tensor))
        if hit is None or hit[0] is not tensor:
            hit = (tensor, _largest_entry(tensor))
            self._largest[id(tensor)] = hit
        return hit[1]

    @staticmethod
    def touched(state: Mapping, result: Mapping) -> set[str]:
        """The tensors ``result`` adds, drops or replaces relative to ``state``.

        Transforms share the tensors they leave alone with their input, so a tensor that is not
        the same object counts as rewritten (even if its values happen to be equal).
        """
        return {name for name in set(state) | set(result) if state.get(name) is not result.get(name)}

    def gain(self, state: Mapping, candidate: _Candidate) -> tuple[int, set[str]]:
        """Tensors of ``after`` the candidate reproduces, minus those leaving ``state`` alone does."""
        touched = self.touched(state, candidate.state)
        won = sum(self.same(n, candidate.state.get(n), state.get(n)) for n in touched)
        kept = sum(self.same(n, state.get(n), candidate.state.get(n)) for n in touched)
        return won - kept, touched

    def wrong_rewrites(self, identity, state, cfg, refused: bool, records: tuple[str, ...] = ()) -> list[_Candidate]:
        """The identity's known wrong rewrites of ``state``: its rewrite regardless of the refusal
        when it refuses the model; otherwise its wrong rewrites and the wrong rewrites of other
        identities that record it as applied, and nothing that its exact rewrite, which
        records ``records``, does not (a wrong pipeline is no wrong version of one of its steps)."""
        if refused or identity.name in SYMMETRIES:  # a symmetry's tried only where the symmetry is: not in every search
            # each with its own parameter and, for a symmetry, with the one recovered from ``after``
            found, widen = (self.widenings.recovered(identity, state, self.after, cfg)
                            if identity.recover is not None and identity.wrong_rewrites_recovered else (None, None))
            return [
                candidate
                for name, wrong in identity.wrong_rewrites.items() if wrong.regardless == refused
                for function in (wrong.function, *([] if found is None else [widen(_given(wrong.function, found))]))
                for candidate in self._run(f"{identity.name}.{name}", identity.describe(name), function, state, cfg)
            ]
        allowed = {identity.name, *records}

        def qualifies(owner: str, record: tuple[str, ...]) -> bool:
            return owner == identity.name or identity.name in record and set(record) <= allowed

        return [candidate for owner, candidate in self._wrong_rewrites_of(state, cfg, qualifies)
                if qualifies(owner, candidate.cfg.applied[len(cfg.applied):])]

    def _wrong_rewrites_of(self, state, cfg, qualifies) -> list[tuple[str, _Candidate]]:
        """The known wrong rewrites of ``state`` that apply to it, each computed once per state (one
        state's at a time), but for those that recorded, on a state of the same config, identities
        for which ``qualifies(owner, record)`` is false: what a rewrite records is its code's, not
        its numbers'."""
        key = (id(state), cfg)
        if key not in self._wrong_cache:
            self._wrong_cache.clear()  # one state's candidates at a time: each holds rewritten copies of big tensors
            self._wrong_cache[key] = (state, {})
        computed = self._wrong_cache[key][1]
        out = []
        for identity in weight_identities():
            for name, wrong in identity.wrong_rewrites.items():
                rewrite, known = f"{identity.name}.{name}", self._lessons.known(f"{identity.name}.{name}", cfg)
                if known is None and not wrong.regardless and not qualifies(identity.name, ()):
                    known = self._lessons.learn(rewrite, wrong.function, state, cfg)  # where that is cheap
                if wrong.regardless or rewrite not in computed and known is not None and not qualifies(
                        identity.name, known.records):
                    continue
                if rewrite not in computed:
                    computed[rewrite] = list(self._run(rewrite, identity.describe(name), wrong.function, state, cfg))
                    self._lessons.note(rewrite, state, cfg, next(((c.state, c.cfg) for c in computed[rewrite]), None))
                out += [(identity.name, candidate) for candidate in computed[rewrite]]
        return out

    def _wrong_touches(self, identity, state, cfg, names) -> bool:
        """Whether one of ``identity``'s own wrong rewrites of ``state`` touches one of ``names``
        (in any layer), as learnt on the model cut to one layer."""
        return bool(names) and any(not wrong.regardless and (found := self._lessons.learn(
            f"{identity.name}.{name}", wrong.function, state, cfg)) is not None and found.touches_any(names)
                   for name, wrong in identity.wrong_rewrites.items())

    @staticmethod
    def _run(rewrite, description, function, state, cfg) -> Iterable[_Candidate]:
        try:
            result, result_cfg = function(state, cfg)
        except Exception:  # noqa: BLE001 - a wrong rewrite may not fit this model at all: then it explains nothing
            return
        yield _Candidate(rewrite, description, marked_as(state, result, result_cfg), result_cfg)

    def transform_of(self, identity, state: Mapping, cfg: Config):
        """The rewrite the replay applies for ``identity``: its transform, except for a symmetry,
        whose parameter (``Q``, the permutation) is recovered from ``state`` and ``after``
        (``Identity.recover``; its transform where none is)."""
        if identity.recover is None:
            return identity.transform
        found, widen = self.widenings.recovered(identity, state, self.after, cfg)
        return identity.transform if found is None else widen(_given(identity.with_parameters, found))

    def symmetric(self, before: dict, cfg: Config, replayed: tuple[list, dict, Config], residual: list[str]):
        """Recognise each symmetry of :data:`FIRST` (the residual rotation), then each identity that
        recovers its own parameter (:data:`RECOVERED`: permutations, per-head rotations, scales),
        applied after the replayed identities: ``(stages, final, final_cfg, residual)`` when that
        leaves fewer tensors unexplained than ``residual``, else ``None``.

        A symmetry of :data:`FIRST` is looked for from the replay's end and from its own starting
        point (``FirstRecovery.start``: for the rotation, the model with its norms made ``RMSPre``,
        the SliceGPT preparation): ``after`` with the parameter fitted from there undone
        (``FirstRecovery.undone``) is replayed blind, and the parameter recovered again from that
        replay's end, where the exact rewrite, or one of its registered wrong rewrites (then named
        with the tensors it explains), must reproduce ``after``. The starting point itself,
        rewritten, is tried too.
        """
        best = None
        for recovery in FIRST:
            for stages, state, state_cfg in self._routes(recovery, before, cfg, replayed):
                found = self._first(recovery, before, stages, state, state_cfg)
                if found and len(found[3]) < len(residual) and (best is None or len(found[3]) < len(best[3])):
                    best = found
        stages, state, state_cfg = best[:3] if best else replayed
        for identity in RECOVERED:
            # a recovered parameter makes its wrong rewrites comparable here: a mistake in this step is named
            stage = self.stage(identity, state, state_cfg, forced=False, search=identity.wrong_rewrites_recovered)
            if stage is not None:
                stages, state, state_cfg = stages + [stage], stage.state, stage.cfg
        found = self.residual(state, before)
        return (stages, state, state_cfg, found) if len(found) < len(residual) else None

    def _routes(self, recovery, before: dict, cfg: Config, replayed: tuple[list, dict, Config]) -> Iterator[tuple]:
        """The replays ``(stages, state, state_cfg)`` from whose end ``recovery``'s symmetry is
        recovered (see :meth:`symmetric`), a starting point's at a time."""
        final, final_cfg = replayed[1], replayed[2]
        starts = [(final, final_cfg)]
        try:
            starts.append(recovery.start(before, cfg))
        except PreconditionError:
            pass
        for start, start_cfg in starts:
            backs = recovery.undone(start, self.after, start_cfg, lambda name, tensor: self.same(name, tensor, None),
                                    self.thresholds.recognise)
            if backs is None:
                continue
            routes = [_Replay(back, self.thresholds).run(before, cfg, None, search=False) for back in backs]
            if start is not final:  # the start itself, rewritten rightly or by a known wrong rewrite
                routes.append(_Replay(start, self.thresholds).run(before, cfg, None, search=False))
            yield from routes

    def _first(self, recovery, before, stages, state, state_cfg):
        """``stages`` then the symmetry ``recovery`` recognises, with the parameter recovered from
        ``state`` to ``after`` (or a known wrong rewrite), after the identity its ``first`` names
        where it applies (an ``LNPre`` model switched to RMSNorm when ``Q 1`` is neither ``1`` nor
        ``-1``): ``(stages, final, final_cfg, residual)``, or ``None`` when it cannot apply."""
        step = recovery.first(state, self.after, state_cfg)
        if step is not None:
            switch = self.stage(step, state, state_cfg, forced=True, search=False)
            if switch is not None and switch.refusal is None:
                stages, state, state_cfg = stages + [switch], switch.state, switch.cfg
        stage = self.stage(recovery.performed(state_cfg), state, state_cfg, forced=True, search=True)
        if stage is None or stage.exact is None:
            return None
        return stages + [stage], stage.state, stage.cfg, self.residual(stage.state, before)

    def stage(self, identity, state: dict, cfg: Config, *, forced: bool, search: bool) -> _Stage | None:
        """Apply ``identity`` to ``state`` the way that best reproduces ``after``.

        The exact rewrite, or (``search``) whichever of it and the identity's known wrong rewrites
        reproduces most of ``after``, tensor by tensor. When the identity refuses the model, its
        rewrite applied regardless takes the exact rewrite's place. Returns ``None`` when the
        identity is not applied: it is already applied, or (``forced=False``) no rewrite of it
        brings the replay closer to ``after``.
        """
        refusal, records = None, ()
        try:
            exact_state, exact_cfg = self.transform_of(identity, state, cfg)(state, cfg)
            exact = _Candidate("exact", "", marked_as(exact_state, exact_state), exact_cfg)
            records = exact_cfg.applied[len(cfg.applied):]
        except AlreadyAppliedError:
            return None
        except PreconditionError as error:
            exact, refusal = None, error
        if exact is not None and identity.name not in records:
            return None  # a pipeline of other identities: the replay applies those one by one
        if search and exact is not None and self._focus is not None and not self.touched(state, exact.state) & self._focus \
                and not self._wrong_touches(identity, state, cfg, self._orphans):
            search = False  # no rewrite of it touches the tensors left unexplained: no wrong rewrite of it is looked for
        if exact is not None and not search:
            touched = self.touched(state, exact.state)
            if forced:  # recognition is judged by what is left at the end (and searched for if anything is)
                return _Stage(identity.name, exact.state, exact.cfg, touched, exact.state, None)
            if all(self.same(n, exact.state.get(n), state.get(n)) for n in touched):
                # it reproduces everything it rewrites: applied, if it changed anything ``after`` has
                if forced or any(not self.same(n, state.get(n), exact.state.get(n)) for n in touched):
                    return _Stage(identity.name, exact.state, exact.cfg, touched, exact.state, None)
                return None
        candidates = [exact] if exact is not None else []
        if refusal is not None or search:
            candidates += self.wrong_rewrites(identity, state, cfg, refused=refusal is not None, records=records)
        if not candidates:
            if forced:
                return _Stage(identity.name, marked_as(state, state), cfg, set(), None, refusal, recognised=False)
            return None
        gains = [self.gain(state, c) for c in candidates]
        best = max(range(len(candidates)), key=lambda i: (gains[i][0], -i))
        primary, (gain, touched) = candidates[best], gains[best]
        if gain <= 0 and not forced:
            return None
        if gain <= 0 and exact is not None:
            primary, touched = exact, gains[0][1]
        merged = dict(primary.state)  # the primary's tensors, and others' of the same names and shapes
        origin = {n: primary for n in touched}
        for name in touched:
            if self.same(name, merged.get(name), state.get(name)):
                continue
            for other in candidates:
                if other is not primary and set(other.state) == set(merged) and self.same(
                        name, other.state.get(name), state.get(name)) and self._may_name(
                        other, state, [name], lambda: self._refuted(other, state, primary.state)):
                    merged[name], origin[name] = other.state[name], other
                    break
        stage = _Stage(identity.name, marked_as(primary.state, merged), primary.cfg, touched,
                       exact.state if exact else None, refusal, recognised=gain > 0)
        self._record(stage, origin, primary, state)
        return stage

    def _record(self, stage: _Stage, origin: Mapping[str, _Candidate], primary: _Candidate, state: Mapping,
                names: Iterable[str] | None = None) -> None:
        """Name, in ``stage``, each wrong rewrite and the tensors where the replay departs from the
        exact rewrite because of it (tensors only one of them has included); only among ``names``
        when given."""
        exact = stage.exact
        if exact is None:  # the identity refuses the model: every tensor rewritten regardless counts
            for name in _natural_order(origin):
                if origin[name].rewrite != "exact":
                    self._name(stage, origin[name], [name])
            return
        if names is None:
            names = self.touched(state, exact) | self.touched(state, stage.state)
        for name in _natural_order(names):
            ours, theirs = stage.state.get(name), exact.get(name)
            if ours is theirs or ours is not None and theirs is not None and torch.equal(ours, theirs):
                continue
            if stage.name in SYMMETRIES and self.same(name, theirs, state.get(name)):
                continue  # a recovered parameter: the exact rewrite reproduces this tensor too (to rounding)
            candidate = origin.get(name, primary)
            if candidate.rewrite != "exact":
                self._name(stage, candidate, [name])

    @staticmethod
    def _may_name(candidate: _Candidate, state: Mapping, names: Iterable[str], refuted) -> bool:
        """Whether the wrong rewrite ``candidate`` may be named for ``after``'s tensors ``names``:
        where it changes one of them (from ``state``), or where none of the tensors it changes is
        among ``refuted()`` (those ``after`` does not bear out). A tensor it leaves as it was shows
        no mistake: when its mistake is refuted, such tensors explain nothing (``W_U`` centered over
        the vocabulary with ``b_U`` kept, an exact processing, is no ``W_U`` centered over
        ``d_model``, which keeps ``b_U`` too); a forgotten fold is named by the tensors it forgot."""
        changes = [n for n in names if not _equal(candidate.state.get(n), state.get(n))]
        return bool(changes) or all(_equal(candidate.state.get(n), state.get(n)) for n in refuted())

    def _refuted(self, candidate: _Candidate, state: Mapping, agreed: Mapping) -> list[str]:
        """The tensors ``candidate`` rewrites from ``state`` that neither are ``agreed``'s nor
        reproduce ``after``."""
        return [n for n in self.touched(state, candidate.state)
                if not _equal(candidate.state.get(n), agreed.get(n)) and not self.same(n, candidate.state.get(n), state.get(n))]

    @staticmethod
    def _name(stage: _Stage, candidate: _Candidate, names: list[str]) -> None:
        if names:
            listed = stage.rewrites.setdefault(candidate.rewrite, [])
            listed += [n for n in names if n not in listed]
            stage.descriptions[candidate.rewrite] = candidate.description

    def run(self, before: dict, cfg: Config, plan, *, search: bool) -> tuple[list[_Stage], dict, Config]:
        """Replay ``plan`` (identities, each forced) or, with ``plan=None``, every weight identity
        that brings the replay closer to ``after``, in registry order, until none does."""
        stages, state = [], before
        if plan is not None:
            for identity in plan:
                stage = self.stage(identity, state, cfg, forced=True, search=search)
                if stage is not None:
                    stages.append(stage)
                    state, cfg = stage.state, stage.cfg
            return stages, state, cfg
        pending = list(weight_identities())
        while True:
            accepted = False
            for identity in list(pending):
                stage = self.stage(identity, state, cfg, forced=False, search=search)
                if stage is not None:
                    stages.append(stage)
                    state, cfg = stage.state, stage.cfg
                    pending.remove(identity)
                    accepted = True
            if not accepted:
                return stages, state, cfg

    def explain(self, before: dict, cfg: Config, plan) -> tuple[list[_Stage], dict, Config, list[str]]:
        """The replay that best reproduces ``after`` and the tensors it leaves unexplained.

        First exact rewrites only; if anything is left, the known wrong rewrites compared with
        ``after`` where they are applied; if still anything is left, each wrong rewrite followed
        by the rest of the replay (it may be hidden under later rewrites of the same tensors,
        e.g. a wrongly folded unembed that is centered afterwards).
        """
        stages, final, final_cfg = self.run(before, cfg, plan, search=False)
        residual = self.residual(final, before)
        if not residual:
            return stages, final, final_cfg, residual
        if plan is None:  # a symmetry applied last: recovered, not replayed blind
            found = self.symmetric(before, cfg, (stages, final, final_cfg), residual)
            if found is not None:
                stages, final, final_cfg, residual = found
                if not residual:
                    return stages, final, final_cfg, residual
        self._focus = set(residual)
        self._orphans = self._focus - {name for stage in stages for name in stage.touched}
        searched = self.run(before, cfg, plan, search=True)
        searched_residual = self.residual(searched[1], before)
        if len(searched_residual) < len(residual):  # on a tie the exact replay explains as much
            (stages, final, final_cfg), residual = searched, searched_residual
        if residual:  # heads or neurons permuted by hand in some tensors, wherever in the composition
            found = self.permuted(final, final_cfg, residual, before)
            if found is not None:
                stages, final, residual = stages + [found], found.state, self.residual(found.state, before)
        improved = True
        while residual and improved:
            improved = False
            for i, stage in enumerate(stages):
                found = self._downstream_trial(before, cfg, plan, stages, i, residual)
                if found is not None:
                    stages, final, final_cfg, residual = found
                    improved = True
                    break
        return stages, final, final_cfg, residual

    def permuted(self, state: dict, cfg: Config, residual: list[str], before: Mapping) -> _Stage | None:
        """A stage that permutes the heads (or neurons) of ``residual`` tensors of ``state`` to
        reproduce ``after`` (each tensor's units matched to within the recognition threshold):
        ``permute_heads`` or ``permute_neurons``, exact where every tensor of those units in a
        layer moved alike, else the wrong rewrite ``.partial`` naming the tensors that moved
        (two heads' ``W_O`` swapped and nothing else); ``None`` when no tensor is so permuted."""
        moved: dict[tuple[str, int | None, tuple], list[str]] = {}
        for name in residual:
            unit = unit_axis(name, cfg)
            ours, theirs = state.get(name), self.after.get(name)
            if unit is None or ours is None or theirs is None or ours.shape != theirs.shape:
                continue
            perm = slice_permutation(ours, theirs, unit[1], self.thresholds.recognise)
            if perm is not None:
                layer = tensors_layer(name)
                moved.setdefault((unit[0], layer, perm), []).append(name)
        if not moved:
            return None
        out, rewrites = dict(state), {}
        for (kind, layer, perm), names in moved.items():
            for name in names:
                axis = unit_axis(name, cfg)[1]
                out[name] = state[name].index_select(axis, torch.tensor(perm, device=state[name].device))
            every = [n for n in state if tensors_layer(n) == layer and (u := unit_axis(n, cfg)) and u[0] == kind
                     and state[n].shape[u[1]] == len(perm) and n not in names]
            index = torch.tensor(perm)
            if not all(self.same(n, state[n].index_select(unit_axis(n, cfg)[1], index.to(state[n].device)), None)
                       for n in every):  # the others of these units stayed: a partial permutation
                rewrites.setdefault(kind, []).extend(names)
        kinds = {kind for kind, _l, _p in moved}
        identity = next(i for unit in ("heads", "neurons") if unit in kinds for i in RECOVERED if i.permutes == unit)
        touched = {n for names in moved.values() for n in names}
        out = marked_as(state, out)  # tensors of ``state`` permuted along their heads or neurons
        stage = _Stage(identity.name, out, cfg, touched, None if rewrites else out, None)
        for kind, names in rewrites.items():
            key = f"{identity.name}.partial"
            stage.rewrites.setdefault(key, []).extend(names)
            stage.descriptions[key] = (f"the {kind} of {', '.join(names)} permuted, and not the other tensors of the"
                                       f" same {kind}: each {kind[:-1]} must move with all its tensors")
        return stage

    def _downstream_trial(self, before, cfg, plan, stages, i, residual):
        """Try each wrong rewrite of stage ``i`` followed by the rest of the replay; return the first
        that leaves fewer tensors unexplained, as ``(stages, final, final_cfg, residual)``."""
        state, state_cfg = (before, cfg) if i == 0 else (stages[i - 1].state, stages[i - 1].cfg)
        stage = stages[i]
        identity = _identities.get_identity(stage.name)
        if stage.refusal is None and not stage.touched & set(residual) \
                and not self._wrong_touches(identity, state, state_cfg, residual):
            return None  # no rewrite of it touches the tensors left unexplained
        rest = None if plan is None else [_identities.get_identity(s.name) for s in stages[i + 1:]]
        records = () if stage.exact is None else stage.cfg.applied[len(state_cfg.applied):]
        for candidate in self.wrong_rewrites(identity, state, state_cfg, refused=stage.refusal is not None,
                                             records=records):
            base = stage.state
            if set(candidate.state) != set(base):
                continue
            changed = [n for n in candidate.state if not torch.equal(candidate.state[n], base[n])]
            while changed:
                tried = marked_as(base, dict(base, **{n: candidate.state[n] for n in changed}))
                trial = _Stage(stage.name, tried, stage.cfg,
                               stage.touched | self.touched(state, candidate.state), stage.exact, stage.refusal,
                               dict(stage.rewrites), dict(stage.descriptions), stage.recognised)
                later, final, final_cfg = self.run(trial.state, trial.cfg, rest, search=False)
                trial_residual = self.residual(final, before)
                dropped = [n for n in candidate.state if n not in changed and not _equal(candidate.state[n], base[n])]
                if len(trial_residual) < len(residual) and self._may_name(candidate, state, changed, lambda: dropped):
                    self._record(trial, dict.fromkeys(changed, candidate), candidate, state, changed)
                    return stages[:i] + [trial] + later, final, final_cfg, trial_residual
                # the wrong rewrite may be right for only some tensors: keep it only where it does not hurt
                kept = [n for n in changed if n not in set(trial_residual) - set(residual)]
                if len(kept) == len(changed):
                    break
                changed = kept
        return None

    def residual(self, state: Mapping, before: Mapping) -> list[str]:
        """The tensors of ``after`` that ``state`` does not reproduce up to rounding."""
        names = set(state) | set(self.after)
        return sorted(n for n in names if not self.same(n, state.get(n), before.get(n), "exact"))


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two tensors (``None``: absent) hold the same values."""
    return a is b or a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


def _given(function, parameter):
    """``function(state_dict, cfg, parameter)`` as a rewrite ``(state_dict, cfg) -> (state_dict, cfg)``."""
    return lambda state_dict, cfg: function(state_dict, cfg, parameter)

