"""Checking a processed checkpoint against its original, one block at a time.

:func:`check_processed` checks that one checkpoint is a valid processing of another without
loading either: the reference forward pass (:func:`~circuitmath._reference.block`) runs block by
block, keeping only the activations of the check tokens; the tolerance is
:func:`~circuitmath.testing.logprob_tolerance` with the rounding sensitivity of
:func:`~circuitmath.testing.rounding_sensitivity` measured as it does (the float64 forward pass
against one with every weight nudged by a unit roundoff and every LayerNorm's mean rounded apart,
plus the compute dtype's own rounding),
every weight converted to float64 one tensor at a time as the pass reads it; and the processed
tensors are compared one part at a time with the exact rewrite, replayed on the parts
:func:`~circuitmath.io.process_checkpoint` processes, with what the processed tensors show
beyond the recorded steps recovered a part at a time (:mod:`circuitmath._streaming_recovery`: the
residual rotation from the ends, each block's head rotations and migrated scales, and the widened
certificates of half precision, as in memory). Each part of the original is read once
(:class:`~circuitmath._streaming_parts.PartReader`: contiguous, in its own dtype) for both. A
GPT-2 or GPT-NeoX folder that keeps its final LayerNorm's bias ahead of the unembedding
(:func:`~circuitmath._stored.final_bias_kept`) has that bias certified as stored, in place of the
unembedding bias it is read back as (:meth:`_Tensors.kept_ratio`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ._checkpoint import Checkpoint
from ._diagnosis._replay import weight_identities
from ._config import Config
from ._compare import Comparison
from ._diagnosis._logprobs import sensitivity_window
from ._diagnosis._tensors import CERTIFICATE_ULPS, certificate, Thresholds
from ._diagnosis._unexplained import NEAR_ULPS, Change, ChangePasses, changes_of
from ._errors import InputError, StateDictError
from ._processing.pipeline import process_weights
from ._reference import check_tokens
from ._state import not_finite
from ._processing._parts import Parts
from ._processing.steps import KEYWORD_OF, STEPS
from ._streaming_forward import ForwardPass
from ._streaming_parts import PartReader, find_untouched, opened, replayed
from ._streaming_recovery import RECOVERABLE, Recovery
from ._stored import gives, kept_final_bias
from ._diagnosis._uncertain import widened_certificate
from ._compare import unit_roundoff, compute_dtype, logprob_tolerance

__all__ = ["check_processed", "StreamingReport"]

Progress = Callable[[int, int, str], None]


@dataclass
class StreamingReport:
    """The rows of :func:`check_processed`: ``log-probs`` (the two models' largest |Δ log-prob|
    against the tolerance) and ``tensors`` (the processed tensors against the exact rewrite)."""

    rows: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(row["status"] in ("holds", "not compared") for row in self.rows)

    def as_dicts(self) -> list[dict]:
        return [dict(row) for row in self.rows]

    def __str__(self) -> str:
        def number(value):
            return "-" if value is None else f"{value:.3g}"

        cells = [("check", "status", "max |Δ|", "tolerance")] + [
            (r["name"], r["status"], number(r["max_abs_error"]), number(r["tolerance"])) for r in self.rows
        ]
        widths = [max(len(row[i]) for row in cells) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + [""] + [f"{r['name']}: {r['explanation']}" for r in self.rows])


def _replay_keywords(before_cfg: Config, after_cfg: Config) -> dict[str, bool] | None:
    """The :func:`process_weights` keywords that turn ``before_cfg`` into ``after_cfg`` (``None``
    when ``after_cfg.applied`` is not ``before_cfg.applied`` followed by pipeline steps)."""
    done = before_cfg.applied
    if after_cfg.applied[: len(done)] != done or not all(i in KEYWORD_OF for i in after_cfg.applied[len(done):]):
        return None
    wanted = {KEYWORD_OF[i] for i in after_cfg.applied[len(done):]}
    return {keyword: keyword in wanted for keyword in STEPS}


def _recorded_recoverable(before_cfg: Config, after_cfg: Config) -> dict[str, bool] | None:
    """:func:`process_weights`' keywords, none set, where ``after_cfg.applied`` records beyond
    ``before_cfg.applied`` only steps the replay recovers (:mod:`._streaming_recovery`), in its
    order (``None`` otherwise)."""
    done, tail = before_cfg.applied, after_cfg.applied[len(before_cfg.applied):]
    if after_cfg.applied[: len(done)] != done or not tail or [n for n in RECOVERABLE if n in tail] != list(tail):
        return None
    return dict.fromkeys(STEPS, False)


def _replay_identities(before_cfg: Config, after_cfg: Config) -> tuple | None:
    """The registered weight identities ``after_cfg.applied`` records beyond ``before_cfg.applied``,
    in turn (``None`` when it records anything else): the replay where no :func:`process_weights`
    call records the same (one identity of a pipeline step alone, as in memory)."""
    done, applied = before_cfg.applied, after_cfg.applied
    weight = {identity.name: identity for identity in weight_identities(symmetries=True)}
    if applied[: len(done)] != done or not all(n in weight for n in applied[len(done):]):
        return None
    return tuple(weight[n] for n in applied[len(done):])


def _steps(plan) -> str:
    """The replay ``plan`` (keywords or identities) as the rows name it."""
    if isinstance(plan, dict):
        return f"{process_weights.__name__}({', '.join(k for k, v in plan.items() if v)})"
    return " then ".join(identity.name for identity in plan) or "no identity"


class _Tensors:
    """The ``tensors`` row, built a part at a time: ``after``'s tensors against the exact rewrite
    of ``before`` (``process_weights`` with ``keywords``, replayed on each part in ``compute``
    and left unrounded).

    A processed tensor equal, bit for bit, to the rewrite rounded to its dtype is within half a
    unit in the last place of it by that rounding; any other is certified entry by entry
    (:func:`~circuitmath._diagnosis._tensors.certificate`, in float64)."""

    def __init__(self, before: Checkpoint, after: Checkpoint, keywords):
        self.after_cfg, self.keywords = after.cfg, keywords
        self.thresholds = Thresholds.of(after.dtype, before.cfg)
        self.compute = compute_dtype(after.dtype)
        self.wrong: list[tuple[str, float]] = []
        self.count = self.equal = self.certified = 0
        self.worst, self.rounded = 0.0, False
        self.refused: str | None = None  # the replay's config differs from after's: nothing compared
        self.changes: list[Change] = []  # tensors off their certificate by more than a near miss
        self.judged: Comparison | None = None  # those changes in float64 (_judge_changes)
        #: the symmetries recovered from after beyond the steps it records (a process_weights call's)
        self.recovery = Recovery(keywords, before.cfg, after.dtype) if isinstance(keywords, dict) else None
        #: after's final LayerNorm bias kept ahead of W_U (stored), with before's final norm (w, b)
        self.kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.kept_certified = False
        c = kept_final_bias(after.native, after.cfg, after.tensors)
        if c is not None:
            ends = before.ends()
            if "ln_final.w" in ends and "ln_final.b" in ends:
                self.kept = (c, ends["ln_final.w"], ends["ln_final.b"])

    def plan(self, layer: int | None, theirs: dict):
        """The replay of part ``layer`` (``None``: the ends), ``theirs`` after's part."""
        return self.keywords if self.recovery is None else self.recovery.plan(layer, theirs)

    def forget(self) -> None:
        """Drops the widenings of the part last compared."""
        if self.recovery is not None:
            self.recovery.widenings.forget()

    def terms(self, tensor) -> list:
        """The widening of the replayed ``tensor``'s certificate (``[]``: none)."""
        return [] if self.recovery is None else self.recovery.widenings.of(tensor)

    def compare(self, replayed: dict, natives: dict, passed: set[int], theirs: dict) -> None:
        """``replayed`` (a part's rewrite; a tensor whose id is in ``passed`` is the one given,
        ``natives[name]`` as the checkpoint holds it) against ``theirs``, after's part."""
        kept = self.kept_ratio(replayed) if "unembed.b_U" in theirs else None
        for name in sorted(set(replayed) | set(theirs)):
            if name == "unembed.b_U" and kept is not None and kept * CERTIFICATE_ULPS <= NEAR_ULPS:
                self.count, self.certified = self.count + 1, self.certified + 1  # judged as stored (kept_ratio)
                if kept <= 1:
                    self.worst, self.kept_certified = max(self.worst, kept), True
                else:  # a near miss of the kept bias: refused as stored; a farther change is judged as b_U
                    self.worst = max(self.worst, kept)
                    self.wrong.append(("ln_final.b", kept))
                continue
            if name not in replayed or name not in theirs or replayed[name].shape != theirs[name].shape:
                self.wrong.append((name, math.inf))
                continue
            self.count += 1
            ours = natives[name] if id(replayed[name]) in passed and name in natives else replayed[name]
            processed = theirs[name].to(ours.device)
            if torch.equal(ours.to(processed.dtype), processed):
                self.equal += 1
                self.rounded = self.rounded or ours.dtype != processed.dtype  # then bounded by half a unit
                continue
            scale = max(float(ours.abs().max()), float(processed.abs().max())) if ours.numel() else 0.0
            terms = self.terms(replayed[name])
            ratio = (widened_certificate(processed, ours.to(self.compute), scale, self.thresholds, terms) if terms
                     else certificate(processed, ours.to(self.compute), scale, self.thresholds))
            self.certified += 1
            if ratio <= 1:
                self.worst = max(self.worst, ratio)
                continue
            change = changes_of([name], theirs, {name: ours.to(self.compute)}, self.thresholds,
                                {name: terms} if terms else None)[0]
            if change.near or not math.isfinite(ratio):  # a near miss: refused entry by entry
                self.worst = max(self.worst, ratio) if not math.isnan(ratio) else math.inf
                self.wrong.append((name, ratio))
            else:  # a change no identity explains: judged in float64 at the end (_judge_changes), its
                self.changes.append(replace(change, tensor=None, mask=None))  # tensor read again

    def kept_ratio(self, replayed: dict) -> float | None:
        """For after's final LayerNorm bias ``c`` kept ahead of W_U (``self.kept``; after's b_U,
        read back, is ``c W_U`` rounded once more, not a stored tensor): the certificate of the
        stored ``c`` against before's ``b / w``, where ``b / w`` through the replayed W_U gives the
        replayed b_U (:func:`~circuitmath._stored.gives`, to the compute dtype's rounding) and no
        gain is zero; ``None`` otherwise (b_U is then compared as read back). Each stored tensor
        of the layout is so held to the rewrite rounded once: ``c`` here, W_U as any other."""
        if self.kept is None or "unembed.W_U" not in replayed or "unembed.b_U" not in replayed:
            return None
        c, w, b = (t.double() for t in self.kept)
        if bool((w == 0).any()):
            return None
        expected = b / w
        if not gives(expected, replayed["unembed.W_U"], replayed["unembed.b_U"], torch.finfo(self.compute).eps):
            return None
        scale = max(float(expected.abs().max()), float(c.abs().max()))
        return certificate(self.kept[0], expected.to(self.compute), scale, self.thresholds)

    def row(self, after_dtype: torch.dtype) -> dict:
        row = {"name": "tensors", "kind": "rewrite", "max_abs_error": None, "tolerance": None}
        if self.refused:
            return row | {"status": "violated", "explanation": self.refused}
        steps = _steps(self.keywords)
        if self.recovery is not None and self.recovery.named:
            steps += "".join(f" then {name}" for name in self.recovery.named) + " (their parameters recovered from after)"
        bound = f"{CERTIFICATE_ULPS} unit in the last place of {after_dtype} (and {self.compute}'s rounding of the rewrite)"
        # bit for bit equal to the rounded rewrite: within half a unit, by that rounding
        worst = max(self.worst, 0.5 if self.rounded else 0.0)
        if self.wrong:
            listed = ", ".join(f"{name} ({ratio:.3g}x)" for name, ratio in self.wrong[:8])
            return row | {"status": "violated", "max_abs_error": worst, "tolerance": 1.0, "explanation": (
                f"{len(self.wrong)} of {self.count} tensors have entries further from {steps}"
                f" of before, computed in {self.compute}, than {bound}, and none more than {NEAR_ULPS} units: slight"
                f" changes of the rewrite; the worst entry, as a multiple of that bound:"
                f" {listed}{' ...' if len(self.wrong) > 8 else ''}")}
        certified = (f"; {self.certified - len(self.changes)} certified entry by entry, the worst entry at"
                     f" {self.worst:.3g} of the bound" if self.certified > len(self.changes) else "")
        judged = self.judged
        if judged is not None:
            changed = ", ".join(c.name for c in self.changes[:8]) + (" ..." if len(self.changes) > 8 else "")
            status = "holds" if judged.passed else "violated"
            return row | {"status": status, "max_abs_error": judged.max_abs_error, "tolerance": judged.tolerance,
                          "explanation": (
                f"{len(self.changes)} of {self.count} tensors ({changed}) differ from {steps}"
                f" of before by more than {NEAR_ULPS} units in the last place of {after_dtype}:"
                f" changes no identity explains, run in float64 against the rewrite, move the log-probs by"
                f" {judged.max_abs_error:.3g} {'<=' if judged.passed else '>'} {judged.tolerance:.3g}, the tolerance"
                f" of the rounding of the changed entries; the other tensors within {bound}{certified}")}
        kept = (", unembed.b_U as the final LayerNorm's bias kept ahead of W_U, as stored" if self.kept_certified else "")
        return row | {"status": "holds", "max_abs_error": worst, "tolerance": 1.0, "explanation": (
            f"{self.count} tensors within {bound} of {steps} of before, replayed part by"
            f" part in {self.compute} ({self.equal} equal to it rounded, bit for bit, so within half a unit{certified}{kept})")}


