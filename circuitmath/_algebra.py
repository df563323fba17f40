"""A small, sound normal form for non-commutative matrix polynomials.

sympy 1.14 leaves many matrix identities unproved: ``MatMul`` folds ``C*C`` into a ``MatPow`` it
never distributes, and it does not push transposes through products. This module expands a matrix
expression into a sum of ``coefficient * (factor_1 @ factor_2 @ ...)`` terms using only rules that
hold for every size (distributivity, associativity, ``(AB)^T = B^T A^T``, ``1_{a x b} 1_{b x c} =
b 1_{a x c}``, ``X X^{-1} = I``), unfolds definitions, and collects like terms. Two expressions are
proved equal when the normal form of their difference is empty.

It also evaluates any such expression exactly on explicit rational matrices, which is how a wrong
claim (a negative twin) is shown to be wrong by a concrete counterexample.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from fractions import Fraction

import sympy
from sympy import (
    DiagMatrix,
    Identity,
    Inverse,
    MatAdd,
    MatMul,
    MatPow,
    MatrixExpr,
    MatrixSymbol,
    OneMatrix,
    Transpose,
    ZeroMatrix,
)
from sympy.printing.latex import LatexPrinter

Factors = tuple[MatrixExpr, ...]
Terms = dict[Factors, sympy.Expr]

__all__ = ["normal_form", "is_zero", "evaluate", "random_instance", "to_latex"]


def _is_matrix(expr) -> bool:
    return isinstance(expr, MatrixExpr) or getattr(expr, "is_Matrix", False)


def _transpose_atom(atom: MatrixExpr) -> MatrixExpr:
    if isinstance(atom, Transpose):
        return atom.arg
    if isinstance(atom, (DiagMatrix, Identity)):
        return atom
    if isinstance(atom, OneMatrix):
        return OneMatrix(atom.shape[1], atom.shape[0])
    if isinstance(atom, Inverse):
        return Inverse(_transpose_atom(atom.arg))
    return Transpose(atom)


def _add(into: Terms, factors: Factors, coeff) -> None:
    into[factors] = into.get(factors, sympy.Integer(0)) + coeff


def _multiply(left: Terms, right: Terms) -> Terms:
    out: Terms = {}
    for lf, lc in left.items():
        for rf, rc in right.items():
            for factors, coeff in _reduce_product(lf + rf, lc * rc).items():
                _add(out, factors, coeff)
    return out


def _reduce_product(factors: Factors, coeff) -> Terms:
    """Apply the size-independent product rules until none applies."""
    factors = [f for f in factors if not (isinstance(f, OneMatrix) and f.shape == (1, 1))]
    changed = True
    while changed:
        changed = False
        for i in range(len(factors) - 1):
            a, b = factors[i], factors[i + 1]
            if isinstance(a, OneMatrix) and isinstance(b, OneMatrix):
                coeff = coeff * a.shape[1]
                merged = OneMatrix(a.shape[0], b.shape[1])
                factors[i : i + 2] = [] if merged.shape == (1, 1) else [merged]
            elif (isinstance(b, Inverse) and b.arg == a) or (isinstance(a, Inverse) and a.arg == b):
                factors[i : i + 2] = []
            else:
                continue
            changed = True
            break
    return {tuple(factors): coeff}


def _expand(expr, definitions: Mapping) -> Terms:
    if not _is_matrix(expr):
        raise TypeError(f"expected a matrix expression, got {expr!r}")
    if expr in definitions:
        return _expand(definitions[expr], definitions)
    if isinstance(expr, ZeroMatrix):
        return {}
    if isinstance(expr, Identity):
        return {(): sympy.Integer(1)}
    if isinstance(expr, MatAdd):
        out: Terms = {}
        for arg in expr.args:
            for factors, coeff in _expand(arg, definitions).items():
                _add(out, factors, coeff)
        return out
    if isinstance(expr, MatMul):
        scalar = sympy.Integer(1)
        result: Terms = {(): sympy.Integer(1)}
        for arg in expr.args:
            if _is_matrix(arg):
                result = _multiply(result, _expand(arg, definitions))
            else:
                scalar = scalar * arg
        return {f: c * scalar for f, c in result.items()}
    if isinstance(expr, MatPow) and not isinstance(expr, Inverse):  # sympy's Inverse is a MatPow
        exponent = expr.args[1]
        if not (exponent.is_Integer and exponent >= 0):
            raise ValueError(f"only non-negative integer powers expand: {expr}")
        result = {(): sympy.Integer(1)}
        base = _expand(expr.args[0], definitions)
        for _ in range(int(exponent)):
            result = _multiply(result, base)
        return result
    if isinstance(expr, Transpose):
        inner = _expand(expr.arg, definitions)
        return {tuple(_transpose_atom(a) for a in reversed(f)): c for f, c in inner.items()}
    if isinstance(expr, Inverse) and expr.arg in definitions:
        raise ValueError(f"cannot expand the inverse of a defined expression: {expr}")
    # An atom: a symbol, its transpose, a ones matrix, diag(v), an inverse of a symbol.
    return {(expr,): sympy.Integer(1)}


def _product_pattern(expr, definitions: Mapping) -> Factors:
    terms = _expand(expr, definitions)
    if len(terms) != 1 or next(iter(terms.values())) != 1 or not next(iter(terms)):
        raise ValueError(f"the left side of a fact must be a plain product of matrices, got {expr}")
    return next(iter(terms))


def _rewrite(terms: Terms, facts, definitions: Mapping, limit: int = 200) -> Terms:
    """Replace every contiguous occurrence of a fact's left side by its right side."""
    patterns = [(_product_pattern(lhs, definitions), rhs) for lhs, rhs in facts]
    for _ in range(limit):
        out: Terms = {}
        changed = False
        for factors, coeff in terms.items():
            hit = next(
                ((i, len(p), rhs) for p, rhs in patterns for i in range(len(factors) - len(p) + 1)
                 if factors[i : i + len(p)] == p),
                None,
            )
            if hit is None:
                _add(out, factors, coeff)
                continue
            changed = True
            i, n, rhs = hit
            replaced = _multiply(_multiply({factors[:i]: coeff}, _expand(rhs, definitions)), {factors[i + n :]: 1})
            for f, c in replaced.items():
                _add(out, f, c)
        terms = out
        if not changed:
            return terms
    raise ValueError("rewriting with the facts did not terminate")


