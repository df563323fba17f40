"""Checking another project's weight processing: which identities it applied, and what went wrong.

A processed state dict ``after`` is explained by replaying the registered identities on
``before``: each identity's exact rewrite is computed and compared with ``after`` tensor by
tensor. The replay follows ``after``'s recorded ``cfg.applied`` when it has one; otherwise every
weight-rewriting identity is tried, in registry order, and kept when its rewrite reproduces more
of ``after``'s tensors than leaving the model alone does. Where the exact rewrite does not
reproduce a tensor, the identity's known wrong rewrites (its registered ``wrong_rewrites``, and
the wrong rewrites of other identities that claim to perform it) are
tried; one that reproduces the tensor names the mistake. Where an identity refuses the model
(a :class:`~circuitmath.PreconditionError`), its rewrite applied regardless is tried too: if
that reproduces ``after``, the broken precondition is the finding.

Only then are log-probabilities compared: ``before`` against ``after`` always, and, when
anything was found, every replayed state against the next, so that each identity's row shows
the change in log-probs it is responsible for. A replay in which every identity's exact rewrite
reproduces ``after`` needs no more than the two forward passes of ``before`` and ``after``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import _identities as _registry
from ._config import Config
from ._errors import AlreadyAppliedError, PreconditionError, StateDictError
from ._reference import log_probs
from ._state import StateDict, expected_shapes, validate_state_dict
from ._compare import Comparison, compute_dtype, default_tokens, logprob_tolerance, rounding_sensitivity

__all__ = [
    "ParameterMismatch",
    "Finding",
    "Diagnosis",
    "resolve_model",
    "diagnose",
    "check_identity",
    "check_model",
    "weight_identities",
]

Progress = Callable[[int, int, str], None]

# ---------------------------------------------------------------------------------------------
# inputs: state dicts in TransformerLens or Hugging Face format, safetensors files, HF folders

#: Buffers a TransformerLens module's ``state_dict()`` carries besides its parameters.
_TRANSFORMER_LENS_BUFFERS = ("mask", "IGNORE", "rotary_sin", "rotary_cos")


def _is_hf_config(cfg) -> bool:
    if cfg is None or isinstance(cfg, Config):
        return False
    if isinstance(cfg, Mapping):
        return "model_type" in cfg
    return hasattr(cfg, "model_type")


def resolve_model(source, cfg=None) -> tuple[dict[str, torch.Tensor], Config]:
    """``(state_dict, Config)`` in the reference conventions, validated, from any accepted form.

    ``source`` is a state dict or the path of a ``.safetensors`` file or of a Hugging Face model
    folder (``config.json`` and ``model.safetensors``). ``cfg`` is a :class:`~circuitmath.Config`
    (TransformerLens-format names and shapes), a Hugging Face config (its ``config.json`` as a
    dict, or a ``transformers`` config object: the state dict is converted by
    :func:`circuitmath.io.from_hf`), or ``None`` for a file written by :func:`circuitmath.io.save`,
    whose config is read from its metadata. A ``cfg`` given explicitly wins over the metadata.
    TransformerLens's non-parameter buffers (``attn.mask``, ``attn.IGNORE``, rotary tables) are
    dropped. A pickle (``.pt``, ``.bin``, ...) is refused without being read.

    Raises :class:`~circuitmath.StateDictError` (or its subclass from :mod:`circuitmath.io`)
    naming what is wrong.
    """
    from . import io

    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise StateDictError(f"{path}: no such file or folder")
        if path.is_dir():
            if cfg is not None:
                raise StateDictError(f"{path} is a Hugging Face folder with its own config.json; pass no config")
            return io.load_hf_directory(path)
        tensors, metadata = io.load_tensors(path)
        if cfg is None:
            cfg = io.stored_config(path, metadata)
            if cfg is None:
                raise StateDictError(
                    f"{path} carries no circuitmath config in its metadata (it was not written by"
                    " circuitmath.io.save): pass its config (a circuitmath Config or a Hugging Face config;"
                    " --config CFG.json on the command line)"
                )
        source = tensors
    if not isinstance(source, Mapping):
        raise StateDictError(f"expected a state dict, a .safetensors path or a folder, got {type(source).__name__}")
    if cfg is None:
        raise StateDictError("a state dict needs its config: a circuitmath Config or a Hugging Face config")
    if _is_hf_config(cfg):
        return io.from_hf(dict(source), cfg)
    if not isinstance(cfg, Config):
        raise StateDictError(f"expected a circuitmath Config or a Hugging Face config, got {type(cfg).__name__}")
    state_dict = {
        name: tensor
        for name, tensor in source.items()
        if not (name.rsplit(".", 1)[-1] in _TRANSFORMER_LENS_BUFFERS and name not in expected_shapes(cfg))
    }
    validate_state_dict(state_dict, cfg)
    return state_dict, cfg


def _processed_forms(cfg: Config) -> list[Config]:
    """``cfg`` and the configs processing can turn it into without changing any size."""
    forms = [cfg]
    bare = {"LN": "LNPre", "RMS": "RMSPre"}.get(cfg.normalization_type)
    if bare:
        forms.append(cfg.replace(normalization_type=bare))
    if cfg.positional_embedding_type == "shortformer":
        forms += [form.replace(positional_embedding_type="shortformer_tables") for form in forms]
    return forms


def _resolve_after(after, after_cfg, before_cfg: Config, cfg) -> tuple[dict[str, torch.Tensor], Config]:
    """Resolve ``after``: with ``after_cfg``, else from a file's metadata, else in the format of
    ``before`` (a Hugging Face ``cfg`` converts a Hugging Face state dict), read against
    ``before``'s config or the first processed form of it that its tensors fit."""
    from . import io

    if after_cfg is not None:
        return resolve_model(after, after_cfg)
    if isinstance(after, (str, os.PathLike)):
        path = Path(after)
        if path.is_dir() or not path.exists():
            return resolve_model(after)
        tensors, metadata = io.load_tensors(path)
        if io.CONFIG_KEY in metadata:
            return resolve_model(after)
        after = tensors
    if _is_hf_config(cfg) and isinstance(after, Mapping) and "embed.W_E" not in after:
        return resolve_model(after, cfg)
    if not isinstance(after, Mapping):
        raise StateDictError(f"expected a state dict, a .safetensors path or a folder, got {type(after).__name__}")
    first_error = None
    for form in _processed_forms(before_cfg):
        try:
            return resolve_model(after, form)
        except StateDictError as error:
            first_error = first_error or error
    raise StateDictError(
        f"the processed state dict fits neither the model's config nor a processed form of it"
        f" ({', '.join(f.normalization_type or 'no norm' for f in _processed_forms(before_cfg)[1:]) or 'none'}):"
        f" {first_error}"
    ) from None