def _judge_changes(before: Checkpoint, after: Checkpoint, tensors: _Tensors, tokens: torch.Tensor,
                   device) -> Comparison:
    """The float64 comparison of :mod:`circuitmath._diagnosis._unexplained` for ``tensors``'
    changes: a second pass over the parts, each of ``before`` replayed as the first pass replayed
    it, beside it with the changed entries of ``after``'s part, read again (nothing of the first
    pass is kept but the names), on the first positions of ``tokens``
    (:func:`~circuitmath._diagnosis._logprobs.sensitivity_window`)."""
    rows, positions = sensitivity_window(tokens)
    passes = ChangePasses(tensors.after_cfg, tokens[:rows, :positions].to(device))
    changed = {c.name for c in tensors.changes}
    parts = Parts(PartReader(before, tensors.compute), before.cfg, tensors.compute, device, before.path)
    ends = ends_changes = None
    for layer in [None, *range(before.cfg.n_layers)]:
        theirs = after.ends() if layer is None else after.block(layer)
        rewrite = replayed(parts, layer, tensors.plan(layer, theirs))[0]
        names = [n for n in rewrite if n in changed]
        changes = {c.name: c for c in changes_of(names, {n: theirs[n].to(device) for n in names},
                                                 {n: rewrite[n].to(tensors.compute) for n in names}, tensors.thresholds,
                                                 {n: tensors.terms(rewrite[n]) for n in names})
                   if not c.near}
        tensors.forget()
        if layer is None:
            ends, ends_changes = rewrite, changes
            passes.start(ends, changes)
        else:
            passes.step(rewrite, layer, changes)
        del rewrite, theirs, changes
    return passes.finish(ends, ends_changes)


