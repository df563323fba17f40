"""Log-probabilities of the states a check compares, each computed once, and their tolerance."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .._compare import Comparison, compute_dtype, in_dtype, logprob_tolerance, rounding_sensitivity
from .._config import Config
from .._reference import log_probs
from ._tensors import _largest_entry

__all__ = ["SENSITIVITY_POSITIONS", "sensitivity_window", "compared", "same_model"]


#: Positions the rounding sensitivity is measured on, at least (see :func:`sensitivity_window`).
SENSITIVITY_POSITIONS = 32


def sensitivity_window(tokens: torch.Tensor) -> tuple[int, int]:
    """``(rows, positions)``: the sensitivity is measured on ``tokens[:rows, :positions]``, the
    first ``SENSITIVITY_POSITIONS`` positions of as many whole sequences as it takes to reach
    ``SENSITIVITY_POSITIONS`` positions (all of them when there are fewer)."""
    positions = min(tokens.shape[1], SENSITIVITY_POSITIONS)
    return min(tokens.shape[0], -(-SENSITIVITY_POSITIONS // positions)), positions


class _LogProbs:
    """Log-probs of states on fixed tokens, each state's computed once, and the tolerance.

    Every state runs in :func:`~circuitmath.testing.compute_dtype` of ``dtype`` (the coarser
    dtype of the models compared). The tolerance is :func:`~circuitmath.testing.logprob_tolerance`
    with the rounding sensitivity of the model given to :meth:`set_reference`, measured on the
    tokens of :func:`sensitivity_window` (at least ``SENSITIVITY_POSITIONS`` positions, whole
    sequences where they are shorter): it takes two float64 forward passes, and on a
    GPT-2-shaped model (d_vocab 50257) one sequence of 32 positions gave within 10% of the value
    over 4 x 128 positions, far inside the safety factor. With 4 positions per sequence, the first
    sequence alone gave down to a sixth of the value over all 4 (float16, 60 seeds), and a check
    of exact rewrites failed (2 of 60 seeds).
    """

    def __init__(self, tokens: torch.Tensor, dtype: torch.dtype):
        self.tokens = tokens
        self.dtype = dtype
        self.run_in = compute_dtype(dtype)
        self._cache: dict[int, tuple[Mapping, Config | None, torch.Tensor]] = {}
        self._sensitivity: float | None = 0.0
        self._reference: tuple[Mapping, Config] | None = None
        self.cfg: Config | None = None

    def __call__(self, state: Mapping, cfg: Config) -> torch.Tensor:
        """``state``'s log-probs: those of a state cached with an equal config and equal tensors
        (:func:`same_model`: a preparation that is another identity's output, computed again),
        else computed."""
        hit = self._cache.get(id(state))
        if hit is None or hit[0] is not state:
            equal = next((h[2] for h in self._cache.values() if same_model(h[0], h[1], state, cfg)), None)
            # a validated state (an input, or what the replay made of one) is not validated again
            computed = equal if equal is not None else log_probs(in_dtype(state, self.run_in), cfg, self.tokens).double()
            hit = (state, cfg, computed)
            self._cache[id(state)] = hit
        return hit[2]

    def forget_all_but(self, *states: Mapping) -> None:
        """Drop the cached log-probs, and so the references to their state dicts, of every state
        but ``states``: a check that goes through many transformed models keeps only these."""
        self._cache = {key: hit for key, hit in self._cache.items() if any(hit[0] is state for state in states)}

    def seed(self, state: Mapping, computed: torch.Tensor) -> None:
        """Take ``computed``, ``state``'s log-probs on these tokens in this dtype (float64 values
        ``[batch, pos, d_vocab]``), instead of computing them again."""
        self._cache[id(state)] = (state, None, computed)

    def set_reference(self, state: Mapping, cfg: Config) -> None:
        """Take the tolerance's rounding sensitivity from ``state`` (measured when a comparison
        first needs it: see :func:`compared`)."""
        self._reference, self._sensitivity, self.cfg = (state, cfg), None, cfg

    @property
    def sensitivity(self) -> float:
        """The rounding sensitivity of the reference state (0 without one), measured once."""
        if self._sensitivity is None:
            state, cfg = self._reference
            rows, positions = sensitivity_window(self.tokens)
            computed = self(state, cfg)[:rows, :positions]
            self._sensitivity = rounding_sensitivity(
                state, cfg, self.tokens[:rows, :positions], self.dtype,
                computed=None if self.run_in == torch.float64 else computed,
            )
        return self._sensitivity

    def compare(self, a: Mapping, a_cfg: Config, b: Mapping, b_cfg: Config) -> Comparison:
        return compared(self(a, a_cfg), self(b, b_cfg), self.cfg or a_cfg, self.dtype, lambda: self.sensitivity)


def same_model(a: Mapping, a_cfg: Config | None, b: Mapping, b_cfg: Config) -> bool:
    """Whether ``a`` and ``b`` are one model: equal configs (``None``: unknown, never equal),
    the same names, and each tensor the same object or equal entry by entry (in dtype, shape
    and device too). Configs that differ, as two identities' records do, answer at once."""
    return (a_cfg is not None and a_cfg == b_cfg and a.keys() == b.keys()
            and all(x is y or (x.dtype == y.dtype and x.shape == y.shape and x.device == y.device and torch.equal(x, y))
                    for x, y in ((a[name], b[name]) for name in a)))


def compared(first: torch.Tensor, second: torch.Tensor, cfg: Config, dtype: torch.dtype,
             sensitivity: float | Callable[[], float]) -> Comparison:
    """Log-probs ``first`` against ``second`` (float64 ``[batch, pos, d_vocab]``) within
    :func:`~circuitmath.testing.logprob_tolerance` of ``dtype`` with ``sensitivity`` (or
    ``sensitivity()``, called only when needed).

    The sensitivity only widens the tolerance, so it is measured (two float64 forward passes)
    only when the difference exceeds the a-priori term alone; a comparison that passes that term
    shows it as its tolerance (a float32 processing of a GPT-2-small-shaped model is 1e-6 apart
    against an a-priori term of 1e-2: its check makes no float64 pass)."""
    difference = torch.sub(first, second).abs_()
    at = difference.argmax()  # the largest entry (NaN if any), as difference.max() gives it
    where = tuple(int(i) for i in torch.unravel_index(at, difference.shape))
    largest, error = _largest_entry(first), float(difference.reshape(-1)[at])
    tolerance = logprob_tolerance(cfg, dtype, largest, 0.0)
    if not error <= tolerance:
        tolerance = logprob_tolerance(cfg, dtype, largest, sensitivity() if callable(sensitivity) else sensitivity)
    return Comparison(max_abs_error=error, tolerance=tolerance, where=where)


def coarser(*dtypes: torch.dtype) -> torch.dtype:
    return max(dtypes, key=lambda d: torch.finfo(d).eps)
