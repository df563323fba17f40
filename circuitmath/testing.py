"""Public checkers: is a processed state dict the same function as the original, and if not, why?

Like :func:`torch.testing.assert_close`, but for whole models: both state dicts run through the
reference forward pass and their log-probabilities are compared. Log-probabilities, not logits:
centring the unembed legitimately shifts every logit of a position by the same constant.

Models are accepted as state dicts in TransformerLens format (with a :class:`~circuitmath.Config`)
or Hugging Face format (with the Hugging Face config, converted by :func:`circuitmath.io.from_hf`),
or as safetensors files (a file written by :func:`circuitmath.io.save` carries its config).

When two models differ, :func:`diagnose` explains how: it replays the registered identities on
the original model and compares the processed model's tensors with each exact rewrite, then with
the identity's known wrong rewrites (its negative twins, done numerically), and names the
identity whose precondition or conclusion is violated, the parameters responsible (layer, head,
name) and by how much, and the change in log-probs each identity is responsible for.
:func:`assert_equivalent` prints that diagnosis when it fails. The per-identity checkers
(:func:`check_fold_layer_norm` and the others) check one identity's rewrite.

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
the wrong rewrite layer_norm_fold.drop_bias explains blocks.0.attn.b_V: forget the LayerNorm bias term b W
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._config import Config
from ._reference import log_probs
from ._state import StateDict, validate_state_dict

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
    "check_fold_layer_norm",
    "check_center_reading_weights",
    "check_center_writing_weights",
    "check_center_unembed",
    "check_fold_value_biases",
    "check_remove_key_biases",
    "check_refactor_factored_attn_matrices",
    "check_fold_rms_norm",
    "check_layer_norm_to_rms_norm",
    "check_shortformer_to_tables",
    "Diagnosis",
    "Finding",
    "ParameterMismatch",
]

#: Safety factors of :func:`logprob_tolerance`: ``SAFETY`` multiplies the a-priori rounding
#: bound, ``SENSITIVITY_SAFETY`` the measured sensitivity. Measured on models drawn from
#: :mod:`circuitmath.strategies` (float64 and float32, up to 2 layers, d_model from 2, outlier
#: dimensions up to 30x): on 1000 random models per dtype |Δ log-prob| / tolerance had median
#: 0.01 and maximum 0.08; the worst case hypothesis found by searching for failures was 0.5 (a
#: float64 model whose log-probs are all below 1, so the a-priori term dominates). Without the
#: sensitivity term the a-priori bound was exceeded up to 19x (tiny LayerNorms over nearly
#: constant residuals). The sensitivity is measured, so its factor only covers the second model
#: and log-softmax (4); the a-priori term covers what it does not model (32). In bfloat16
#: (compared in float32, see :func:`compute_dtype`) a d_model 64 model's correct transforms stay
#: below 0.13 of the tolerance while every wrong transform of the test suite exceeds it. Float64
#: tolerances stay near 1e-13: wrong transforms miss them by ten orders of magnitude.
SAFETY = 32.0
SENSITIVITY_SAFETY = 4.0


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a comparison runs in: the state dicts' own, but float32 for half precisions.

    A forward pass in bfloat16 or float16 is noisier than many wrong transforms are wrong
    (a dropped LayerNorm bias moves log-probs by a few nats; a bfloat16 forward pass of a small
    model by about as much), so half-precision weights are compared in float32 and only their
    own rounding counts.
    """
    return torch.float32 if torch.finfo(dtype).bits < 32 else dtype


def rounding_sensitivity(
    state_dict: StateDict,
    cfg: Config,
    tokens: torch.Tensor,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    computed: torch.Tensor | None = None,
) -> float:
    """How far this model's log-probs move from rounding alone, in ``dtype``.

    The sum of two measured effects, each the largest |Δ log-prob| over ``tokens``:

    - rounding the weights once more: every weight is multiplied by ``1 + u * xi`` (``xi``
      standard normal, ``u`` the unit roundoff of ``dtype``) and both versions run in float64;
    - rounding the computation: the forward pass in :func:`compute_dtype` against float64
      (zero when that is float64).

    Both measure the model's own conditioning: a LayerNorm over a nearly constant residual, a
    sharp softmax or an outlier dimension amplify rounding, and an exact transform's result
    differs from the original by rounding of these kinds.

    ``computed``: this model's log-probs on ``tokens`` computed in :func:`compute_dtype`, when
    the caller has them already (``[batch, pos, d_vocab]``); they are not computed again.
    """
    u = _unit_roundoff(dtype)
    exact = {k: v.double() for k, v in state_dict.items()}
    reference = log_probs(exact, cfg, tokens)
    g = torch.Generator().manual_seed(seed)
    # The change u * xi * w is computed in float32 (several times faster than float64 for big
    # models) and added in float64: it is of the order of u, so its own rounding does not matter.
    nudged = {
        k: exact[k] + torch.randn(v.shape, generator=g, dtype=torch.float32).mul_(u).mul_(v.float())
        for k, v in state_dict.items()
    }
    weights = float((reference - log_probs(nudged, cfg, tokens)).abs().max())
    run_in = compute_dtype(dtype)
    if run_in == torch.float64:
        return weights
    if computed is None:
        computed = log_probs({k: v.to(run_in) for k, v in state_dict.items()}, cfg, tokens)
    return weights + float((computed.double() - reference).abs().max())


