"""Public checkers: is a processed state dict the same function as the original?

Like :func:`torch.testing.assert_close`, but for whole models: both state dicts run through the
reference forward pass and their log-probabilities are compared. Log-probabilities, not logits:
centring the unembed legitimately shifts every logit of a position by the same constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._config import Config
from ._reference import log_probs
from ._state import StateDict, validate_state_dict

__all__ = ["Comparison", "logprob_tolerance", "compare_log_probs", "assert_equivalent", "default_tokens"]

#: Safety factor of :func:`logprob_tolerance`. Measured with the LayerNorm fold and reading-weight
#: centring on 620 models drawn from :mod:`circuitmath.strategies` (float64 and float32, up to 2
#: layers, outlier dimensions up to 30x): |Δ log-prob| divided by the bound without this factor
#: had median 0.3 and maximum 2.8. 16 leaves a margin of more than 5 over the worst case seen,
#: while the wrong folds the tests try miss by many orders of magnitude in float64.
SAFETY = 16.0


def logprob_tolerance(cfg: Config, dtype: torch.dtype, scale: float) -> float:
    """Largest |Δ log-prob| two exactly-equivalent models may show from rounding alone.

    ``SAFETY * u * (n_layers + 1) * sqrt(K) * max(1, scale)``, where

    - ``u`` is the unit roundoff of ``dtype`` (``2**-53`` for float64, ``2**-24`` for float32,
      ``2**-8`` for bfloat16);
    - ``K`` is the longest inner product in the model (``d_model``, ``d_mlp`` or ``d_vocab``):
      rounding errors of a length-``K`` dot product grow like ``sqrt(K) * u`` times its size;
    - each layer (and the unembed) adds one such error, relative to the size of the values, and
      ``scale``, the largest |log-prob|, is the size of what is finally compared;
    - ``SAFETY`` (16) covers two independent computations (one per model), the factor of at most
      2 by which log-softmax can amplify a logit error, and amplification by norms and softmax;
      its value is measured (see :data:`SAFETY`).
    """
    u = torch.finfo(dtype).eps / 2
    k = max(cfg.d_model, cfg.d_mlp or 0, cfg.d_vocab)
    return SAFETY * u * (cfg.n_layers + 1) * math.sqrt(k) * max(1.0, float(scale))


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


def compare_log_probs(
    before: StateDict,
    before_cfg: Config,
    after: StateDict,
    after_cfg: Config,
    tokens: torch.Tensor | None = None,
) -> Comparison:
    """Run both models on ``tokens`` (default: :func:`default_tokens`) and compare log-probs.

    The tolerance is :func:`logprob_tolerance` for the less precise of the two dtypes.
    """
    dtype_before = validate_state_dict(before, before_cfg)
    dtype_after = validate_state_dict(after, after_cfg)
    tokens = default_tokens(before_cfg) if tokens is None else tokens
    a = log_probs(before, before_cfg, tokens).double()
    b = log_probs(after, after_cfg, tokens).double()
    diff = (a - b).abs()
    flat = int(diff.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    coarse = max((dtype_before, dtype_after), key=lambda d: torch.finfo(d).eps)
    return Comparison(
        max_abs_error=float(diff.max()),
        tolerance=logprob_tolerance(before_cfg, coarse, float(a.abs().max())),
        where=where,
    )


def assert_equivalent(
    before: StateDict,
    after: StateDict,
    cfg: Config,
    *,
    after_cfg: Config | None = None,
    tokens: torch.Tensor | None = None,
    atol: float | None = None,
) -> Comparison:
    """Raise ``AssertionError`` unless ``after`` computes the same log-probs as ``before``.

    ``after_cfg`` defaults to ``cfg`` (a processed model usually has its own config, e.g. after a
    LayerNorm fold its ``normalization_type`` is ``"LNPre"``). ``atol`` overrides the tolerance.
    """
    result = compare_log_probs(before, cfg, after, after_cfg or cfg, tokens)
    tolerance = result.tolerance if atol is None else atol
    if not result.max_abs_error <= tolerance:
        b, p, t = result.where
        raise AssertionError(
            f"models differ: max |Δ log-prob| = {result.max_abs_error:.3g} > tolerance {tolerance:.3g}"
            f" (batch {b}, position {p}, token {t})"
        )
    return result
