"""Checking a processed checkpoint against its original, one block at a time.

:func:`check_processed` checks that one checkpoint is a valid processing of another without
loading either: the reference forward pass (:func:`~circuitmath._reference.block`) runs block by
block, keeping only the activations of the check tokens; the tolerance is
:func:`~circuitmath.testing.logprob_tolerance` with the rounding sensitivity of
:func:`~circuitmath.testing.rounding_sensitivity` measured as it does (the float64 forward pass
against one with every weight nudged by a unit roundoff, plus the compute dtype's own rounding),
every weight converted to float64 one tensor at a time as the pass reads it; and the processed
tensors are compared one part at a time with the exact rewrite, replayed by
:func:`~circuitmath.io.process_checkpoint`'s parts.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ._checkpoint import Checkpoint
from ._config import Config
from ._diagnosis._tensors import CERTIFICATE_ULPS, _certificate, _Thresholds
from ._errors import InputError
from ._processing.pipeline import process_weights
from ._reference import block, check_tokens, embed, unembed
from ._streaming import KEYWORD_OF, STEPS, checkpoint_parts, opened
from ._compare import _unit_roundoff, compute_dtype, logprob_tolerance

__all__ = ["check_processed", "StreamingReport"]

Progress = Callable[[int, int, str], None]


class _Weights(Mapping):
    """A part's tensors as one forward pass reads them: converted to ``dtype`` when looked up
    (nothing kept), and with ``nudge`` each multiplied by ``1 + nudge * xi``, ``xi`` standard
    normal drawn from a generator seeded by the name (as :func:`rounding_sensitivity` nudges,
    one tensor at a time)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, nudge: float = 0.0,
                 seeds: Mapping[str, int] | None = None, device: torch.device | None = None):
        self.tensors, self.dtype, self.nudge, self.seeds = tensors, dtype, nudge, seeds or {}
        self.device = device

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        converted = tensor.to(device=self.device, dtype=self.dtype)
        if not self.nudge:
            return converted
        g = torch.Generator().manual_seed(self.seeds.get(name, 0) + zlib.crc32(name.encode()))
        noise = torch.randn(tensor.shape, generator=g, dtype=torch.float32).mul_(self.nudge).mul_(tensor.float())
        return converted + noise.to(converted.device)  # drawn on the CPU: the same noise on every device

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


#: Vocabulary entries per slice of the unembedding: each slice of ``W_U`` is converted to
#: float64 on its own (a 7B model's whole ``W_U`` in float64 is 1 GiB).
UNEMBED_COLUMNS = 4096


@dataclass
class _Pass:
    """One forward pass of a checkpoint on the check tokens, block by block: weights read in
    ``dtype`` (nudged by ``nudge``), activations of the tokens kept."""

    dtype: torch.dtype
    nudge: float = 0.0
    device: torch.device | None = None
    x: torch.Tensor | None = None
    pos: torch.Tensor | None = None

    def weights(self, tensors) -> _Weights:
        return _Weights(tensors, self.dtype, self.nudge, device=self.device)

    def start(self, ends: Mapping[str, torch.Tensor], cfg: Config, tokens: torch.Tensor) -> None:
        # Only the rows of W_E the tokens use are read and converted.
        used, inverse = torch.unique(tokens, return_inverse=True)
        params = dict(ends, **{"embed.W_E": ends["embed.W_E"][used]})
        self.x, self.pos = embed(self.weights(params), cfg, inverse.to(self.device))

    def step(self, tensors: Mapping[str, torch.Tensor], layer: int, cfg: Config) -> None:
        self.x = block(self.weights(tensors), layer, cfg, self.x, self.pos)

    def log_probs(self, ends: Mapping[str, torch.Tensor], cfg: Config) -> torch.Tensor:
        logits = []
        for start in range(0, cfg.d_vocab, UNEMBED_COLUMNS):
            columns = slice(start, start + UNEMBED_COLUMNS)
            params = dict(ends, **{"unembed.W_U": ends["unembed.W_U"][:, columns], "unembed.b_U": ends["unembed.b_U"][columns]})
            weights = _Weights(params, self.dtype, self.nudge, seeds={"unembed.W_U": start, "unembed.b_U": start},
                               device=self.device)
            logits.append(unembed(weights, cfg, self.x))
        return torch.log_softmax(torch.cat(logits, dim=-1), dim=-1)


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


def _log_prob_row(
    before: Checkpoint, after: Checkpoint, tokens: torch.Tensor, progress, total: int, device=None
) -> dict:
    """The largest |Δ log-prob| of the two checkpoints and its tolerance, computed block by block
    on ``device``."""
    coarse = max((before.dtype, after.dtype), key=lambda d: torch.finfo(d).eps)
    run_in = compute_dtype(coarse)
    ours, theirs = _Pass(run_in, device=device), _Pass(run_in, device=device)
    exact = _Pass(torch.float64, device=device)
    nudged = _Pass(torch.float64, nudge=_unit_roundoff(coarse), device=device)
    mine = (ours, exact, nudged)
    before_ends, after_ends = before.ends(), after.ends()
    for p in mine:
        p.start(before_ends, before.cfg, tokens)
    theirs.start(after_ends, after.cfg, tokens)
    del before_ends, after_ends
    for layer in range(before.cfg.n_layers):
        tensors, processed = before.block(layer), after.block(layer)
        for p in mine:
            p.step(tensors, layer, before.cfg)
        theirs.step(processed, layer, after.cfg)
        del tensors, processed
        if progress:
            progress(layer + 1, total, f"forward pass, block {layer}")
    before_ends, after_ends = before.ends(), after.ends()
    a, reference, moved = (p.log_probs(before_ends, before.cfg).double() for p in mine)
    b = theirs.log_probs(after_ends, after.cfg).double()
    sensitivity = float((reference - moved).abs().max())
    if run_in != torch.float64:
        sensitivity += float((a - reference).abs().max())
    differences = (a - b).abs()
    difference = float(differences.max())
    where = [int(i) for i in torch.unravel_index(differences.argmax(), differences.shape)]
    tolerance = logprob_tolerance(before.cfg, coarse, float(a.abs().max()), sensitivity)
    holds = difference <= tolerance
    return {
        "name": "log-probs", "kind": "comparison", "status": "holds" if holds else "violated",
        "max_abs_error": difference, "tolerance": tolerance, "where": where,
        "explanation": f"before -> after on {tokens.shape[0]} x {tokens.shape[1]} tokens, block by block in {run_in}"
        f" (rounding sensitivity {sensitivity:.3g}, measured block by block in float64)"
        + ("" if holds else ": the processed model computes a different function"),
    }