def logprob_tolerance(cfg: Config, dtype: torch.dtype, scale: float, sensitivity: float = 0.0) -> float:
    """Largest |Δ log-prob| two exactly-equivalent models may show from rounding alone.

    ``SAFETY * u * (n_layers + 1) * sqrt(K) * max(1, scale) + SENSITIVITY_SAFETY * sensitivity``,
    where

    - ``u`` is the unit roundoff of the dtype the forward pass runs in (:func:`compute_dtype`:
      ``2**-53`` for float64, ``2**-24`` for float32 and, via float32, for half precisions);
    - ``K`` is the longest inner product in the model (``d_model``, ``d_mlp`` or ``d_vocab``):
      rounding errors of a length-``K`` dot product grow like ``sqrt(K) * u`` times its size;
    - each layer (and the unembed) adds one such error, relative to the size of the values, and
      ``scale``, the largest |log-prob|, is the size of what is finally compared;
    - ``sensitivity`` (:func:`rounding_sensitivity`) is how much this model amplifies rounding
      of its weights and of its forward pass: the first term assumes a well-conditioned model,
      this one measures the actual one;
    - the factors cover two independent computations (one per model), the factor of at most 2
      by which log-softmax can amplify a logit error and, for the a-priori term, what it does
      not model; their values are measured (see :data:`SAFETY`).
    """
    u = _unit_roundoff(compute_dtype(dtype))
    k = max(cfg.d_model, cfg.d_mlp or 0, cfg.d_vocab)
    return SAFETY * u * (cfg.n_layers + 1) * math.sqrt(k) * max(1.0, float(scale)) + SENSITIVITY_SAFETY * sensitivity


@dataclass(frozen=True)
class Comparison:
    """The result of comparing two models' log-probabilities on the same tokens."""

    max_abs_error: float
    tolerance: float
    where: tuple[int, int, int]  # (batch, position, token) of the largest difference

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= self.tolerance


def default_tokens(cfg: Config, *, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Random tokens ``[batch, n_ctx]`` (at most 32 positions) from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.d_vocab, (batch, min(cfg.n_ctx, 32)), generator=g)