def _finite(part: dict[str, torch.Tensor], path) -> dict[str, torch.Tensor]:
    """``part``, refused (:class:`StateDictError` naming ``path`` and the tensor) where an entry
    is NaN or Inf: a forward pass over a few tokens reads some rows of the embeddings only."""
    bad = {name: count for name, tensor in part.items() if (count := not_finite(tensor))}
    if bad:
        raise StateDictError(f"{path}: " + "; ".join(f"{name} has {count} NaN or Inf entries" for name, count in bad.items()))
    return part


@dataclass
class _Walk:
    """The forward passes of one walk over the parts of ``before`` and ``after``: ``mine``,
    before's in the compute dtype ``run_in``, in float64 and in float64 nudged by the unit
    roundoff of ``coarse`` (the coarser of the two dtypes); ``theirs``, after's in ``run_in``;
    and the ends each keeps for the unembedding."""

    run_in: torch.dtype
    coarse: torch.dtype
    mine: tuple[ForwardPass, ForwardPass, ForwardPass]
    theirs: ForwardPass
    before_ends: dict = field(default_factory=dict)
    after_ends: dict = field(default_factory=dict)


def _processed_rows(before: Checkpoint, after: Checkpoint, tokens: torch.Tensor, progress, device=None) -> list[dict]:
    """The ``log-probs`` and ``tensors`` rows, from one pass over the parts: each part of
    ``before`` is read once (contiguous, in its own dtype), replayed for the tensors and run
    forward on the tokens, three times (in the compute dtype, in float64, and in float64 nudged),
    beside ``after``'s part run forward once; the replay and the passes run on ``device``."""
    device = torch.device("cpu") if device is None else torch.device(device)
    keywords = (_replay_keywords(before.cfg, after.cfg) or _recorded_recoverable(before.cfg, after.cfg)
                or _replay_identities(before.cfg, after.cfg))
    walked = _walked(before, after, tokens, progress, device, keywords)
    if walked is None:  # no pipeline call records after's config: a chain of identities does
        walked = _walked(before, after, tokens, progress, device, _replay_identities(before.cfg, after.cfg))
    tensors, walk = walked
    log_probs = _log_probs_row(before, after, tokens, walk)
    if tensors is None:
        return [log_probs, {"name": "tensors", "kind": "rewrite", "max_abs_error": None, "tolerance": None,
                            "status": "not compared", "explanation": (
                                f"after records {after.cfg.applied}, not {before.cfg.applied} followed by"
                                f" {process_weights.__name__} steps")}]
    if tensors.changes and not tensors.wrong and tensors.refused is None:
        tensors.judged = _judge_changes(before, after, tensors, tokens, device)
    return [log_probs, tensors.row(after.dtype)]


