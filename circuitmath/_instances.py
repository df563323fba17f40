"""Explicit instances of matrix expressions: exact evaluation on rational matrices and random draws.

A negative twin is shown wrong by a concrete counterexample: :func:`random_instance` draws exact
values for every free symbol (respecting samplers for symbols that must satisfy an assumption) and
:func:`evaluate` computes an expression on them exactly.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from fractions import Fraction

import sympy
from sympy import DiagMatrix, Identity, Inverse, MatAdd, MatMul, MatPow, MatrixSymbol, OneMatrix, Transpose, ZeroMatrix
from sympy.matrices.expressions.kronecker import KroneckerProduct, matrix_kronecker_product

from ._algebra import _explicit, _is_matrix, require_exact

__all__ = ["evaluate", "random_instance"]


def evaluate(expr, values: Mapping, definitions: Mapping | None = None) -> sympy.ImmutableMatrix:
    """Evaluate ``expr`` exactly, given explicit values for every symbol and dimension.

    ``values`` maps dimension symbols to ints, scalar symbols to rationals and ``MatrixSymbol``\\ s
    (with their symbolic shapes) to explicit ``sympy.Matrix`` values. A singular matrix under an
    inverse raises ``ValueError``.
    """
    definitions = dict(definitions or {})
    replace = {
        sympy.sympify(k): sympy.ImmutableMatrix(v) if _is_matrix(v) or isinstance(v, list) else sympy.sympify(v)
        for k, v in values.items()
    }
    cache: dict = {}

    def scalar(e):
        return sympy.sympify(e).xreplace(replace).doit()

    def dim(e):
        return int(sympy.sympify(e).xreplace(replace))

    def ev(e):
        if e not in cache:
            cache[e] = _ev(e)
        return cache[e]

    def _ev(e):
        if e in definitions:
            return ev(definitions[e])
        if isinstance(e, MatrixSymbol):
            return sympy.Matrix(values[e])
        if isinstance(e, ZeroMatrix):
            return sympy.zeros(dim(e.shape[0]), dim(e.shape[1]))
        if isinstance(e, Identity):
            return sympy.eye(dim(e.shape[0]))
        if isinstance(e, OneMatrix):
            return sympy.ones(dim(e.shape[0]), dim(e.shape[1]))
        if isinstance(e, DiagMatrix):
            return sympy.diag(*list(ev(e.args[0])))
        if isinstance(e, Transpose):
            return ev(e.arg).T
        if isinstance(e, Inverse):
            return ev(e.arg).inv()
        if isinstance(e, MatPow):
            return ev(e.args[0]) ** int(e.args[1])
        if isinstance(e, KroneckerProduct):
            return matrix_kronecker_product(*(ev(a) for a in e.args))
        if isinstance(e, MatAdd):
            parts = [ev(a) for a in e.args]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            return total
        if isinstance(e, MatMul):
            s = sympy.Integer(1)
            m = None
            for a in e.args:
                if _is_matrix(a):
                    m = ev(a) if m is None else m * ev(a)
                else:
                    s = s * scalar(a)
            return m * s
        if _explicit(e):
            return sympy.Matrix(e)
        raise TypeError(f"cannot evaluate {e!r}")

    return sympy.ImmutableMatrix(ev(expr))


def _draw_scalar(rng, symbol) -> sympy.Rational:
    """A random nonzero rational with the sign the symbol's assumptions allow."""
    value = sympy.Rational(Fraction(rng.randint(1, 9), rng.randint(1, 5)))
    if symbol.is_nonnegative or symbol.is_positive:
        return value
    if symbol.is_nonpositive or symbol.is_negative:
        return -value
    return value if rng.random() < 0.5 else -value


def random_instance(
    exprs,
    dims: Mapping,
    *,
    seed: int,
    samplers: Mapping | None = None,
    definitions: Mapping | None = None,
) -> dict:
    """Draw explicit values for every free symbol of ``exprs`` (and of the definitions they use).

    Matrices get small random integers, scalars random nonzero rationals (positive where the
    symbol is declared positive); ``samplers`` overrides a symbol with ``sampler(rng, shape)``
    for symbols that must satisfy an assumption. ``rng.dims`` holds ``dims`` for samplers that
    draw several symbols together. Every value must be exact.
    """
    rng = random.Random(seed)
    rng.dims = dict(dims)
    samplers = dict(samplers or {})
    definitions = dict(definitions or {})
    values: dict = dict(dims)
    pending = list(exprs)
    seen = set()
    while pending:
        e = sympy.sympify(pending.pop())
        for s in e.free_symbols | set(e.atoms(MatrixSymbol)):
            if s in seen or s in dims:
                continue
            seen.add(s)
            if s in definitions:
                pending.append(definitions[s])
                continue
            if isinstance(s, MatrixSymbol):
                shape = (int(sympy.sympify(s.shape[0]).xreplace(dims)), int(sympy.sympify(s.shape[1]).xreplace(dims)))
                if s in samplers:
                    values[s] = sympy.Matrix(samplers[s](rng, shape))
                else:
                    values[s] = sympy.Matrix(*shape, lambda i, j: rng.randint(-4, 4))
                require_exact(values[s])
            else:
                values[s] = sympy.sympify(samplers[s](rng, ())) if s in samplers else _draw_scalar(rng, s)
                require_exact(values[s])
    return values
