"""``check MODEL`` on a checkpoint folder: every weight identity checked one layer at a time.

:func:`check_model_streaming` gives the rows of :func:`~circuitmath._diagnosis.check_model`
(one per identity of ``weight_identities(symmetries=True)``: holds, violated, or not applicable
with the precondition it breaks) without loading the model. Each part of the checkpoint (the
embedding and unembedding, each block) is read, contiguous in its own dtype, once per pass
(the ends twice: for the embedding, and for the unembedding at the end), and every identity
still applicable runs its preparation and its transform on it, in the model's dtype as in
memory (:meth:`~circuitmath._processing._parts.Parts.run`: every identity is local, so a part's
tensors are the whole model's; the tests find the in-memory |Δ log-prob|, within 1e-3 of the tolerance); two
forward passes per identity (the prepared model and its transform, in
:func:`~circuitmath.testing.compute_dtype`) advance by that part, keeping only the check
tokens' activations. Below float64, with ``exact`` (as in memory, always:
:mod:`~circuitmath._diagnosis._exact`), each identity is prepared and transformed in float64
too, from the part converted, with two more passes on the sensitivity tokens, and each part's
own written tensors are certified against the float64 rewrite; the float64 chain decides on the
whole model's writers in float64 (its own recording, :attr:`_Run.writers64`), so that it
refuses where the in-memory chain does. Peak
memory: one part, read and converted, and one identity's prepared and transformed part, in the
model's dtype and in float64, with its temporaries. The tolerance is :func:`~circuitmath.testing.logprob_tolerance` with the
rounding sensitivity measured as :class:`~circuitmath._streaming_forward.ForwardPass` measures it for
``check --processed`` (float64 against float64 nudged, plus the compute dtype's own rounding),
on the tokens of :func:`~circuitmath._diagnosis._logprobs.sensitivity_window`, as the in-memory check.

Two things are model-wide. The random draws of the symmetries (the rotation ``Q``, the
permutations) are functions of the config's shapes, the same in every part. The decision of
:func:`~circuitmath.layer_norm_to_rms_norm` that the writes are centered measures each writer's
mean against the largest entry of any writer of the whole model
(:func:`~circuitmath._processing.norms.writer_scale`), and its refusal counts the uncentered
writers of the whole model and names the worst: for the identities that reach it, a first pass
over the parts records every writer's mean and that largest entry, and the main pass gives them
to every part (the part's :attr:`~circuitmath._state.Validated.writers`), so each part decides, and
the first refuses, as the whole model does in memory. And a step that ``process_weights`` is
asked to apply where it can applies to the whole model only where it applies to every part:
when a block applies other steps than the ends, the steps one of them leaves out are left out of
every part (the identity's ``with_parameters`` takes the steps left out) and that identity's
passes start again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._checkpoint import Checkpoint
from ._compare import unit_roundoff, compute_dtype
from ._config import Config
from ._diagnosis import Diagnosis, Finding, weight_identities
from ._diagnosis._exact import float64_chain, identity_row, in_float64, rewrite_mismatches
from ._diagnosis._logprobs import compared, sensitivity_window
from ._diagnosis._tensors import Thresholds
from ._errors import PreconditionError
from ._processing._parts import Parts
from ._processing.steps import steps_between
from ._reference import check_tokens
from ._state import validate_state_dict, vouched
from ._processing._memory import in_memory
from ._streaming_parts import opened
from ._streaming_forward import ForwardPass

__all__ = ["check_model_streaming"]

Progress = Callable[[int, int, str], None]


class _OnePart:
    """A checkpoint as a source of parts that keeps the last part read (contiguous, in the
    checkpoint's dtype) for every identity to take in turn: one part in memory at a time."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint, self.which, self.tensors = checkpoint, None, {}

    def _part(self, which, read) -> dict[str, torch.Tensor]:
        if which != self.which:
            self.which, self.tensors = None, {}  # the last part goes before the next is read
            self.tensors, self.which = {n: in_memory(t) for n, t in read().items()}, which
        return self.tensors

    def ends(self) -> dict[str, torch.Tensor]:
        return self._part("ends", self.checkpoint.ends)

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        return self._part(layer, lambda: self.checkpoint.block(layer))

    def drop(self) -> None:
        self.which, self.tensors = None, {}


class _ModelWriters:
    """The whole model's writers (:func:`~circuitmath._processing.norms.writer_means`, in its
    names and order, and :func:`~circuitmath._processing.norms.writer_scale`), for each call of
    :func:`~circuitmath._processing.norms.uncentered_writers` in one identity's preparation and
    transform (in order). ``recording``: each part's own writers are kept (the largest scale over
    parts) and the decision deferred (no writer counts as uncentered); afterwards each call, on
    any part, is answered with the whole model's, so every part decides, and refuses, as the
    whole model does in memory."""

    def __init__(self):
        self.means: list[dict[str, tuple[float, float]]] = []
        self.largest: list[float] = []
        self.recording, self.calls, self.layer = True, 0, None

    def start(self, layer: int | None) -> None:
        """Part ``layer`` (``None``: the ends) is transformed next."""
        self.calls, self.layer = 0, layer

    def __call__(self, part_means: dict, part_scale: float) -> tuple[dict, float]:
        i, self.calls = self.calls, self.calls + 1
        if not self.recording:
            return self.means[i], self.largest[i]
        if i == len(self.largest):
            self.means.append({})
            self.largest.append(part_scale)
        self.largest[i] = max(self.largest[i], part_scale)
        # the part's own writers, in the whole model's names (a block's are its blocks.0.*; the
        # rest of it are stand-ins): the ends' first, then each block's, as writers(cfg) lists them
        prefix = "blocks.0."
        self.means[i].update(
            {n: m for n, m in part_means.items() if not n.startswith("blocks.")} if self.layer is None else
            {f"blocks.{self.layer}.{n[len(prefix):]}": m for n, m in part_means.items() if n.startswith(prefix)})
        return {}, part_scale


@dataclass
class _Run:
    """One identity checked along the parts: the prepared model's and the transform's forward
    passes, and the refusal, when a part refuses."""

    identity: object
    prepared: ForwardPass
    processed: ForwardPass
    writers: _ModelWriters = field(default_factory=_ModelWriters)
    #: the same for the identity in float64 (its own decisions: see :mod:`~circuitmath._diagnosis._exact`)
    writers64: _ModelWriters = field(default_factory=_ModelWriters)
    refusal: PreconditionError | None = None
    #: the steps of process_weights left to apply where they can that some part does not apply:
    #: left out of every part (by the identity's ``with_parameters``)
    left_out: frozenset[str] = frozenset()
    #: what the transform of the ends applied, in the passes under way; ``None`` once a block
    #: applied otherwise (the passes then start again, with ``left_out`` grown)
    applied: tuple[str, ...] | None = None
    #: the first refusal of a block in the recording pass, with the decisions made before it
    recorded: tuple[int, PreconditionError] | None = None
    #: below float64 (see :mod:`~circuitmath._diagnosis._exact`): the float64 passes of the
    #: prepared model and its transform on the sensitivity tokens, the certificate's thresholds,
    #: and each part's tensors that fail it (by part: ``None``, the ends, then each layer)
    exact: tuple[ForwardPass, ForwardPass] | None = None
    thresholds: Thresholds | None = None
    mismatches: dict = field(default_factory=dict)

    def transformed(self, parts: Parts, layer: int | None) -> tuple[dict, Config, dict, Config]:
        """Part ``layer`` (``None``: the ends) prepared and transformed, in the part's names.
        Below float64, outside the recording pass, followed by the same in float64 (from the
        part converted first) and, kept in :attr:`mismatches`, the part's own tensors that fail
        their certificate."""
        got = []

        def transform(state_dict, cfg):
            # the part (validated before its first use) decides on the whole model's writers
            self.writers.start(layer)
            state64 = None if self.exact is None else vouched(
                in_float64(state_dict), cfg, torch.float64, writers=self.writers64)
            state_dict = vouched(state_dict, cfg, writers=self.writers)
            prepared, prepared_cfg = self.identity.prepared(state_dict, cfg)
            after_prepare = self.writers.calls
            processed, processed_cfg = self.applied_as_whole().transform(prepared, prepared_cfg)
            got.extend((prepared, prepared_cfg, processed, processed_cfg))
            if state64 is not None:
                # float64 decides on the whole model's writers in float64 (recorded as the model's are)
                self.writers64.start(layer)
                chain = float64_chain(self.applied_as_whole(), state64, cfg)
                if not self.writers.recording or not self.writers.largest:  # not the recording pass
                    if chain is None:
                        self.exact = None  # refused in float64: the identity is checked in the model's dtype alone
                    else:
                        got.extend(chain)
                    self.writers.calls = after_prepare  # the float64 rewrite decides as the model's dtype did
                    self.mismatches[layer] = rewrite_mismatches(
                        self.identity, prepared, prepared_cfg, processed, chain, self.thresholds, _own(layer))
            return {}, processed_cfg

        parts.run(layer, transform)
        return tuple(got)

    def applied_as_whole(self):
        """The identity as the whole model applies it: with the steps of :attr:`left_out` left
        out (its ``with_parameters``; only ``process_weights`` leaves steps out where a part's
        weights decide)."""
        return self.identity if not self.left_out else _LeavingOut(self.identity, self.left_out)

    def agrees(self, processed_cfg: Config) -> bool:
        """Whether a block's transform applied what the ends' did; if not, the steps applied by
        one and not the other join ``left_out`` (the whole model leaves them out) and the passes
        must start again."""
        if processed_cfg.applied == self.applied:
            return True
        self.left_out |= steps_between(processed_cfg.applied, self.applied)
        self.applied = None
        return False


class _LeavingOut:
    """``identity`` prepared as it is, and transformed with the steps ``left_out`` left out."""

    def __init__(self, identity, left_out: frozenset[str]):
        if identity.with_parameters is None:  # cannot happen: only process_weights' steps may differ by part
            raise RuntimeError(f"{identity.name}: parts of the model applied other steps")
        self.identity, self.left_out = identity, left_out

    def prepared(self, state_dict, cfg):
        return self.identity.prepared(state_dict, cfg)

    def transform(self, state_dict, cfg):
        return self.identity.with_parameters(state_dict, cfg, self.left_out)


def _own(layer: int | None) -> Callable[[str], str | None]:
    """A part's own tensor names in the whole model's names (``None`` for a block part's stand-ins)."""
    if layer is None:
        return lambda name: name
    prefix = "blocks.0."
    return lambda name: f"blocks.{layer}.{name[len(prefix):]}" if name.startswith(prefix) else None


class _IdentityChecks:
    """Every identity of ``weight_identities(symmetries=True)`` checked along the parts of
    ``checkpoint`` (see the module's docstring): one :class:`_Run` each, the reference passes,
    and the parts validated so far."""

    def __init__(self, checkpoint: Checkpoint, tokens: torch.Tensor, progress: Progress | None, device, exact: bool):
        self.cfg, self.dtype, self.tokens = checkpoint.cfg, checkpoint.dtype, tokens
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.source = _OnePart(checkpoint)
        self.parts = Parts(self.source, self.cfg, self.dtype, self.device, checkpoint.path)
        self.run_in = compute_dtype(self.dtype)
        self.runs = [_Run(identity, self._pass(self.run_in), self._pass(self.run_in))
                     for identity in weight_identities(symmetries=True)]
        rows, positions = sensitivity_window(tokens)
        self.sensitivity_tokens = tokens[:rows, :positions]
        self.exact = exact and self.dtype != torch.float64
        if self.exact:  # each identity in float64 too, and its rewrite certified (see _diagnosis._exact)
            for run in self.runs:
                run.exact = (self._pass(torch.float64), self._pass(torch.float64))
                run.thresholds = Thresholds.of(self.dtype, self.cfg)
        self.report = progress or (lambda done, total, what: None)
        self.validated: set = set()
        self.done, self.total = 0, self.cfg.n_layers + 2

    def _pass(self, dtype: torch.dtype, nudge: float = 0.0) -> ForwardPass:
        return ForwardPass(dtype, nudge=nudge, device=self.device)

    def progressed(self, what: str) -> None:
        self.done += 1
        self.report(self.done, self.total, what)

    def validate(self, layer: int | None) -> None:
        """Part ``layer`` validated once, before its first use: bad input names the file and the tensor."""
        if layer not in self.validated:
            self.parts.run(layer, lambda sd, part_cfg: (validate_state_dict(sd, part_cfg), ({}, part_cfg))[1])
            self.validated.add(layer)

    def transformed(self, run: _Run, layer: int | None) -> tuple | None:
        """The part prepared and transformed (``None``, and ``run.refusal`` set, on a refusal)."""
        self.validate(layer)
        try:
            return run.transformed(self.parts, layer)
        except PreconditionError as error:
            # kept without its traceback, whose frames hold the part's tensors
            run.refusal = error.with_traceback(None)
            run.refusal.__context__ = None
            return None

    def start(self, run: _Run, got) -> None:
        """``run``'s passes started on the ends it transformed (``got``)."""
        prepared, prepared_cfg, processed, processed_cfg = got[:4]
        run.prepared.start(prepared, prepared_cfg, self.tokens)
        run.processed.start(processed, processed_cfg, self.tokens)
        for p, (state, state_cfg) in zip(run.exact or (), (got[4:6], got[6:8])):
            p.start(state, state_cfg, self.sensitivity_tokens)
        run.applied = processed_cfg.applied

    def step(self, run: _Run, layer: int) -> None:
        """``run``'s passes advanced by block ``layer``, unless it refuses or applies other steps."""
        if run.refusal is None and run.applied is not None and (got := self.transformed(run, layer)) is not None:
            prepared, prepared_cfg, processed, processed_cfg = got[:4]
            if run.agrees(processed_cfg):
                run.prepared.step(prepared, 0, prepared_cfg)
                run.processed.step(processed, 0, processed_cfg)
                for p, (state, state_cfg) in zip(run.exact or (), (got[4:6], got[6:8])):
                    p.step(state, 0, state_cfg)

    def try_on_the_ends(self) -> list[_Run]:
        """Which identities apply, as in memory: each tried on the ends; when they refuse, on
        block 0 too, whose refusal comes first (a block part has the whole model's config, the
        ends as stand-ins: it meets the preconditions in a whole model's order). Those that
        reach layer_norm_to_rms_norm's decision are returned (:meth:`record_writers` decides
        them); the others start their passes on the ends at once."""
        for run in self.runs:
            got = self.transformed(run, None)
            if got is None and self.cfg.n_layers and not run.writers.largest:
                refusal, run.refusal = run.refusal, None
                if self.transformed(run, 0) is not None:
                    run.refusal = refusal
            elif got is not None and not run.writers.largest:
                self.start(run, got)
            got = None
        recording = [run for run in self.runs if run.writers.largest]
        self.total += self.cfg.n_layers if recording else 0
        self.progressed("embedding and unembedding")
        return recording

    def record_writers(self, recording: list[_Run]) -> None:
        """The identities of ``recording`` (every part takes the same steps) record on every part
        its writers' means and largest entry, the decision deferred, and are decided again on the
        ends with the whole model's: a refusal there is the whole model's, unless a block refused
        in the first pass before reaching that decision (in memory its refusal comes first)."""
        for layer in range(self.cfg.n_layers) if recording else ():
            for run in recording:
                if self.transformed(run, layer) is None and run.recorded is None:
                    run.recorded = run.writers.calls, run.refusal
            self.progressed(f"writers, block {layer}")
        for run in recording:
            run.writers.recording = run.writers64.recording = False
            run.refusal = None
            if (got := self.transformed(run, None)) is not None:
                self.start(run, got)
            elif run.recorded and run.recorded[0] < run.writers.calls:
                run.refusal = run.recorded[1]  # a block refused before the decision that the ends refuse
            got = run.recorded = None

    def main_pass(self) -> list[ForwardPass]:
        """Each identity's passes advanced a part at a time, with the reference passes of the
        original on the sensitivity tokens (float64, float64 nudged, the compute dtype, and
        float64's own sensitivity for the identities checked in float64), which it returns."""
        reference = [self._pass(torch.float64), self._pass(torch.float64, unit_roundoff(self.dtype))]
        if self.run_in != torch.float64:
            reference.append(self._pass(self.run_in))
        if self.exact:
            reference.append(self._pass(torch.float64, unit_roundoff(torch.float64)))
        for p in reference:
            p.start(self.source.ends(), self.cfg, self.sensitivity_tokens)
        for layer in range(self.cfg.n_layers):
            for run in self.runs:
                self.step(run, layer)
            self.validate(layer)  # when every identity refused, still checked
            for p in reference:
                p.step(self.source.block(layer), layer, self.cfg)
            self.progressed(f"block {layer}")
        return reference

    def again_where_parts_disagree(self) -> None:
        """The passes of each identity whose parts applied other steps of process_weights started
        again without them: the whole model leaves them out (rare: a condition on some block's weights)."""
        while again := [run for run in self.runs if run.refusal is None and run.applied is None]:
            for run in again:
                if (got := self.transformed(run, None)) is not None:
                    self.start(run, got)
                got = None
            for layer in range(self.cfg.n_layers):
                for run in again:
                    self.step(run, layer)

    def findings(self, reference: list[ForwardPass]) -> list[Finding]:
        """One row per identity, its passes finished on the ends and compared within the
        tolerance of the rounding sensitivity that the ``reference`` passes measure."""
        exact_lp, nudged, *others = (p.log_probs(self.source.ends(), self.cfg).double() for p in reference)
        sensitivity = float((exact_lp - nudged).abs().max())
        if self.run_in != torch.float64:
            sensitivity += float((others[0] - exact_lp).abs().max())
        sensitivity64 = float((others[-1] - exact_lp).abs().max()) if self.exact else None
        return [self._row(run, sensitivity, sensitivity64) for run in self.runs]

    def _row(self, run: _Run, sensitivity: float, sensitivity64: float | None) -> Finding:
        got = self.transformed(run, None) if run.refusal is None else None
        if got is None:
            return Finding(run.identity.name, "identity", False, "not applicable", reason=str(run.refusal),
                           precondition=run.refusal.precondition)
        passes = (run.prepared, run.processed, *(run.exact or ()))
        first, second, *in_float64_too = (
            p.log_probs(state, state_cfg).double() for p, state, state_cfg in zip(passes, got[0::2], got[1::2]))
        got = None
        comparison, float64 = compared(first, second, self.cfg, self.dtype, sensitivity), None
        if in_float64_too:
            float64 = compared(*in_float64_too, self.cfg, torch.float64, sensitivity64)
        mismatches = tuple(m for layer in [None, *range(self.cfg.n_layers)] for m in run.mismatches.get(layer, ()))
        return identity_row(run.identity.name, comparison, float64, mismatches,
                            refused_in_float64=self.exact and run.exact is None)


def _identity_rows(checkpoint: Checkpoint, tokens: torch.Tensor, progress: Progress | None, device,
                   exact: bool) -> list[Finding]:
    """The rows of :func:`check_model_streaming`, one per identity, in the registry's order."""
    checks = _IdentityChecks(checkpoint, tokens, progress, device, exact)
    checks.record_writers(checks.try_on_the_ends())
    reference = checks.main_pass()
    checks.again_where_parts_disagree()
    findings = checks.findings(reference)
    checks.source.drop()
    checks.report(checks.total, checks.total, "done")
    return findings


def check_model_streaming(model, config=None, *, tokens, progress: Progress | None = None, device=None,
                          exact: bool = False) -> Diagnosis:
    """:func:`~circuitmath._diagnosis.check_model` of a checkpoint (anything
    :func:`~circuitmath.io.open_checkpoint` opens; ``config`` when its files carry none), read
    one part at a time (see the module's docstring). ``tokens`` is ``[batch, pos]`` or a function
    of the model's config returning them; ``progress(done, total, what)`` is called after each
    part; ``device``: where the transforms and the passes run (default the CPU).

    ``exact``: below float64, also check each identity in float64 and certify its rewrite, as
    the in-memory check always does (:mod:`~circuitmath._diagnosis._exact`). Off by default:
    each part is then held in float64 as well, several times over, and every transform runs
    again in float64 (several times the memory and the time of the check without it)."""
    checkpoint = opened(model, config)
    tokens = tokens(checkpoint.cfg) if callable(tokens) else tokens
    tokens = check_tokens(checkpoint.cfg, tokens)
    with torch.no_grad():
        return Diagnosis(tuple(_identity_rows(checkpoint, tokens, progress, device, exact)))