def _tensor_row(before: Checkpoint, after: Checkpoint, progress, done: int, total: int, device=None) -> dict:
    """``after``'s tensors against the exact rewrite of ``before``, replayed a part at a time on
    ``device``."""
    keywords = _replay_keywords(before.cfg, after.cfg)
    row = {"name": "tensors", "kind": "rewrite", "max_abs_error": None, "tolerance": None}
    if keywords is None:
        return row | {"status": "not compared", "explanation": (
            f"after records {after.cfg.applied}, not {before.cfg.applied} followed by"
            f" {process_weights.__name__} steps")}
    thresholds = _Thresholds.of(after.dtype, before.cfg)
    compute = compute_dtype(after.dtype)
    parts = checkpoint_parts(before, compute, device)  # replayed unrounded: the certificate rounds
    wrong, equal, count, worst = [], 0, 0, 0.0

    def transform(state_dict, part_cfg):
        return process_weights(state_dict, part_cfg, **keywords)

    for layer in [None, *range(before.cfg.n_layers)]:
        replayed, replayed_cfg = parts.run(layer, transform)
        if layer is None and replayed_cfg != after.cfg:
            return row | {"status": "violated", "explanation": f"the replay of {keywords} gives {replayed_cfg}, after has {after.cfg}"}
        theirs = after.ends() if layer is None else after.block(layer)
        for name in sorted(set(replayed) | set(theirs)):
            if name not in replayed or name not in theirs or replayed[name].shape != theirs[name].shape:
                wrong.append((name, math.inf))
                continue
            count += 1
            ours, processed = replayed[name], theirs[name].to(replayed[name].device)
            equal += torch.equal(ours.to(processed.dtype), processed)
            if torch.equal(ours, processed):
                ratio = 0.0
            else:
                scale = max(float(ours.abs().max()), float(processed.abs().max())) if ours.numel() else 0.0
                ratio = _certificate(processed, ours, scale, thresholds)
            worst = max(worst, ratio)
            if ratio > 1:
                wrong.append((name, ratio))
        del replayed, theirs
        if progress:
            progress(done + (0 if layer is None else layer + 1), total, "tensors" if layer is None else f"tensors, block {layer}")
    steps = [k for k, v in keywords.items() if v]
    bound = (f"{CERTIFICATE_ULPS} unit in the last place of {after.dtype} (and {compute}'s rounding of the rewrite)")
    if wrong:
        listed = ", ".join(f"{name} ({ratio:.3g}x)" for name, ratio in wrong[:8])
        return row | {"status": "violated", "max_abs_error": worst, "tolerance": 1.0, "explanation": (
            f"{len(wrong)} of {count} tensors have entries further from"
            f" {process_weights.__name__}({', '.join(steps)}) of before,"
            f" computed in {compute}, than {bound}; the worst entry, as a multiple of that bound: {listed}"
            f"{' ...' if len(wrong) > 8 else ''}")}
    return row | {"status": "holds", "max_abs_error": worst, "tolerance": 1.0, "explanation": (
        f"{count} tensors within {bound} of {process_weights.__name__}({', '.join(steps)}) of before,"
        " replayed part by part"
        f" in {compute} ({equal} equal to it rounded, bit for bit; the worst entry at {worst:.3g} of the bound)")}


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
    ``before`` with the steps ``after`` records, replayed part by part (``"not compared"`` when
    ``after`` records steps that are not pipeline steps). ``progress(done, total, what)`` is
    called after each block. ``device``: where the passes and the replay run (default the CPU).
    """
    before, after = opened(before, config), opened(after)
    shape = ("n_layers", "d_model", "n_heads", "d_head", "d_vocab", "n_ctx")
    differ = [f"{n} {getattr(before.cfg, n)} vs {getattr(after.cfg, n)}" for n in shape if getattr(before.cfg, n) != getattr(after.cfg, n)]
    if differ:
        raise InputError(f"{after.path} is not a processing of {before.path}: {', '.join(differ)}")
    tokens = tokens(before.cfg) if callable(tokens) else tokens
    tokens = check_tokens(before.cfg, tokens)
    total = 2 * before.cfg.n_layers + 1
    with torch.no_grad():
        rows = [_log_prob_row(before, after, tokens, progress, total, device)]
        rows.append(_tensor_row(before, after, progress, before.cfg.n_layers + 1, total, device))
    return StreamingReport(rows)