def normal_form(expr, definitions: Mapping | None = None, facts=()) -> Terms:
    """Expand ``expr`` into ``{factors: coefficient}`` with like terms collected and zeros dropped.

    ``definitions`` maps a symbol to the expression it abbreviates; each is unfolded wherever it
    occurs. ``facts`` are ``(product, value)`` pairs assumed to hold (say ``A 1 = 1`` for an
    attention pattern); every contiguous occurrence of ``product`` is replaced by ``value``.
    Coefficients are simplified with ``sympy.simplify``.
    """
    definitions = dict(definitions or {})
    terms = _expand(expr, definitions)
    if facts:
        terms = _rewrite(terms, facts, definitions)
    return {f: c for f, c in ((f, sympy.simplify(c)) for f, c in terms.items()) if c != 0}


def is_zero(expr, definitions: Mapping | None = None, facts=()) -> bool:
    """True when the normal form of ``expr`` has no terms: a proof that ``expr`` is zero."""
    return not normal_form(expr, definitions, facts)


# ---------------------------------------------------------------------------------------------
# Exact evaluation on explicit matrices (for counterexamples and concrete sanity checks)


def evaluate(expr, values: Mapping, definitions: Mapping | None = None) -> sympy.ImmutableMatrix:
    """Evaluate ``expr`` exactly, given explicit values for every symbol and dimension.

    ``values`` maps dimension symbols to ints, scalar symbols to rationals and ``MatrixSymbol``\\ s
    (with their symbolic shapes) to explicit ``sympy.Matrix`` values.
    """
    definitions = dict(definitions or {})

    def scalar(e):
        return sympy.nsimplify(sympy.sympify(e).xreplace(dict(values)).doit()) if not _is_matrix(e) else None

    def dim(e):
        return int(sympy.sympify(e).xreplace(dict(values)))

    def ev(e):
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
            v = ev(e.args[0])
            return sympy.diag(*list(v))
        if isinstance(e, Transpose):
            return ev(e.arg).T
        if isinstance(e, Inverse):
            return ev(e.arg).inv()
        if isinstance(e, MatPow):
            return ev(e.args[0]) ** int(e.args[1])
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
        if getattr(e, "is_Matrix", False):  # an explicit sympy matrix
            return sympy.Matrix(e)
        raise TypeError(f"cannot evaluate {e!r}")

    return sympy.ImmutableMatrix(ev(expr))


def random_instance(
    exprs,
    dims: Mapping,
    *,
    seed: int,
    samplers: Mapping | None = None,
    definitions: Mapping | None = None,
) -> dict:
    """Draw explicit values for every free symbol of ``exprs`` (and of the definitions they use).

    Matrices get small random integers, scalars random positive rationals; ``samplers`` overrides
    a symbol with ``sampler(rng, shape)`` for symbols that must satisfy an assumption.
    """
    rng = random.Random(seed)
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
            else:
                if s in samplers:
                    values[s] = samplers[s](rng, ())
                else:
                    values[s] = sympy.Rational(Fraction(rng.randint(1, 9), rng.randint(1, 5)))
    return values


# ---------------------------------------------------------------------------------------------
# LaTeX


class _Printer(LatexPrinter):
    def _print_OneMatrix(self, expr):
        rows, cols = expr.shape
        if cols == 1:
            return r"\mathbf{1}_{%s}" % self._print(rows)
        if rows == 1:
            return r"\mathbf{1}_{%s}^{\top}" % self._print(cols)
        return r"\mathbf{1}_{%s \times %s}" % (self._print(rows), self._print(cols))

    def _print_Identity(self, expr):
        return r"I_{%s}" % self._print(expr.shape[0])

    def _print_DiagMatrix(self, expr):
        return r"\operatorname{diag}(%s)" % self._print(expr.args[0])

    def _print_Inverse(self, expr):
        if isinstance(expr.arg, Transpose) and isinstance(expr.arg.arg, MatrixSymbol):
            return r"%s^{-\top}" % self._print(expr.arg.arg)
        if isinstance(expr.arg, DiagMatrix):
            return r"%s^{-1}" % self._print(expr.arg)
        return super()._print_MatPow(expr)

    def _print_Transpose(self, expr):
        arg = expr.arg
        if isinstance(arg, Inverse) and isinstance(arg.arg, MatrixSymbol):
            return r"%s^{-\top}" % self._print(arg.arg)
        inner = self._print(arg)
        if not isinstance(arg, MatrixSymbol):
            inner = r"\left(%s\right)" % inner
        return r"%s^{\top}" % inner


def to_latex(expr) -> str:
    """LaTeX for an expression, with ``1`` vectors, ``diag`` and transposes written the usual way."""
    return _Printer({"mat_symbol_style": "plain"}).doprint(expr)