@torch.no_grad()  # weights that require grad are compared as plain tensors
def compare_log_probs(
    before: StateDict,
    before_cfg: Config,
    after: StateDict,
    after_cfg: Config,
    tokens: torch.Tensor | None = None,
) -> Comparison:
    """Run both models on ``tokens`` (default: :func:`default_tokens`) and compare log-probs.

    Both run in :func:`compute_dtype` of the less precise of the two dtypes; the tolerance is
    :func:`logprob_tolerance` with the ``before`` model's :func:`rounding_sensitivity`.
    """
    dtype_before = validate_state_dict(before, before_cfg)
    dtype_after = validate_state_dict(after, after_cfg)
    tokens = default_tokens(before_cfg) if tokens is None else tokens
    coarse = max((dtype_before, dtype_after), key=lambda d: torch.finfo(d).eps)
    run_in = compute_dtype(coarse)
    a = log_probs({k: v.to(run_in) for k, v in before.items()}, before_cfg, tokens).double()
    b = log_probs({k: v.to(run_in) for k, v in after.items()}, after_cfg, tokens).double()
    diff = (a - b).abs()
    flat = int(diff.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    sensitivity = rounding_sensitivity(before, before_cfg, tokens, coarse)
    return Comparison(
        max_abs_error=float(diff.max()),
        tolerance=logprob_tolerance(before_cfg, coarse, float(a.abs().max()), sensitivity),
        where=where,
    )


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
    same log-probs as ``before``; return the :class:`Comparison` otherwise.

    ``before`` and ``after`` are state dicts or safetensors paths; ``cfg`` is ``before``'s
    :class:`~circuitmath.Config` or Hugging Face config (``None`` for a file that carries its
    config). ``after_cfg`` defaults to the file's metadata, else to ``cfg`` or the processed form
    of it that ``after``'s tensors fit (a folded LayerNorm is ``"LNPre"``: see :func:`diagnose`).
    ``tokens`` ``[batch, pos]`` default to :func:`default_tokens`. The tolerance is that of
    :func:`compare_log_probs`; ``atol`` overrides it.

    On failure the message says where the largest difference is and, with ``diagnose=True``,
    which identity's precondition or conclusion is violated, in which parameters (layer, head,
    name) and by how much (:func:`diagnose`).
    """
    before_sd, before_cfg, after_sd, resolved_after_cfg, _notes = _diagnosis._inputs(before, after, cfg, after_cfg)
    tokens = default_tokens(before_cfg) if tokens is None else tokens
    result = compare_log_probs(before_sd, before_cfg, after_sd, resolved_after_cfg, tokens)
    tolerance = result.tolerance if atol is None else atol
    if result.max_abs_error <= tolerance:
        return result
    b, p, t = result.where
    message = (
        f"models differ: max |Δ log-prob| = {result.max_abs_error:.3g} > tolerance {tolerance:.3g}"
        f" (batch {b}, position {p}, token {t})"
    )
    found = None
    if diagnose:
        found = _diagnosis.diagnose(before_sd, after_sd, before_cfg, after_cfg=resolved_after_cfg, tokens=tokens)
        message += "\n\ndiagnosis:\n" + str(found)
    raise NotEquivalentError(message, result, found)


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


def check_model(model, cfg=None, *, tokens=None, progress=None) -> "Diagnosis":
    """Apply every weight identity that applies to ``model`` and compare log-probs, one row each.

    An identity that refuses the model is ``"not applicable"``, its reason the broken
    precondition. ``model`` and ``cfg`` as ``before`` and ``cfg`` of :func:`assert_equivalent`.

    >>> from circuitmath import Config, random_state_dict
    >>> cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    >>> rows = {f.name: f.status for f in check_model(random_state_dict(cfg, seed=0), cfg).findings}
    >>> rows["layer_norm_fold"], rows["rms_norm_fold"]
    ('holds', 'not applicable')
    """
    return _diagnosis.check_model(model, cfg, tokens=tokens, progress=progress)


def check_identity(name: str, before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check that ``after`` is the registered identity ``name`` applied to ``before``.

    The replay is this identity alone, after its own preparation (centring the reading weights
    of a LayerNorm model includes the fold). Its row is ``"not recognised"`` when none of the
    tensors the identity rewrites matches its rewrite, ``"violated"`` when the log-probs change;
    a wrong rewrite that reproduces ``after`` is named. Arguments as for :func:`assert_equivalent`.
    """
    return _diagnosis.check_identity(name, before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def check_fold_layer_norm(before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check ``after`` against :func:`circuitmath.fold_layer_norm` of ``before`` (see :func:`check_identity`)."""
    return check_identity("layer_norm_fold", before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def check_center_reading_weights(before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check ``after`` against :func:`circuitmath.center_reading_weights` of ``before`` (folded first if
    it is a LayerNorm model; see :func:`check_identity`)."""
    return check_identity("center_reading_weights", before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def check_center_writing_weights(before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check ``after`` against :func:`circuitmath.center_writing_weights` of ``before`` (see :func:`check_identity`)."""
    return check_identity("center_writing_weights", before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def check_center_unembed(before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check ``after`` against :func:`circuitmath.center_unembed` of ``before`` (see :func:`check_identity`)."""
    return check_identity("center_unembed", before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def check_fold_value_biases(before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check ``after`` against :func:`circuitmath.fold_value_biases` of ``before`` (see :func:`check_identity`)."""
    return check_identity("fold_value_biases", before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def check_remove_key_biases(before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check ``after`` against :func:`circuitmath.remove_key_biases` of ``before`` (see :func:`check_identity`)."""
    return check_identity("remove_key_biases", before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def check_refactor_factored_attn_matrices(before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check ``after`` against :func:`circuitmath.refactor_factored_attn_matrices` of ``before``.

    Another balanced factorisation (other signs of the singular vectors) computes the same
    function but is not recognised tensor by tensor: its row is ``"not recognised"`` while the
    log-probs agree. See :func:`check_identity`.
    """
    return check_identity("refactor_factored_attn_matrices", before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def check_fold_rms_norm(before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check ``after`` against :func:`circuitmath.fold_rms_norm` of ``before`` (see :func:`check_identity`)."""
    return check_identity("rms_norm_fold", before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def check_layer_norm_to_rms_norm(before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check ``after`` against :func:`circuitmath.layer_norm_to_rms_norm` of ``before`` (folded and with its
    writing weights centred first, as the identity needs; see :func:`check_identity`)."""
    return check_identity("layer_norm_to_rms_norm", before, after, cfg, after_cfg=after_cfg, tokens=tokens)


def check_shortformer_to_tables(before, after, cfg=None, *, after_cfg=None, tokens=None) -> "Diagnosis":
    """Check ``after`` against :func:`circuitmath.shortformer_to_tables` of ``before`` (see :func:`check_identity`)."""
    return check_identity("shortformer_tables", before, after, cfg, after_cfg=after_cfg, tokens=tokens)


# The diagnosis engine builds on the comparisons above, so it is imported once they are defined.
from . import _diagnosis  # noqa: E402
from ._diagnosis import Diagnosis, Finding, ParameterMismatch  # noqa: E402