def _norm_parameters(cfg: Config) -> list[str]:
    """The names of every norm gain and bias ``cfg`` implies."""
    bare = {"LN": "LNPre", "RMS": "RMSPre"}.get(cfg.normalization_type)
    if bare is None:
        return []
    return sorted(set(expected_shapes(cfg)) - set(expected_shapes(cfg.replace(normalization_type=bare))))


def _without_identity_norms(state_dict: StateDict, cfg: Config) -> tuple[dict, Config, str | None]:
    """Drop norms whose gains are all 1 and biases all 0, which compute ``LNPre`` (``RMSPre``).

    Tools that fold a norm often keep it with unit gain and zero bias (TransformerLens does); the
    replayed rewrite drops it. Returns the state dict, its config and a note saying what was read.
    """
    names = _norm_parameters(cfg)
    if not names or any(not bool((state_dict[n] == (1 if n.endswith(".w") else 0)).all()) for n in names):
        return dict(state_dict), cfg, None
    bare = "LNPre" if cfg.normalization_type == "LN" else "RMSPre"
    gains = "gain is 1 and bias 0" if cfg.normalization_type == "LN" else "gain is 1"
    note = f"every {cfg.normalization_type} {gains}: read as {bare}, the same function"
    return {k: v for k, v in state_dict.items() if k not in names}, cfg.replace(normalization_type=bare), note