def _walked(before: Checkpoint, after: Checkpoint, tokens: torch.Tensor, progress, device: torch.device,
            keywords) -> tuple[_Tensors | None, _Walk] | None:
    """One walk over the parts: each part of ``after`` compared with ``before``'s replayed
    through ``keywords`` (:func:`process_weights`' keywords, or a tuple of identities; ``None``:
    no replay) and both run forward. Returns the tensors' comparison and the passes; ``None``
    when the replay through keywords gives another config than after's but a chain of
    identities may not (found on the ends, before any pass started)."""
    tensors = _Tensors(before, after, keywords) if keywords is not None else None
    # On the CPU the tensors the replay hands back unread come as zeros (compared as the
    # checkpoint holds them), and a block is converted once for the replay and the compute-dtype
    # pass; on another device the parts are converted there, as process_checkpoint does.
    on_cpu = tensors is not None and device.type == "cpu"
    rotated = tensors is not None and tensors.recovery is not None and \
        tensors.recovery.shows_rotation(before.ends()["embed.W_E"], after.ends()["embed.W_E"])
    untouched = ({layer is None: find_untouched(before.cfg, keywords, layer, tensors.compute) for layer in (None, 0)}
                 if on_cpu and isinstance(keywords, dict) and not rotated else None)  # a rotation reads every tensor
    reader = PartReader(before, tensors.compute if on_cpu else None, untouched, keep_all=True)
    parts = Parts(reader, before.cfg, tensors.compute if tensors else before.dtype, device, before.path)
    coarse = max((before.dtype, after.dtype), key=lambda d: torch.finfo(d).eps)
    run_in = compute_dtype(coarse)
    walk = _Walk(run_in, coarse, (ForwardPass(run_in, device=device), ForwardPass(torch.float64, device=device),
                                  ForwardPass(torch.float64, nudge=unit_roundoff(coarse), device=device)),
                 ForwardPass(run_in, device=device))
    total = before.cfg.n_layers + 1
    for layer in [None, *range(before.cfg.n_layers)]:
        processed = _finite(after.ends() if layer is None else after.block(layer), after.path)
        if tensors is not None and tensors.refused is None:  # the replay refuses what is not finite
            rewrite, rewrite_cfg, passed = replayed(parts, layer, tensors.plan(layer, processed))
            if layer is None and tensors.recovery is not None and tensors.recovery.on:
                rewrite_cfg = _recovered_cfg(tensors.recovery, before.cfg, after.cfg)
            if layer is None and rewrite_cfg != after.cfg and isinstance(keywords, dict) and \
                    _replay_identities(before.cfg, after.cfg) is not None:
                return None
            if layer is None and rewrite_cfg != after.cfg:
                tensors.refused = f"the replay of {keywords} gives {rewrite_cfg}, after has {after.cfg}"
            else:
                tensors.compare(rewrite, reader.natives, passed, processed)
                tensors.forget()
            del rewrite
        else:
            _finite(reader.ends() if layer is None else reader.block(layer), before.path)
        if layer is None:
            walk.theirs.start(processed, after.cfg, tokens)
            walk.after_ends = _kept_for_unembedding(processed)
        else:
            walk.theirs.step(processed, layer, after.cfg)
        del processed  # its pages are mapped: gone before the three passes over before's part
        _run_before(walk, reader, layer, before.cfg, tokens, tensors.compute if tensors is not None else None)
        if progress:
            progress(1 if layer is None else layer + 2, total, "embedding and unembedding" if layer is None else f"block {layer}")
    return tensors, walk


