"""What a proof is made of: its steps, definitions, facts, nonzero hypotheses and negative twins.

:class:`~circuitmath._proof.Proof` checks them; this module only states them (and writes their
LaTeX).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping

import sympy
from sympy import Identity, Inverse, MatMul, MatrixSymbol, Symbol

from ._errors import InputError
from ._latex import to_latex

__all__ = ["Definition", "Fact", "FactError", "Nonzero", "Step", "Twin"]


class FactError(InputError):
    """A fact that cannot hold or means nothing (sides of different shapes, a singular matrix
    declared invertible, a float): bad input, named, before anything is checked."""


@dataclass(frozen=True)
class Definition:
    """``symbol := value``: an abbreviation the checker unfolds wherever it meets ``symbol``."""

    symbol: sympy.Basic
    value: sympy.Basic
    text: str

    def latex(self) -> str:
        return rf"{to_latex(self.symbol)} := {to_latex(self.value)}"


@dataclass(frozen=True)
class Fact:
    """An axiom ``product = value`` the proof may use, e.g. ``A 1 = 1`` for attention rows.

    Every concrete instance the engine draws is checked to satisfy it exactly, so a sampler that
    breaks the assumption is an error, not a silent counterexample. A fact made by
    :meth:`invertible` declares a square matrix invertible: only such matrices may appear under
    an inverse, and only they cancel with it. A fact whose ``product`` is a bare symbol of the
    claim (``LN(x) = LNPre(x) diag(w) + b``) says what that symbol stands for: the checker
    unfolds it like a definition and draws instances that satisfy it, and, like every fact, it is
    listed among the proof's assumptions (a :class:`Definition` may only name a fresh symbol).
    """

    product: sympy.Basic
    value: sympy.Basic
    text: str
    invertible_matrix: sympy.Basic | None = None

    @classmethod
    def invertible(cls, matrix, text: str) -> Fact:
        """``matrix`` is invertible: ``M M^{-1} = I`` (it must be square)."""
        return cls(MatMul(matrix, Inverse(matrix)), Identity(matrix.shape[0]), text, invertible_matrix=matrix)

    @property
    def fixes(self) -> sympy.Basic | None:
        """The symbol this fact gives a value to (``None`` for a fact about a product)."""
        key = self.product
        if self.invertible_matrix is None and (isinstance(key, (MatrixSymbol, Symbol)) or getattr(key, "is_notation", False)):
            return key
        return None

    def latex(self) -> str:
        return rf"{to_latex(self.product)} = {to_latex(self.value)}"


@dataclass(frozen=True)
class Nonzero:
    """A hypothesis ``expr != 0`` (a scalar or a matrix with a nonzero entry), checked on every
    sampled instance. With ``because = (M, w)`` it is derived, not assumed: the engine proves
    ``M expr = w`` and ``w`` is nonzero by another hypothesis (``w``, or a scalar times a vector,
    each nonzero), so ``expr = 0`` would give ``w = 0``."""

    expr: sympy.Basic
    text: str
    because: tuple | None = None

    def latex(self) -> str:
        return rf"{to_latex(self.expr)} \ne 0"


@dataclass(frozen=True)
class Step:
    """One link of a chain: the previous expression equals ``expr`` because of ``reason``."""

    expr: sympy.Basic
    reason: str  # LaTeX text mode: math goes between $...$


@dataclass(frozen=True)
class Twin:
    """A plausible wrong variant of a claim, ``lhs = rhs``, that the engine must reject.

    ``dims`` overrides the explicit sizes used to look for a counterexample (a twin that scales
    columns instead of rows only type-checks when the matrix is square, say).
    """

    name: str
    description: str
    lhs: sympy.Basic
    rhs: sympy.Basic
    dims: Mapping | None = None