# ---------------------------------------------------------------------------------------------
# results


_HEAD_AXIS = {"W_Q": 0, "W_K": 0, "W_V": 0, "_W_K": 0, "_W_V": 0, "W_O": 0, "b_Q": 0, "b_K": 0, "b_V": 0,
              "_b_K": 0, "_b_V": 0, "pos_Q": 1, "pos_K": 1}


@dataclass(frozen=True)
class ParameterMismatch:
    """Where one tensor of the processed model differs from what it should be, and by how much.

    ``layer`` is the block index (``None`` outside the blocks), ``heads`` the attention heads
    whose slice differs (per-head tensors only), ``max_abs_error`` the largest absolute difference
    and ``relative_error`` that over the largest entry of the tensors compared. ``problem`` is set
    when the tensor is missing, unexpected or of another shape; ``written_by`` names the identity
    whose rewrite last produced the expected tensor (``None``: no identity rewrites it).
    """

    name: str
    layer: int | None
    heads: tuple[int, ...]
    max_abs_error: float
    relative_error: float
    problem: str | None = None
    written_by: str | None = None

    def __str__(self) -> str:
        where = [f"layer {self.layer}"] if self.layer is not None else []
        if self.heads:
            where.append(("head " if len(self.heads) == 1 else "heads ") + ", ".join(map(str, self.heads)))
        place = f"{self.name} ({', '.join(where)})" if where else self.name
        if self.problem:
            return f"{place}: {self.problem}"
        return f"{place}: max |Δ| {self.max_abs_error:.3g} ({self.relative_error:.2g} of its largest entry)"

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "layer": self.layer,
            "heads": list(self.heads),
            "max_abs_error": _json_number(self.max_abs_error),
            "relative_error": _json_number(self.relative_error),
            "problem": self.problem,
            "written_by": self.written_by,
        }


def _json_number(value: float | None):
    return None if value is None or not math.isfinite(value) else value


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
        return self.status in ("violated", "not recognised")

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

    @property
    def ok(self) -> bool:
        """No row is violated (or unrecognised) and, when two models were compared, they agree."""
        return not self.violations and (self.comparison is None or self.comparison.passed)

    @property
    def violations(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.violated)

    def culprits(self) -> tuple[ParameterMismatch, ...]:
        """Every parameter named by a violated row."""
        return tuple(p for f in self.violations for p in f.parameters)

    def as_dicts(self) -> list[dict]:
        return [f.as_dict() for f in self.findings]

    def table(self) -> str:
        rows = [TABLE_COLUMNS]
        for f in self.findings:
            if f.kind != "identity":
                applicable = "-"
            elif f.applicable:
                applicable = "yes"
            else:
                applicable = "no: " + _shorten(f.precondition or f.reason or "", 48)
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


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------------------------------------
# comparing tensors


@dataclass(frozen=True)
class _Thresholds:
    """When two tensors count as the same.

    ``recognise``: the same rewrite (used to tell which rewrite was applied; wrong rewrites miss
    it by orders of magnitude, while rewrites computed another way, in float32 or with another
    summation order, stay well inside). ``exact``: equal up to rounding in the model's dtype.
    """

    recognise: float
    exact: float
    float32_rounding: float

    @classmethod
    def of(cls, dtype: torch.dtype, cfg: Config) -> "_Thresholds":
        root_k = math.sqrt(max(cfg.d_model, cfg.d_mlp or 0, cfg.d_vocab))
        recognise = max(1e-3, 4 * torch.finfo(dtype).eps)
        return cls(
            recognise=recognise,
            exact=min(recognise, 8 * torch.finfo(dtype).eps * root_k),
            float32_rounding=8 * torch.finfo(torch.float32).eps * root_k,
        )


def _largest_entry(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor, ord=math.inf)) if tensor.numel() else 0.0