def _recovered_cfg(recovery: Recovery, before_cfg: Config, after_cfg: Config) -> Config:
    """The config the ends' replay is held to where ``recovery`` recovered steps: the recorded
    steps' (``recovery.replayed_cfg``), recording what ``after_cfg`` records beyond ``before_cfg``
    where those are steps the replay recovers and include every one recovered at the ends."""
    cfg = recovery.replayed_cfg.replace(n_layers=before_cfg.n_layers)
    tail = after_cfg.applied[len(before_cfg.applied):]
    if _recorded_recoverable(before_cfg, after_cfg) is not None and set(recovery.named) <= set(tail):
        cfg = cfg.replace(applied=after_cfg.applied)
    return cfg


def _kept_for_unembedding(ends: dict) -> dict:
    """The ends a pass keeps for the unembedding; the embeddings go (their pages are mapped, some read)."""
    return {n: t for n, t in ends.items() if not n.startswith(("embed.", "pos_embed."))}


def _run_before(walk: _Walk, reader: PartReader, layer: int | None, cfg: Config, tokens: torch.Tensor,
                compute: torch.dtype | None) -> None:
    """Before's passes of ``walk`` started on the ends (``layer`` ``None``) or advanced by block
    ``layer``, on the part ``reader`` read last (the pass in the ``compute`` dtype reads a
    block's tensors as converted for the replay)."""
    natives = reader.natives
    handed = {n: natives[n] if n in reader.stand_ins else t for n, t in reader.handed.items()}
    converted = [handed if handed and compute is not None and p.dtype == compute else natives for p in walk.mine]
    reader.handed = {}
    for p, weights in zip(walk.mine, converted):
        if layer is None:
            p.start(weights, cfg, tokens)
        else:
            p.step(weights, layer, cfg)
    if layer is None:
        walk.before_ends = _kept_for_unembedding(natives)


