"""Public checkers: is a processed state dict the same function as the original, and if not, why?

Like :func:`torch.testing.assert_close`, but for whole models: both state dicts run through the
reference forward pass and their log-probabilities are compared. Log-probabilities, not logits:
centering the unembed legitimately shifts every logit of a position by the same constant.

Models are accepted as state dicts in TransformerLens format (with a :class:`~circuitmath.Config`)
or Hugging Face format (with the Hugging Face config, converted by :func:`circuitmath.io.from_hf`),
or as safetensors files (a file written by :func:`circuitmath.io.save` carries its config), or as
model objects: a ``transformers`` model, a TransformerLens ``TransformerBridge`` (each with its
config) or any ``nn.Module`` whose state dict is in one of those namings. A diagnosis names each
tensor as the input does (``model.layers.1.mlp.up_proj.weight``, with the entries a head takes).
Misuse (the processed model given first, two architectures, arguments in the wrong order) is a
:class:`~circuitmath.CircuitMathError` saying what to do. Checks compute with as many torch
threads as cores are idle (at most torch's setting, restored after): a busy machine does not
stall them.

When two models differ, :func:`diagnose` explains how: it replays the registered identities on
the original model and compares the processed model's tensors with each exact rewrite, then with
the identity's known wrong rewrites (its negative twins, done numerically), and names the
identity whose precondition or conclusion is violated, the parameters responsible (layer, head,
name) and by how much, and the change in log-probs each identity is responsible for.
:func:`assert_equivalent` prints that diagnosis when it fails (and hands it the two forward
passes it made). The per-identity checkers (:func:`check_fold_layer_norm` and the others, one
per registered weight identity with a public transform: :data:`CHECKERS`) are derived from the
registry and check one identity's rewrite. Comparison and tolerances live in the private layer
below the registry (``circuitmath._compare``); this module is the thin public layer over it and
over the diagnosis (``circuitmath._diagnosis``).

>>> import torch
>>> from circuitmath import Config, fold_layer_norm, random_state_dict
>>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
>>> before = random_state_dict(cfg, seed=0, dtype=torch.float64)
>>> after, after_cfg = fold_layer_norm(before, cfg)
>>> after["blocks.0.attn.b_V"] = before["blocks.0.attn.b_V"]  # forget to fold ln1.b into b_V
>>> report = check_fold_layer_norm(before, after, cfg, after_cfg=after_cfg)
>>> report.ok, [(p.name, p.heads) for p in report.culprits()]
(False, [('blocks.0.attn.b_V', (0, 1))])
>>> print(report.violations[0].explanation)  # doctest: +ELLIPSIS
the wrong rewrite fold_layer_norm.drop_bias explains blocks.0.attn.b_V: forget the LayerNorm bias term b W
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from ._compare import (
    SAFETY as SAFETY,
    SENSITIVITY_SAFETY as SENSITIVITY_SAFETY,
    Comparison as Comparison,
    compare_log_probs as compare_log_probs,
    compare_with_log_probs,
    compute_dtype as compute_dtype,
    default_tokens as default_tokens,
    logprob_tolerance as logprob_tolerance,
    rounding_sensitivity as rounding_sensitivity,
)
from . import _processing as _transforms
from . import _diagnosis  # after _compare: an identity family may import testing's comparison names
from ._diagnosis._logprobs import coarser
from ._diagnosis._tensors import CERTIFICATE_ULPS
from ._diagnosis._unexplained import NEAR_ULPS
from ._errors import ArgumentTypeError
from ._threads import with_check_threads
from ._diagnosis._names import speak
from ._diagnosis import Diagnosis as Diagnosis, Finding as Finding, ParameterMismatch as ParameterMismatch
from ._conformance import ConformanceTable, run_conformance

__all__ = [
    "Comparison",
    "compute_dtype",
    "logprob_tolerance",
    "rounding_sensitivity",
    "compare_log_probs",
    "assert_equivalent",
    "default_tokens",
    "NotEquivalentError",
    "diagnose",
    "check_model",
    "check_identity",
    "CHECKERS",
    "conformance",
    "Diagnosis",
    "Finding",
    "ParameterMismatch",
    "check_fold_layer_norm",
    "assert_fold_layer_norm",
    "check_center_reading_weights",
    "assert_center_reading_weights",
    "check_center_writing_weights",
    "assert_center_writing_weights",
    "check_center_unembed",
    "assert_center_unembed",
    "check_layer_norm_to_rms_norm",
    "assert_layer_norm_to_rms_norm",
    "check_fold_rms_norm",
    "assert_fold_rms_norm",
    "check_shortformer_to_tables",
    "assert_shortformer_to_tables",
    "check_fold_value_biases",
    "assert_fold_value_biases",
    "check_remove_key_biases",
    "assert_remove_key_biases",
    "check_refactor_factored_attn_matrices",
    "assert_refactor_factored_attn_matrices",
    "check_rotate_residual_stream",
    "assert_rotate_residual_stream",
    "check_permute_heads",
    "assert_permute_heads",
    "check_permute_neurons",
    "assert_permute_neurons",
    "check_permute_experts",
    "assert_permute_experts",
    "check_migrate_norm_scales",
    "assert_migrate_norm_scales",
    "check_rotate_heads",
    "assert_rotate_heads",
    "check_scale_neurons",
    "assert_scale_neurons",
    "check_fold_embedding_scale",
    "assert_fold_embedding_scale",
    "check_fold_logit_scale",
    "assert_fold_logit_scale",
]


class NotEquivalentError(AssertionError):
    """Two models compute different log-probs: :func:`assert_equivalent` failed.

    ``comparison`` is the failed :class:`Comparison`; ``diagnosis`` the :class:`Diagnosis` that
    explains it (``None`` when diagnosis was switched off).
    """

    def __init__(self, message: str, comparison: Comparison, diagnosis=None):
        super().__init__(message)
        self.comparison = comparison
        self.diagnosis = diagnosis


@torch.no_grad()  # weights that require grad are compared as plain tensors
@with_check_threads
def assert_equivalent(
    before,
    after,
    cfg=None,
    *,
    after_cfg=None,
    tokens: torch.Tensor | None = None,
    atol: float | None = None,
    diagnose: bool = True,
) -> Comparison:
    """Raise :class:`NotEquivalentError` (an ``AssertionError``) unless ``after`` computes the
    same log-probs as ``before`` and (with ``diagnose=True``) its tensors pass their certificates;
    return the :class:`Comparison` otherwise.

    The tensors (with ``diagnose=True``), one rule for every dtype and form: the registered
    identities are replayed on ``before`` (in float32 for half precision); no tensor of ``after``
    may be a named wrong rewrite's (such a rewrite fails even where the tokens do not show it). A
    tensor the replay does not reproduce within ``CERTIFICATE_ULPS`` (1) unit in the last place
    (plus the rewrite's own rounding) is a *near miss* when every entry is within ``NEAR_ULPS``
    (32) units, and fails: a slight change of the rewrite, which at a few bits of precision the
    log-probs cannot tell from rounding (a 1 % change of one row of a bfloat16 tensor). Any other
    such tensor is a *change* no identity explains: the replay's end and it with the changed
    entries run in float64, and the log-probs may differ only by what rounding the changed
    entries alone moves them (``circuitmath._diagnosis._unexplained``): an exact rewrite no
    identity names passes, in bfloat16 too, and a change of one row fails. Checkpoint folders are
    judged by the same rule, a part at a time.

    ``before`` and ``after`` are state dicts, model objects (see the module's documentation),
    safetensors paths or checkpoint folders (a Hugging
    Face folder, sharded or not, or one written by ``python -m circuitmath process``: checked a
    block at a time, never loaded whole, as ``check MODEL --processed OTHER`` does); ``cfg`` is ``before``'s
    :class:`~circuitmath.Config` or Hugging Face config (``None`` for a file that carries its
    config). ``after_cfg`` defaults to the file's metadata, else to ``cfg`` or the processed form
    of it that ``after``'s tensors fit (a folded LayerNorm is ``"LNPre"``: see :func:`diagnose`).
    ``tokens`` ``[batch, pos]`` default to :func:`default_tokens`. The tolerance is that of
    :func:`compare_log_probs`; ``atol`` overrides it.

    On failure the message says where the largest difference is and, with ``diagnose=True``,
    which identity's precondition or conclusion is violated, in which parameters (layer, head,
    name) and by how much (:func:`diagnose`). Inside a hypothesis test the diagnosis runs only on
    the final, shrunk failing example: the comparison alone decides while hypothesis shrinks.
    The diagnosis names the tensors as ``after`` does.
    """
    if _checkpoint_folder(before) or _checkpoint_folder(after):
        return _assert_checkpoints_equivalent(before, after, cfg, after_cfg, tokens, atol)
    first, second, notes = _diagnosis.resolve_pair(before, after, cfg, after_cfg)
    tokens = default_tokens(first.cfg) if tokens is None else tokens
    result, first_log_probs, second_log_probs = compare_with_log_probs(
        first.state_dict, first.cfg, second.state_dict, second.cfg, tokens
    )
    tolerance = result.tolerance if atol is None else atol
    plan = _diagnosis._recorded_plan(first.cfg, second.cfg, notes) if diagnose else None
    agree = result.max_abs_error <= tolerance
    verdict = _diagnosis.tensor_verdict(first, second, plan, tokens) if diagnose and agree else None
    if agree and (verdict is None or verdict.ok):
        return result
    b, p, t = result.where
    if not agree:
        message = (f"models differ: max |Δ log-prob| = {result.max_abs_error:.3g} > tolerance {tolerance:.3g}"
                   f" (batch {b}, position {p}, token {t})")
    else:
        message = (f"the log-probs agree (max |Δ log-prob| = {result.max_abs_error:.3g} <= tolerance"
                   f" {tolerance:.3g}), but " + _tensor_failure(verdict, coarser(first.dtype, second.dtype)))
    found = None
    if diagnose and not _shrinking():
        # the two forward passes just made are handed to the diagnosis, not made again
        computed = ((first.state_dict, first_log_probs), (second.state_dict, second_log_probs))
        found = speak(_diagnosis.replay_and_explain(first, second, tokens, plan, notes, computed=computed,
                                                    replayed=verdict and verdict.replayed), second.names)
        message += "\n\ndiagnosis:\n" + str(found)
    elif diagnose:
        message += "\n(diagnosed on hypothesis's final, shrunk example only)"
    raise NotEquivalentError(message, result, found)


def conformance(
    process: Callable,
    *,
    families=None,
    dtypes=(torch.float32, torch.bfloat16),
    form: str | None = None,
    seed: int = 0,
) -> ConformanceTable:
    """Run ``process`` on every family's realistic random model in each dtype and judge it:
    what a library that processes weights runs in its CI.

    ``process`` takes either a circuitmath state dict and its :class:`~circuitmath.Config`
    (``form="state_dict"``) and returns ``(state_dict, config)`` or a state dict alone (the
    config unchanged), as :func:`circuitmath.process_weights` does; or a ``transformers`` model
    (``form="model"``) and returns a model object (a ``transformers`` model, a TransformerLens
    bridge: :func:`circuitmath.peers.transformer_lens_bridge`). ``form=None`` reads it from the
    signature: two required positional parameters are the state dict form, one the model form.
    ``process`` gets a copy; the model it is judged against is never handed out.

    ``families``: names or :class:`~circuitmath.io.Family` objects (default: every family of
    :data:`circuitmath.io.FAMILIES`); ``dtypes``: the dtypes each model is built and processed
    in; ``seed``: the weights' seed. Each model is built by ``transformers`` from the family's
    tiny ``config.json`` with :func:`~circuitmath.random_state_dict`'s weights (gains far from
    1, some negative, unit-scale biases, outlier residual dimensions, logits beyond a softcap).

    Each result is judged by :func:`assert_equivalent` against the model ``process`` was given.
    Returns a :class:`~circuitmath._conformance.ConformanceTable`: family by dtype, ``.ok``,
    ``.failures()`` (each a ``Verdict`` with its :class:`Diagnosis`), ``str()`` the Markdown
    table and each failure's diagnosis. A processing that raises fails its cell with the error;
    one that returns what its form does not is a :class:`~circuitmath.CircuitMathError` naming
    what it returned.

    >>> from circuitmath import process_weights
    >>> table = conformance(process_weights, families=["LLaMA"], dtypes=(torch.float32,))
    >>> table.ok, [(v.family, v.dtype, v.passed) for v in table]
    (True, [('LLaMA', 'float32', True)])
    """
    return run_conformance(process, assert_equivalent, families=families, dtypes=dtypes, form=form, seed=seed)


def _tensor_failure(verdict, dtype: torch.dtype) -> str:
    """Why the tensors fail although the log-probs agree (``verdict``: a failed
    :class:`~circuitmath._diagnosis.TensorVerdict`)."""
    if verdict.named:
        return "a tensor is rewritten by a named wrong rewrite"
    if verdict.near:
        off = verdict.near
        return (f"{', '.join(off)} {'is' if len(off) == 1 else 'are'} not the exact rewrite of the original: an entry"
                f" is more than {CERTIFICATE_ULPS} unit in the last place of {dtype} (and the rewrite's own rounding)"
                f" off it, and none more than {NEAR_ULPS}: a slight change of the rewrite, which log-probs at this"
                " precision cannot tell from rounding")
    changes = verdict.changes
    return (f"the changes no identity explains ({', '.join(verdict.changed)}) move the log-probs, run in float64, by"
            f" {changes.max_abs_error:.3g}, above {changes.tolerance:.3g}, the tolerance of the rounding of the"
            " changed entries")


def _checkpoint_folder(model) -> bool:
    """Whether ``model`` is a checkpoint folder (a path to a directory, or one opened)."""
    from ._checkpoint import Checkpoint

    return isinstance(model, Checkpoint) or (isinstance(model, (str, os.PathLike)) and Path(model).is_dir())


def _assert_checkpoints_equivalent(before, after, cfg, after_cfg, tokens, atol) -> Comparison:
    """:func:`assert_equivalent` for checkpoint folders, read a block at a time (the streaming
    check of ``python -m circuitmath check MODEL --processed OTHER``): the log-probs, and every
    tensor against its certificate when ``after`` records process_weights steps."""
    from ._streaming_check_processed import check_processed

    if after_cfg is not None:
        raise ArgumentTypeError("after_cfg: a processed checkpoint carries its config; pass none")
    for which, model, other in (("before", before, after), ("after", after, before)):
        if not _checkpoint_folder(other):
            raise ArgumentTypeError(
                f"{which} is the checkpoint folder {getattr(model, 'path', model)}, the other model is a"
                f" {type(other).__name__}: pass two folders (checked a block at a time), or load the folder"
                " (circuitmath.io.open_checkpoint(folder).load()) and pass two state dicts")
    _diagnosis._misuse.refuse_misused_checkpoints(before, after, cfg)
    report = check_processed(before, after, cfg, tokens=default_tokens if tokens is None else tokens)
    report = speak(report, _diagnosis._names.checkpoint_names(after))  # in after's names
    row = report.rows[0]
    result = Comparison(max_abs_error=row["max_abs_error"], tolerance=row["tolerance"], where=tuple(row["where"]))
    tolerance = result.tolerance if atol is None else atol
    if result.max_abs_error <= tolerance and all(r["status"] != "violated" for r in report.rows[1:]):
        return result
    raise NotEquivalentError(f"{after} is not a valid processing of {before}:\n{report}", result, report)


def _shrinking() -> bool:
    """Whether this runs inside a hypothesis test on an example other than the final one.

    Hypothesis re-runs a failing test hundreds of times while it shrinks and explains the
    failure; the comparison alone decides each of those runs, and the diagnosis (many times the
    cost of the comparison) runs once, on the final example, whose error is the one reported.
    """
    try:
        from hypothesis.control import current_build_context, currently_in_test_context
    except ImportError:  # pragma: no cover - hypothesis is a dependency
        return False
    return currently_in_test_context() and not current_build_context().is_final


@with_check_threads
def diagnose(before, after, cfg=None, *, after_cfg=None, tokens=None, progress=None) -> "Diagnosis":
    """Explain ``after`` as a processing of ``before``: which identities, which went wrong, where.

    ``before``, ``after``, ``cfg``, ``after_cfg`` and ``tokens`` as for :func:`assert_equivalent`;
    ``progress(done, total, what)`` is called as the work proceeds. The replay follows
    ``after_cfg.applied`` when it records identities beyond ``cfg.applied``; otherwise each weight
    identity is kept when its rewrite reproduces more of ``after`` than leaving the model alone.

    Returns a :class:`Diagnosis`: one :class:`Finding` per replayed identity (its rewrite:
    ``"exact"`` or the wrong rewrite that reproduced ``after``; its precondition, when the
    identity refuses the model; the |Δ log-prob| it is responsible for), a ``residual`` row for
    tensors no replayed rewrite reproduces (each naming the identity that last rewrote it), and
    ``before -> after``. ``str()`` of it is a table with explanations; ``.ok`` says whether all
    holds; ``.culprits()`` lists the parameters of violated rows.

    >>> import torch
    >>> from circuitmath import Config, center_unembed, random_state_dict
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    >>> before = random_state_dict(cfg, seed=0, dtype=torch.float64)
    >>> after = dict(before, **{"unembed.W_U": before["unembed.W_U"] - before["unembed.W_U"].mean(0)})
    >>> found = diagnose(before, after, cfg)
    >>> found.ok, [(f.name, f.rewrite) for f in found.violations if f.kind == "identity"]
    (False, [('center_unembed', 'center_unembed.over_d_model')])
    """
    return _diagnosis.diagnose(before, after, cfg, after_cfg=after_cfg, tokens=tokens, progress=progress)


@with_check_threads
def check_model(model, cfg=None, *, tokens=None, progress=None) -> "Diagnosis":
    """Apply every weight identity that applies to ``model`` and compare log-probs, one row each.

    An identity that refuses the model is ``"not applicable"``, its reason the broken
    precondition. ``model`` and ``cfg`` as ``before`` and ``cfg`` of :func:`assert_equivalent`.

    >>> from circuitmath import Config, random_state_dict
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    >>> rows = {f.name: f.status for f in check_model(random_state_dict(cfg, seed=0), cfg).findings}
    >>> rows["fold_layer_norm"], rows["fold_rms_norm"]
    ('holds', 'not applicable')
    """
    return _diagnosis.check_model(model, cfg, tokens=tokens, progress=progress)


@with_check_threads
def check_identity(name: str, before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check that ``after`` is the registered identity ``name`` applied to ``before``.

    The replay is this identity alone, after its own preparation (centering the reading weights
    of a LayerNorm model includes the fold). Its row is ``"not recognised"`` when none of the
    tensors the identity rewrites matches its rewrite, ``"violated"`` when the log-probs change;
    a wrong rewrite that reproduces ``after`` is named. Arguments as for :func:`assert_equivalent`.
    """
    return _diagnosis.check_identity(name, before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def _checker(identity) -> Callable:
    """``check_<function>(before, after, cfg=None, *, after_cfg=None, tokens=None)`` for a
    registered identity whose transform is the public ``circuitmath.<function>``."""

    def check(before, after, cfg=None, *, after_cfg=None, tokens=None) -> Diagnosis:
        return check_identity(identity.name, before, after, cfg, after_cfg=after_cfg, tokens=tokens)

    check.__name__ = check.__qualname__ = f"check_{identity.function}"
    check.__module__ = __name__
    note = identity.check_note or ""
    if note and not note[0].isupper():
        doc = (f"Check ``after`` against :func:`circuitmath.{identity.function}` of ``before`` ({note};"
               " see :func:`check_identity`).")
    else:
        doc = (f"Check ``after`` against :func:`circuitmath.{identity.function}` of ``before``"
               + (f".\n\n{note} See :func:`check_identity`." if note else " (see :func:`check_identity`)."))
    check.__doc__ = doc + f"\n\nThe identity is ``{identity.name}``: {identity.summary}."
    return check


def _asserting(check: Callable) -> Callable:
    """``assert_<function>``: :func:`check_<function>`, raising :class:`NotEquivalentError` (an
    ``AssertionError`` whose message is the whole report) unless the report is ok."""

    def assert_(before, after, cfg=None, *, after_cfg=None, tokens=None) -> Diagnosis:
        report = check(before, after, cfg, after_cfg=after_cfg, tokens=tokens)
        if not report.ok:
            raise NotEquivalentError(str(report), report.comparison, report)
        return report

    assert_.__name__ = assert_.__qualname__ = check.__name__.replace("check_", "assert_", 1)
    assert_.__module__ = __name__
    assert_.__doc__ = (f"Raise :class:`NotEquivalentError` with the report of :func:`{check.__name__}` unless it"
                       " is ok; return the report otherwise.")
    return assert_


#: The per-identity checkers, one per registered weight identity with a public transform,
#: derived from the registry (by identity name); each has an ``assert_`` form that raises instead
#: of returning a failed report. The module-level names below are these, written out so that
#: they are defined statically; ``tests/test_registry.py`` checks that they are exactly the registry's.
CHECKERS: dict[str, Callable] = {
    identity.name: _checker(identity) for identity in _diagnosis.weight_identities(symmetries=True) if identity.function
}


def _pair(public: Callable) -> tuple[Callable, Callable]:
    """The checker of the identity whose public transform is ``public``, and its ``assert_`` form."""
    check = next(CHECKERS[identity.name] for identity in _diagnosis.weight_identities(symmetries=True)
                 if identity.public is public)
    return check, _asserting(check)


check_fold_layer_norm, assert_fold_layer_norm = _pair(_transforms.fold_layer_norm)
check_center_reading_weights, assert_center_reading_weights = _pair(_transforms.center_reading_weights)
check_center_writing_weights, assert_center_writing_weights = _pair(_transforms.center_writing_weights)
check_center_unembed, assert_center_unembed = _pair(_transforms.center_unembed)
check_layer_norm_to_rms_norm, assert_layer_norm_to_rms_norm = _pair(_transforms.layer_norm_to_rms_norm)
check_fold_rms_norm, assert_fold_rms_norm = _pair(_transforms.fold_rms_norm)
check_shortformer_to_tables, assert_shortformer_to_tables = _pair(_transforms.shortformer_to_tables)
check_fold_value_biases, assert_fold_value_biases = _pair(_transforms.fold_value_biases)
check_remove_key_biases, assert_remove_key_biases = _pair(_transforms.remove_key_biases)
check_refactor_factored_attn_matrices, assert_refactor_factored_attn_matrices = _pair(_transforms.refactor_factored_attn_matrices)
check_rotate_residual_stream, assert_rotate_residual_stream = _pair(_transforms.rotate_residual_stream)
check_permute_heads, assert_permute_heads = _pair(_transforms.permute_heads)
check_permute_neurons, assert_permute_neurons = _pair(_transforms.permute_neurons)
check_permute_experts, assert_permute_experts = _pair(_transforms.permute_experts)
check_migrate_norm_scales, assert_migrate_norm_scales = _pair(_transforms.migrate_norm_scales)
check_rotate_heads, assert_rotate_heads = _pair(_transforms.rotate_heads)
check_scale_neurons, assert_scale_neurons = _pair(_transforms.scale_neurons)
check_fold_embedding_scale, assert_fold_embedding_scale = _pair(_transforms.fold_embedding_scale)
check_fold_logit_scale, assert_fold_logit_scale = _pair(_transforms.fold_logit_scale)