def _relative_difference(a: torch.Tensor, b: torch.Tensor, reference: torch.Tensor | None = None,
                         largest: Callable[[torch.Tensor], float] = _largest_entry) -> tuple[float, float]:
    """``(max |a - b|, that over the largest |entry| of a, b and reference)``; (0, 0) when equal.

    ``largest`` gives a tensor's largest |entry| (a caching version saves passes over big tensors).
    """
    if a is b or torch.equal(a, b):
        return 0.0, 0.0
    dtype = torch.promote_types(a.dtype, b.dtype)
    difference = _largest_entry(a.to(dtype) - b.to(dtype))
    scale = max(largest(t) for t in (a, b) + ((reference,) if reference is not None else ()))
    return difference, (difference / scale if scale > 0 else math.inf)


def _natural_order(names: Iterable[str]) -> list[str]:
    """Names sorted with their numbers compared as numbers (blocks.2 before blocks.10)."""
    return sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def _location(name: str) -> tuple[int | None, int | None]:
    """``(layer, head axis)`` of a parameter name."""
    layer = re.match(r"blocks\.(\d+)\.", name)
    return (int(layer.group(1)) if layer else None), _HEAD_AXIS.get(name.rsplit(".", 1)[-1])


def _mismatch(name: str, got, expected, reference, threshold: float, written_by: str | None,
              expected_in: str = "the exact rewrite") -> ParameterMismatch:
    """``got`` (the processed model's tensor) against ``expected`` (``expected_in``'s); ``None``: absent."""
    layer, head_axis = _location(name)
    if got is None:
        problem = f"absent from the processed model, present in {expected_in}"
        return ParameterMismatch(name, layer, (), math.inf, math.inf, problem, written_by)
    if expected is None:
        problem = f"present in the processed model, absent from {expected_in}"
        return ParameterMismatch(name, layer, (), math.inf, math.inf, problem, written_by)
    if got.shape != expected.shape:
        problem = f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
        return ParameterMismatch(name, layer, (), math.inf, math.inf, problem, written_by)
    absolute, relative = _relative_difference(got, expected, reference)
    heads: tuple[int, ...] = ()
    if head_axis is not None and got.ndim > head_axis and relative > 0:
        dtype = torch.promote_types(got.dtype, expected.dtype)
        per_head = (got.to(dtype) - expected.to(dtype)).abs().movedim(head_axis, 0).flatten(1).amax(dim=1)
        heads = tuple(int(h) for h in torch.nonzero(per_head > threshold * (absolute / relative)).flatten())
    return ParameterMismatch(name, layer, heads, absolute, relative, None, written_by)


# ---------------------------------------------------------------------------------------------
# the identities replayed