def _log_probs_row(before: Checkpoint, after: Checkpoint, tokens: torch.Tensor, walk: _Walk) -> dict:
    """The ``log-probs`` row: the passes of ``walk`` compared within the tolerance of the
    rounding sensitivity they measure."""
    a, reference, moved = (p.log_probs(walk.before_ends, before.cfg).double() for p in walk.mine)
    b = walk.theirs.log_probs(walk.after_ends, after.cfg).double()
    sensitivity = float((reference - moved).abs().max())
    if walk.run_in != torch.float64:
        sensitivity += float((a - reference).abs().max())
    differences = (a - b).abs()
    difference = float(differences.max())
    where = [int(i) for i in torch.unravel_index(differences.argmax(), differences.shape)]
    tolerance = logprob_tolerance(before.cfg, walk.coarse, float(a.abs().max()), sensitivity)
    holds = difference <= tolerance
    return {
        "name": "log-probs", "kind": "comparison", "status": "holds" if holds else "violated",
        "max_abs_error": difference, "tolerance": tolerance, "where": where,
        "explanation": f"before -> after on {tokens.shape[0]} x {tokens.shape[1]} tokens, block by block in {walk.run_in}"
        f" (rounding sensitivity {sensitivity:.3g}, measured block by block in float64)"
        + ("" if holds else ": the processed model computes a different function"),
    }


def check_processed(
    before, after, config=None, *, tokens, progress: Progress | None = None, device=None
) -> StreamingReport:
    """Check that the checkpoint ``after`` is a valid processing of ``before``, reading each
    a block at a time (anything :func:`~circuitmath.io.open_checkpoint` opens; ``config`` is
    ``before``'s when its files do not carry one).

    ``tokens`` is ``[batch, pos]`` or a function of ``before``'s config that returns them. Two
    rows: ``log-probs``, the largest |Δ log-prob| of the two models with the tolerance of
    :func:`~circuitmath.testing.compare_log_probs` (see the module's docstring), and
    ``tensors``, every processed tensor against :func:`~circuitmath.process_weights` of
    ``before`` with the steps ``after`` records (or the registered identities it records, in
    turn), replayed part by part, and judged as in memory
    (:mod:`circuitmath._diagnosis._unexplained`: a near miss fails, a change no identity explains
    is run in float64 against the replay, a part at a time) (``"not compared"`` when ``after``
    records anything else). ``progress(done, total, what)`` is
    called after each block. ``device``: where the replay and the passes run (default the CPU).
    """
    before, after = opened(before, config), opened(after)
    shape = ("n_layers", "d_model", "n_heads", "d_head", "d_vocab", "n_ctx")
    differ = [f"{n} {getattr(before.cfg, n)} vs {getattr(after.cfg, n)}" for n in shape if getattr(before.cfg, n) != getattr(after.cfg, n)]
    if differ:
        raise InputError(f"{after.path} is not a processing of {before.path}: {', '.join(differ)}")
    tokens = tokens(before.cfg) if callable(tokens) else tokens
    tokens = check_tokens(before.cfg, tokens)
    with torch.no_grad():
        return StreamingReport(_processed_rows(before, after, tokens, progress, device))