def weight_identities() -> tuple:
    """The registered identities whose transform rewrites weights (not a computation), each
    transform once (an identity sharing another's transform is left out)."""
    seen, out = set(), []
    for identity in _registry.identities():
        if identity.compare is None and id(identity.transform) not in seen:
            seen.add(id(identity.transform))
            out.append(identity)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# replaying identities


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

    def __init__(self, after: Mapping[str, torch.Tensor], thresholds: _Thresholds):
        self.after = after
        self.thresholds = thresholds
        self._wrong_cache: dict = {}  # (id(state), cfg) -> (state, wrong rewrites); keeps state alive
        self._verdicts: dict = {}  # (name, id(tensor), id(reference), level) -> (tensor, reference, verdict)
        self._largest: dict = {}  # id(tensor) -> (tensor, largest |entry|)

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
        key = (name, id(tensor), id(reference), level)
        hit = self._verdicts.get(key)
        if hit is None or hit[0] is not tensor or hit[1] is not reference:
            relative = _relative_difference(theirs, tensor, reference, self.largest)[1]
            hit = (tensor, reference, relative <= getattr(self.thresholds, level))
            self._verdicts[key] = hit
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
        if refused:
            return [
                candidate
                for name, wrong in identity.wrong_rewrites.items() if wrong.regardless
                for candidate in self._run(f"{identity.name}.{name}", identity.describe(name), wrong.function, state, cfg)
            ]
        allowed = {identity.name, *records}
        return [
            candidate
            for owner, candidate in self._all_wrong_rewrites(state, cfg)
            if owner == identity.name
            or identity.name in candidate.cfg.applied[len(cfg.applied):]
            and set(candidate.cfg.applied[len(cfg.applied):]) <= allowed
        ]

    def _all_wrong_rewrites(self, state, cfg) -> list[tuple[str, _Candidate]]:
        """Every known wrong rewrite of ``state`` that applies to it, computed once per state."""
        key = (id(state), cfg)
        if key not in self._wrong_cache:
            out = []
            for identity in weight_identities():
                for name, wrong in identity.wrong_rewrites.items():
                    if wrong.regardless:
                        continue
                    for candidate in self._run(f"{identity.name}.{name}", identity.describe(name), wrong.function,
                                               state, cfg):
                        out.append((identity.name, candidate))
            self._wrong_cache[key] = (state, out)
        return self._wrong_cache[key][1]

    @staticmethod
    def _run(rewrite, description, function, state, cfg) -> Iterable[_Candidate]:
        try:
            result, result_cfg = function(state, cfg)
        except Exception:  # noqa: BLE001 - a wrong rewrite may not fit this model at all: then it explains nothing
            return
        yield _Candidate(rewrite, description, dict(result), result_cfg)

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
            exact_state, exact_cfg = identity.transform(state, cfg)
            exact = _Candidate("exact", "", dict(exact_state), exact_cfg)
            records = exact_cfg.applied[len(cfg.applied):]
        except AlreadyAppliedError:
            return None
        except PreconditionError as error:
            exact, refusal = None, error
        if exact is not None and identity.name not in records:
            return None  # a pipeline of other identities: the replay applies those one by one
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
                return _Stage(identity.name, dict(state), cfg, set(), None, refusal, recognised=False)
            return None
        gains = [self.gain(state, c) for c in candidates]
        best = max(range(len(candidates)), key=lambda i: (gains[i][0], -i))
        primary, (gain, touched) = candidates[best], gains[best]
        if gain <= 0 and not forced:
            return None
        if gain <= 0 and exact is not None:
            primary, touched = exact, gains[0][1]
        merged = dict(primary.state)
        origin = {n: primary for n in touched}
        for name in touched:
            if self.same(name, merged.get(name), state.get(name)):
                continue
            for other in candidates:
                if other is not primary and set(other.state) == set(merged) and self.same(name, other.state.get(name), state.get(name)):
                    merged[name], origin[name] = other.state[name], other
                    break
        stage = _Stage(identity.name, merged, primary.cfg, touched, exact.state if exact else None, refusal,
                       recognised=gain > 0)
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
            candidate = origin.get(name, primary)
            if candidate.rewrite != "exact":
                self._name(stage, candidate, [name])

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
        e.g. a wrongly folded unembed that is centred afterwards).
        """
        stages, final, final_cfg = self.run(before, cfg, plan, search=False)
        residual = self.residual(final, before)
        if not residual:
            return stages, final, final_cfg, residual
        searched = self.run(before, cfg, plan, search=True)
        searched_residual = self.residual(searched[1], before)
        if len(searched_residual) <= len(residual):
            (stages, final, final_cfg), residual = searched, searched_residual
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

    def _downstream_trial(self, before, cfg, plan, stages, i, residual):
        """Try each wrong rewrite of stage ``i`` followed by the rest of the replay; return the first
        that leaves fewer tensors unexplained, as ``(stages, final, final_cfg, residual)``."""
        state, state_cfg = (before, cfg) if i == 0 else (stages[i - 1].state, stages[i - 1].cfg)
        stage = stages[i]
        identity = _registry.get_identity(stage.name)
        rest = None if plan is None else [_registry.get_identity(s.name) for s in stages[i + 1:]]
        records = () if stage.exact is None else stage.cfg.applied[len(state_cfg.applied):]
        for candidate in self.wrong_rewrites(identity, state, state_cfg, refused=stage.refusal is not None,
                                             records=records):
            base = stage.state
            if set(candidate.state) != set(base):
                continue
            changed = [n for n in candidate.state if not torch.equal(candidate.state[n], base[n])]
            while changed:
                trial = _Stage(stage.name, dict(base, **{n: candidate.state[n] for n in changed}), stage.cfg,
                               stage.touched | self.touched(state, candidate.state), stage.exact, stage.refusal,
                               dict(stage.rewrites), dict(stage.descriptions), stage.recognised)
                later, final, final_cfg = self.run(trial.state, trial.cfg, rest, search=False)
                trial_residual = self.residual(final, before)
                if len(trial_residual) < len(residual):
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


# ---------------------------------------------------------------------------------------------
# log-probabilities


#: Positions of the first sequence the rounding sensitivity is measured on (see :class:`_LogProbs`).
SENSITIVITY_POSITIONS = 32


class _LogProbs:
    """Log-probs of states on fixed tokens, each state's computed once, and the tolerance.

    Every state runs in :func:`~circuitmath.testing.compute_dtype` of ``dtype`` (the coarser
    dtype of the models compared). The tolerance is :func:`~circuitmath.testing.logprob_tolerance`
    with the rounding sensitivity of the model given to :meth:`set_reference`, measured on the
    first ``SENSITIVITY_POSITIONS`` positions of the first sequence of ``tokens``: it takes two
    float64 forward passes, and on a GPT-2-shaped model (d_vocab 50257) one sequence of 32
    positions gave within 10% of the value over 4 x 128 positions, far inside the safety factor.
    """

    def __init__(self, tokens: torch.Tensor, dtype: torch.dtype):
        self.tokens = tokens
        self.dtype = dtype
        self.run_in = compute_dtype(dtype)
        self._cache: dict[int, tuple[Mapping, torch.Tensor]] = {}
        self.sensitivity = 0.0
        self.cfg: Config | None = None

    def __call__(self, state: Mapping, cfg: Config) -> torch.Tensor:
        hit = self._cache.get(id(state))
        if hit is None or hit[0] is not state:
            converted = {k: v.to(self.run_in) for k, v in state.items()}
            hit = (state, log_probs(converted, cfg, self.tokens).double())
            self._cache[id(state)] = hit
        return hit[1]

    def set_reference(self, state: Mapping, cfg: Config) -> None:
        positions = min(self.tokens.shape[1], SENSITIVITY_POSITIONS)
        computed = self(state, cfg)[:1, :positions]
        self.sensitivity = rounding_sensitivity(
            state, cfg, self.tokens[:1, :positions], self.dtype,
            computed=None if self.run_in == torch.float64 else computed,
        )
        self.cfg = cfg

    def compare(self, a: Mapping, a_cfg: Config, b: Mapping, b_cfg: Config) -> Comparison:
        first, second = self(a, a_cfg), self(b, b_cfg)
        difference = (first - second).abs()
        where = tuple(int(i) for i in torch.unravel_index(difference.argmax(), difference.shape))
        scale = float(first.abs().max())
        tolerance = logprob_tolerance(self.cfg or a_cfg, self.dtype, scale, self.sensitivity)
        return Comparison(max_abs_error=float(difference.max()), tolerance=tolerance, where=where)


def _coarser(*dtypes: torch.dtype) -> torch.dtype:
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _dtype(state_dict: Mapping) -> torch.dtype:
    return next(iter(state_dict.values())).dtype if state_dict else torch.get_default_dtype()


# ---------------------------------------------------------------------------------------------
# diagnosis


def _identity_finding(stage: _Stage, before: Mapping, replay: _Replay, comparison: Comparison | None,
                      parameter_error: float | None) -> Finding:
    """The row of one replayed identity."""
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
    if not stage.recognised:
        status = "not recognised"
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


def _replay_and_explain(before, before_cfg, after, after_cfg, tokens, plan, notes, progress) -> Diagnosis:
    dtype = _coarser(_dtype(before), _dtype(after))
    thresholds = _Thresholds.of(dtype, before_cfg)
    replay = _Replay(after, thresholds)
    report = progress or (lambda done, total, what: None)
    total = 5
    report(0, total, "replaying identities")
    stages, final, final_cfg, residual = replay.explain(before, before_cfg, plan)
    lp = _LogProbs(tokens, dtype)
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
            residual_error[name] = _relative_difference(after[name], final[name], before.get(name), replay.largest)[1]
    findings = []
    states = [(before, before_cfg)] + [(s.state, s.cfg) for s in stages]
    for i, stage in enumerate(stages):
        if measure:
            report(4, total, f"log-probs after {stage.name}")
        comparison = lp.compare(*states[i], *states[i + 1]) if measure else None
        mine = [residual_error[n] for n, writer in last_writer.items() if writer == stage.name and n in residual_error]
        findings.append(_identity_finding(stage, before, replay, comparison, max(mine, default=0.0)))
    if residual or measure:
        findings.append(_residual_finding(residual, final, final_cfg, before, after, after_cfg, replay, last_writer,
                                          lp if measure else None, dtype, config_differences))
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


def _config_differences(replayed: Config, processed: Config) -> list[str]:
    """The config fields (other than ``applied``) in which the processed model differs from the replay."""
    ours, theirs = replayed.to_dict(), processed.to_dict()
    return [f"{k}: {theirs[k]!r} (the replay gives {ours[k]!r})" for k in ours if k != "applied" and ours[k] != theirs[k]]


def _residual_finding(residual, final, final_cfg, before, after, after_cfg, replay, last_writer, lp, dtype,
                      config_differences) -> Finding:
    """What the replayed identities leave unexplained: tensors, and config fields."""
    parameters = tuple(
        _mismatch(n, after.get(n), final.get(n), before.get(n), replay.thresholds.exact, last_writer.get(n), "the replay")
        for n in residual
    )
    comparison = None
    if lp is not None:
        comparison = lp.compare(final, final_cfg, after, after_cfg)
    lines = []
    if residual:
        relative = [p.relative_error for p in parameters]
        if dtype == torch.float64 and max(relative) <= replay.thresholds.float32_rounding:
            lines.append(
                f"every difference is within float32 rounding (largest {max(relative):.2g} of a tensor's largest"
                " entry): the float64 weights were processed in float32 or lower precision"
            )
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
    if residual and comparison is not None and comparison.passed:
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


def _inputs(before, after, cfg, after_cfg):
    before_sd, before_cfg = resolve_model(before, cfg)
    after_sd, resolved_after_cfg = _resolve_after(after, after_cfg, before_cfg, cfg)
    after_sd, resolved_after_cfg, note = _without_identity_norms(after_sd, resolved_after_cfg)
    return before_sd, before_cfg, after_sd, resolved_after_cfg, [note] if note else []


def _resolve_tokens(tokens, cfg: Config) -> torch.Tensor:
    """``tokens`` as given, :func:`default_tokens` for ``None``, or ``tokens(cfg)`` for a callable."""
    if tokens is None:
        return default_tokens(cfg)
    return torch.as_tensor(tokens(cfg) if callable(tokens) else tokens)


def _recorded_plan(before_cfg: Config, after_cfg: Config, notes: list[str]):
    """The identities ``after_cfg.applied`` records beyond ``before_cfg.applied`` (``None``: infer)."""
    applied, done = after_cfg.applied, before_cfg.applied
    if not applied[len(done):] or applied[: len(done)] != done:
        return None
    names = {identity.name: identity for identity in _registry.identities()}
    unknown = [n for n in applied[len(done):] if n not in names]
    if unknown:
        notes.append(f"cfg.applied records {unknown}, which are no registered identities: inferring the replay instead")
        return None
    notes.append("replaying the identities recorded in the processed model's cfg.applied")
    return [names[n] for n in applied[len(done):]]


@torch.no_grad()  # weights that require grad are compared as plain tensors
def diagnose(before, after, cfg=None, *, after_cfg=None, tokens=None, progress: Progress | None = None) -> Diagnosis:
    """Explain ``after`` as a processing of ``before``: which identities, which went wrong, where.

    ``before`` and ``after`` are state dicts (TransformerLens or Hugging Face format) or paths of
    safetensors files; ``cfg`` is ``before``'s :class:`~circuitmath.Config` or Hugging Face config
    (``None``: read from the file). ``after_cfg`` defaults to the file's metadata, else to
    ``before``'s config or the first processed form of it the tensors fit (a folded LayerNorm is
    ``"LNPre"``; a norm kept with unit gain and zero bias is read as none). ``tokens``
    ``[batch, pos]`` default to :func:`~circuitmath.testing.default_tokens`. ``progress(done,
    total, what)`` is called as the work proceeds.

    Rows: one per replayed identity; ``residual`` (tensors no replayed rewrite reproduces, each
    naming the identity that last rewrote it) when there is any; ``before -> after`` last. See
    the module documentation of :mod:`circuitmath.testing` for how the replay is chosen.
    """
    before_sd, before_cfg, after_sd, after_cfg, notes = _inputs(before, after, cfg, after_cfg)
    plan = _recorded_plan(before_cfg, after_cfg, notes)
    tokens = _resolve_tokens(tokens, before_cfg)
    return _replay_and_explain(before_sd, before_cfg, after_sd, after_cfg, tokens, plan, notes, progress)


@torch.no_grad()  # weights that require grad are compared as plain tensors
def check_identity(name: str, before, after, cfg=None, *, after_cfg=None, tokens=None) -> Diagnosis:
    """Check that ``after`` is the registered identity ``name`` applied to ``before``.

    Like :func:`diagnose`, but the replay is this identity alone (after the identity's own
    preparation, e.g. the LayerNorm fold that centring the reading weights needs). Its row is
    ``"not recognised"`` when none of the tensors the identity rewrites matches its rewrite.
    """
    identity = _registry.get_identity(name)
    if identity.compare is not None:
        raise ValueError(f"{name} licenses a computation, not a weight rewrite: there is no processed model to check")
    before_sd, before_cfg, after_sd, after_cfg, notes = _inputs(before, after, cfg, after_cfg)
    plan = [identity]
    try:  # the identities its preparation and its transform record (a pipeline records its steps)
        prepared, prepared_cfg = identity.prepare(before_sd, before_cfg) if identity.prepare else (before_sd, before_cfg)
        recorded = identity.transform(prepared, prepared_cfg)[1].applied[len(before_cfg.applied):]
        plan = [_registry.get_identity(n) for n in recorded]
    except PreconditionError:
        pass
    tokens = _resolve_tokens(tokens, before_cfg)
    return _replay_and_explain(before_sd, before_cfg, after_sd, after_cfg, tokens, plan, notes, None)


@torch.no_grad()  # weights that require grad are compared as plain tensors
def check_model(model, cfg=None, *, tokens=None, progress: Progress | None = None) -> Diagnosis:
    """Apply every weight identity that applies to ``model`` and compare log-probs, one row each.

    ``model`` and ``cfg`` as for :func:`diagnose`. Each identity runs on the model after its own
    preparation (e.g. centring the reading weights after the LayerNorm fold); an identity that
    refuses the model is ``"not applicable"``, with the broken precondition as its reason. The
    tolerance is the model's (:class:`_LogProbs`). ``progress(done, total, what)`` is called
    before each identity.
    """
    state, model_cfg = resolve_model(model, cfg)
    tokens = _resolve_tokens(tokens, model_cfg)
    chosen = weight_identities()
    report = progress or (lambda done, total, what: None)
    total = len(chosen) + 1
    report(0, total, "rounding sensitivity")
    lp = _LogProbs(tokens, _dtype(state))
    lp.set_reference(state, model_cfg)
    findings = []
    for i, identity in enumerate(chosen, 1):
        report(i, total, identity.name)
        try:
            prepared, prepared_cfg = identity.prepare(state, model_cfg) if identity.prepare else (state, model_cfg)
            processed, processed_cfg = identity.transform(prepared, prepared_cfg)
        except PreconditionError as error:
            findings.append(Finding(identity.name, "identity", False, "not applicable", reason=str(error),
                                    precondition=error.precondition))
            continue
        comparison = lp.compare(prepared, prepared_cfg, processed, processed_cfg)
        findings.append(Finding(
            identity.name, "identity", True, "holds" if comparison.passed else "violated", rewrite="exact",
            max_abs_error=comparison.max_abs_error, tolerance=comparison.tolerance,
        ))
    report(total, total, "done")
    return Diagnosis(tuple(findings))
