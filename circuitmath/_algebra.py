"""A small, sound normal form for non-commutative matrix polynomials.

sympy 1.14 leaves many matrix identities unproved: ``MatMul`` folds ``C*C`` into a ``MatPow`` it
never distributes, and it does not push transposes through products. This module expands a matrix
expression into a sum of ``coefficient * (factor_1 @ factor_2 @ ...)`` terms using only rules that
hold for every size (distributivity, associativity, ``(AB)^T = B^T A^T``, ``1_{a x b} 1_{b x c} =
b 1_{a x c}``, ``X X^{-1} = I``), unfolds definitions, and collects like terms. Two expressions are
proved equal when the normal form of their difference is empty.
Exact evaluation on explicit matrices lives in :mod:`circuitmath._instances`, LaTeX in
:mod:`circuitmath._latex`.
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy
from sympy import (DiagMatrix, Identity, Inverse, MatAdd, MatMul, MatPow, MatrixExpr, MatrixSymbol, OneMatrix, Trace,
                   Transpose, ZeroMatrix)
from sympy.matrices.expressions.kronecker import KroneckerProduct

Factors = tuple[MatrixExpr, ...]
Terms = dict[Factors, sympy.Expr]

__all__ = ["IllTyped", "NotExact", "same_size", "shape_of", "normal_form", "is_zero"]


class IllTyped(ValueError):
    """Shapes that do not fit, or an inverse that no fact declares: the claim means nothing."""


class NotExact(ValueError):
    """A float where the engine needs an exact rational."""


def _is_matrix(expr) -> bool:
    return isinstance(expr, MatrixExpr) or getattr(expr, "is_Matrix", False)


def _explicit(expr) -> bool:
    return isinstance(expr, sympy.MatrixBase)


def same_size(a, b) -> bool:
    """Two sizes are equal for every value of the dimension symbols."""
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def require_exact(expr) -> None:
    """Refuse any float in ``expr``: floats are compared at a few digits, so ``A + 10^{-50} A = A``
    would pass; write ``sympy.Rational`` instead."""
    floats = sympy.sympify(expr).atoms(sympy.Float) if not _explicit(expr) else set().union(
        *(sympy.sympify(v).atoms(sympy.Float) for v in expr)
    )
    if floats:
        raise NotExact(f"float coefficient {sorted(floats, key=str)[0]} in {expr}: write exact rationals")


def _invertible(expr, invertible) -> bool:
    """``expr`` is declared invertible (directly, or as the transpose or inverse of such a matrix)."""
    if expr in invertible or isinstance(expr, Identity):
        return True
    if isinstance(expr, (Transpose, Inverse)):
        return _invertible(expr.arg, invertible)
    return False


def shape_of(expr, definitions: Mapping | None = None, invertible=()) -> tuple | None:
    """The shape of ``expr`` (``None`` for a scalar), checking every node on the way.

    Sums need equal shapes, products matching inner sizes, inverses a square matrix in
    ``invertible``, powers a square base; ``diag`` takes a vector. Floats are refused. A size is
    compared symbolically: ``n`` and ``m`` differ even where both happen to be 3.
    """
    return _Shapes(definitions or {}, frozenset(invertible)).of(expr)


def _fail(node, why):
    raise IllTyped(f"{why}, in {node}")


class _Shapes:
    """:func:`shape_of` under ``definitions`` and the ``invertible`` matrices: one method per
    kind of node (:data:`_NODE_RULES`)."""

    def __init__(self, definitions: Mapping, invertible: frozenset):
        self.definitions, self.invertible, self._context = definitions, invertible, None

    def declared(self, matrix) -> bool:
        """Whether ``matrix`` is declared invertible: itself, a product of such matrices times a
        nonzero number, or a product of invertible factors once its definitions are expanded."""
        if _invertible(matrix, self.invertible):
            return True
        if isinstance(matrix, MatMul):  # a product of invertible square matrices, times a nonzero number
            scalars = [a for a in matrix.args if not _is_matrix(a)]
            return all(sympy.sympify(c).is_nonzero for c in scalars) and all(
                self.declared(a) for a in matrix.args if _is_matrix(a))
        if self._context is None:
            self._context = _Context(self.definitions, self.invertible)
        ctx = self._context
        return all(_invertible(p, ctx.invertible) for p in ctx.split(ctx.atom(matrix)))

    def of(self, e):
        if not _is_matrix(e):
            require_exact(e)
            for trace in sympy.sympify(e).atoms(Trace):
                rows, cols = self.of(trace.arg)
                if not same_size(rows, cols):
                    _fail(trace, f"the trace of a {rows} x {cols} matrix, which is not square")
            return None
        if _explicit(e):
            require_exact(e)
            return e.shape
        if e in self.definitions or isinstance(e, (MatrixSymbol, ZeroMatrix, Identity, OneMatrix)):
            return e.shape
        if getattr(e, "is_notation", False):  # an undefined notation node: an opaque atom of its shape
            return e.shape
        for kind, rule in _NODE_RULES:
            if isinstance(e, kind):
                return rule(self, e)
        _fail(e, f"an undefined {type(e).__name__} node, which the normal form does not know")

    def _square(self, e, arg, what: str) -> tuple:
        rows, cols = self.of(arg)
        if not same_size(rows, cols):
            _fail(e, f"{what} of a {rows} x {cols} matrix, which is not square")
        return (rows, cols)

    def sum(self, e):
        shapes = [self.of(a) for a in e.args]
        if any(s is None for s in shapes):
            _fail(e, "a scalar added to a matrix")
        for s in shapes[1:]:
            if not (same_size(s[0], shapes[0][0]) and same_size(s[1], shapes[0][1])):
                _fail(e, f"a sum of a {shapes[0][0]} x {shapes[0][1]} and a {s[0]} x {s[1]} matrix")
        return shapes[0]

    def product(self, e):
        current = None
        for a in e.args:
            s = self.of(a)
            if s is None:
                continue
            if current is not None and not same_size(current[1], s[0]):
                _fail(e, f"a {current[0]} x {current[1]} matrix times a {s[0]} x {s[1]} matrix")
            current = s if current is None else (current[0], s[1])
        if current is None:
            _fail(e, "a product without a matrix")
        return current

    def inverse(self, e):
        shape = self._square(e, e.arg, "the inverse")
        if not self.declared(e.arg):
            _fail(e, f"the inverse of {e.arg}, which no fact declares invertible")
        return shape

    def power(self, e):
        shape = self._square(e, e.args[0], "a power")
        exponent = e.args[1]
        if not (exponent.is_Integer and exponent >= 0):
            _fail(e, "a power that is not a non-negative integer")
        return shape

    def transpose(self, e):
        return tuple(reversed(self.of(e.arg)))

    def diag(self, e):
        rows, cols = self.of(e.args[0])
        if cols == 1:
            return (rows, rows)
        if rows == 1:
            return (cols, cols)
        _fail(e, "diag of a matrix that is not a vector")

    def kronecker(self, e):
        rows, cols = sympy.Integer(1), sympy.Integer(1)
        for r, c in (self.of(a) for a in e.args):
            rows, cols = rows * r, cols * c
        return (rows, cols)


#: :class:`_Shapes`' rule for each kind of matrix node, in the order tried (an
#: :class:`~sympy.Inverse` is a :class:`~sympy.MatPow`: it comes first).
_NODE_RULES = (
    (MatAdd, _Shapes.sum), (MatMul, _Shapes.product), (Inverse, _Shapes.inverse), (MatPow, _Shapes.power),
    (Transpose, _Shapes.transpose), (DiagMatrix, _Shapes.diag), (KroneckerProduct, _Shapes.kronecker),
)


def _transpose_atom(atom: MatrixExpr) -> MatrixExpr:
    if _explicit(atom):
        return sympy.ImmutableMatrix(atom.T)
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


class _Context:
    """What the expansion needs: definitions, invertible atoms (canonical), and caches."""

    def __init__(self, definitions: Mapping, invertible=()):
        self.definitions = dict(definitions)
        self._factors: dict = {}
        #: The canonical products under a trace met so far, each with the symbol standing for it.
        self.traces: dict = {}
        declared = [self.atom(a) for a in invertible]
        # diag(D u) = D diag(u) is invertible exactly when D and diag(u) are (square factors).
        self.invertible = frozenset(declared + [p for a in declared for p in self.split(a)])

    def split(self, atom) -> Factors:
        """``diag(D_1 ... D_k u) = D_1 ... D_k diag(u)`` for diagonal ``D_i`` (entrywise products),
        and the inverse of that product, reversed; any other atom stays whole."""
        if isinstance(atom, Inverse) and isinstance(atom.arg, DiagMatrix):
            return tuple(Inverse(p) for p in reversed(self.split(atom.arg)))
        if not isinstance(atom, DiagMatrix) or not isinstance(atom.args[0], MatMul):
            return (atom,)
        factors = atom.args[0].args
        lead = 0
        while lead < len(factors) - 1 and isinstance(factors[lead], DiagMatrix):
            lead += 1
        if lead == 0:
            return (atom,)
        rest = factors[lead:]
        return (*factors[:lead], DiagMatrix(rest[0] if len(rest) == 1 else MatMul(*rest)))

    def atom(self, expr):
        """An atom with definitions unfolded inside ``diag(.)`` and under inverses, so that
        ``diag(r)`` with ``r := E 1`` and ``diag(E 1)`` are the same atom."""
        if isinstance(expr, DiagMatrix):
            terms = _expand(expr.args[0], self)
            if len(terms) == 1 and next(iter(terms.values())) == 1 and next(iter(terms)):
                factors = next(iter(terms))
                return DiagMatrix(factors[0] if len(factors) == 1 else MatMul(*factors))
            return expr
        if isinstance(expr, Inverse):
            inner = self.atom(expr.arg)
            return inner.arg if isinstance(inner, Inverse) else Inverse(inner)
        if isinstance(expr, Transpose):
            inner = self.atom(expr.arg)
            return _transpose_atom(inner) if inner is not expr.arg else expr
        return expr

    def vector_factors(self, diag: DiagMatrix) -> Factors | None:
        """The factors of the vector ``u`` of ``diag(u)`` when it is a single product."""
        u = diag.args[0]
        if u not in self._factors:
            factors = u.args if isinstance(u, MatMul) else (u,)
            self._factors[u] = factors if all(_is_matrix(f) for f in factors) and u.shape[1] == 1 else None
        return self._factors[u]


def _multiply(left: Terms, right: Terms, ctx: _Context) -> Terms:
    out: Terms = {}
    for lf, lc in left.items():
        for rf, rc in right.items():
            for factors, coeff in _reduce_product(lf + rf, lc * rc, ctx).items():
                _add(out, factors, coeff)
    return out


def _reduce_product(factors: Factors, coeff, ctx: _Context) -> Terms:
    """Apply the size-independent product rules until none applies:

    ``1_{a x b} 1_{b x c} = b 1_{a x c}``; ``X X^{-1} = X^{-1} X = I`` for a declared-invertible
    ``X``; ``diag(u) 1 = u`` and ``1^T diag(u) = u^T``; ``diag(u)^{-1} u = 1`` for a declared
    invertible ``diag(u)`` (as ``u = diag(u) 1``). Products are well typed (checked before), so
    neighbouring sizes match.
    """
    factors = [f for f in factors if not (isinstance(f, OneMatrix) and f.shape == (1, 1))]
    changed = True
    while changed:
        changed = False
        for i in range(len(factors) - 1):
            a, b = factors[i], factors[i + 1]
            if _explicit(a) and _explicit(b):  # explicit matrices multiply out; a 1 x 1 one is a scalar
                product = sympy.ImmutableMatrix(a * b)
                if product.is_zero_matrix:
                    return {}
                if product.shape == (1, 1):
                    coeff = coeff * product[0, 0]
                    factors[i : i + 2] = []
                else:
                    factors[i : i + 2] = [product]
            elif isinstance(a, OneMatrix) and isinstance(b, OneMatrix):
                coeff = coeff * a.shape[1]
                merged = OneMatrix(a.shape[0], b.shape[1])
                factors[i : i + 2] = [] if merged.shape == (1, 1) else [merged]
            elif ((isinstance(b, Inverse) and b.arg == a) or (isinstance(a, Inverse) and a.arg == b)) and _invertible(
                a, ctx.invertible
            ):
                factors[i : i + 2] = []
            elif isinstance(a, DiagMatrix) and isinstance(b, OneMatrix) and ctx.vector_factors(a) is not None:
                tail = [] if b.shape[1] == 1 else [OneMatrix(1, b.shape[1])]
                factors[i : i + 2] = list(ctx.vector_factors(a)) + tail
            elif isinstance(b, DiagMatrix) and isinstance(a, OneMatrix) and ctx.vector_factors(b) is not None:
                head = [] if a.shape[0] == 1 else [OneMatrix(a.shape[0], 1)]
                factors[i : i + 2] = head + [_transpose_atom(f) for f in reversed(ctx.vector_factors(b))]
            elif (
                isinstance(a, Inverse)
                and isinstance(a.arg, DiagMatrix)
                and _invertible(a.arg, ctx.invertible)
                and (u := ctx.vector_factors(a.arg)) is not None
                and tuple(factors[i + 1 : i + 1 + len(u)]) == tuple(u)
            ):
                factors[i : i + 1 + len(u)] = [OneMatrix(a.shape[0], 1)]
            else:
                continue
            changed = True
            break
    return {tuple(factors): coeff}


def _expand(expr, ctx: _Context) -> Terms:
    definitions = ctx.definitions  # expr is well typed (shape_of ran): a matrix, powers non-negative
    if expr in definitions:
        return _expand(definitions[expr], ctx)
    if isinstance(expr, ZeroMatrix):
        return {}
    if isinstance(expr, Identity):
        return {(): sympy.Integer(1)}
    if isinstance(expr, MatAdd):
        out: Terms = {}
        for arg in expr.args:
            for factors, coeff in _expand(arg, ctx).items():
                _add(out, factors, coeff)
        return out
    if isinstance(expr, MatMul):
        scalar = sympy.Integer(1)
        result: Terms = {(): sympy.Integer(1)}
        for arg in _cancel_inverses(expr.args, ctx):
            if _is_matrix(arg):
                result = _multiply(result, _expand(arg, ctx), ctx)
            else:
                scalar = scalar * arg
        return {f: c * scalar for f, c in result.items()}
    if isinstance(expr, MatPow) and not isinstance(expr, Inverse):  # sympy's Inverse is a MatPow
        exponent = expr.args[1]
        result = {(): sympy.Integer(1)}
        base = _expand(expr.args[0], ctx)
        for _ in range(int(exponent)):
            result = _multiply(result, base, ctx)
        return result
    if isinstance(expr, Transpose):
        inner = _expand(expr.arg, ctx)
        return {tuple(_transpose_atom(a) for a in reversed(f)): c for f, c in inner.items()}
    if isinstance(expr, Inverse) and expr.arg in definitions:
        raise IllTyped(f"cannot expand the inverse of a defined expression: {expr}")
    if isinstance(expr, Inverse) and isinstance(expr.arg, MatMul):
        inverted = _inverse_of_product(expr.arg, ctx)
        if inverted is not None:
            return inverted
    # An atom: a symbol, its transpose, a ones matrix, diag(v), an inverse of a symbol.
    return {ctx.split(ctx.atom(expr)): sympy.Integer(1)}


def _cancel_inverses(args, ctx: _Context) -> list:
    """The factors of a product with every ``S S^{-1}`` and ``S^{-1} S`` of neighbours dropped, for a
    declared-invertible ``S`` that expansion would take apart (a sum): ``(A + B)(A + B)^{-1} = I``."""
    args = list(args)
    i = 0
    while i < len(args) - 1:
        a, b = args[i], args[i + 1]
        pair = (a, b.arg) if isinstance(b, Inverse) else (b, a.arg) if isinstance(a, Inverse) else None
        if pair is not None and pair[0] == pair[1] and isinstance(pair[0], MatAdd) and pair[0] in ctx.invertible:
            del args[i : i + 2]
            i = max(i - 1, 0)
        else:
            i += 1
    return args


def _inverse_atom(atom):
    return atom.arg if isinstance(atom, Inverse) else Inverse(atom)


def _inverse_of_product(product, ctx: _Context) -> Terms | None:
    """``(c X_1 ... X_k)^{-1} = c^{-1} X_k^{-1} ... X_1^{-1}`` when the product expands to one term
    with a nonzero number ``c`` and every ``X_i`` declared invertible (``None`` otherwise)."""
    terms = _expand(product, ctx)
    if len(terms) != 1:
        return None
    (factors, coeff), = terms.items()
    if not factors or not sympy.sympify(coeff).is_nonzero or not all(_invertible(f, ctx.invertible) for f in factors):
        return None
    return {tuple(_inverse_atom(f) for f in reversed(factors)): 1 / coeff}


def _product_pattern(expr, ctx: _Context) -> Factors:
    terms = _expand(expr, ctx)
    if len(terms) != 1 or next(iter(terms.values())) != 1 or not next(iter(terms)):
        raise ValueError(f"the left side of a fact must be a plain product of matrices, got {expr}")
    return next(iter(terms))


def _ones_split(factor, side: str):
    """``1_{a x b}`` as ``1_a 1_b^T``: its column of ones and the row left over (``side="right"``),
    or its row of ones and the column left over (``"left"``); ``None`` for any other factor."""
    if not isinstance(factor, OneMatrix) or factor.shape[0] == 1 or factor.shape[1] == 1:
        return None
    rows, cols = factor.shape
    column, row = OneMatrix(rows, 1), OneMatrix(1, cols)
    return (column, row) if side == "right" else (row, column)


def _find(factors: Factors, pattern: Factors):
    """Where ``pattern`` occurs in ``factors``: ``(start, end, before, after)``, the slice it covers
    and the factors it leaves of a ones matrix it matched half of (``1_{a x b} = 1_a 1_b^T``: a fact
    ``A 1 = 1`` applies to ``A 1 1^T``, which the expansion has merged into ``A 1_{n x n}``)."""
    n = len(pattern)
    for i in range(len(factors) - n + 1):
        if factors[i : i + n] == pattern:
            return i, i + n, (), ()
    for i in range(len(factors) - n + 1):
        head, tail = factors[i : i + n - 1], factors[i + n - 1]
        split = _ones_split(tail, "right")
        if head == pattern[:-1] and split is not None and split[0] == pattern[-1]:
            return i, i + n, (), (split[1],)
        split = _ones_split(factors[i], "left")
        if split is not None and split[0] == pattern[0] and factors[i + 1 : i + n] == pattern[1:]:
            return i, i + n, (split[1],), ()
    return None


def _rewrite(terms: Terms, facts, ctx: _Context, limit: int = 200) -> Terms:
    """Replace every contiguous occurrence of a fact's left side by its right side (also where
    the side ends or starts with a vector of ones that a ones matrix holds, see :func:`_find`)."""
    patterns = [(_product_pattern(lhs, ctx), rhs) for lhs, rhs in facts]
    for _ in range(limit):
        out: Terms = {}
        changed = False
        for factors, coeff in terms.items():
            hit = next(((found, rhs) for p, rhs in patterns if (found := _find(factors, p)) is not None), None)
            if hit is None:
                _add(out, factors, coeff)
                continue
            changed = True
            (i, end, before, after), rhs = hit
            value = _multiply(_multiply({before: 1}, _expand(rhs, ctx), ctx), {after: 1}, ctx)
            replaced = _multiply(_multiply({factors[:i]: coeff}, value, ctx), {factors[end:]: 1}, ctx)
            for f, c in replaced.items():
                _add(out, f, c)
        terms = out
        if not changed:
            return terms
    raise ValueError("rewriting with the facts did not terminate")


# ---------------------------------------------------------------------------------------------
# The canonical form: equal terms that the expansion writes differently


def _diagonal(atom) -> bool:
    return isinstance(atom, DiagMatrix) or (isinstance(atom, Inverse) and isinstance(atom.arg, DiagMatrix))


def _key(factors: Factors) -> tuple:
    return tuple(sympy.srepr(f) for f in factors)


def _sorted_diagonals(factors: Factors) -> Factors:
    """Each run of neighbouring diagonal matrices (``diag(u)``, ``diag(u)^{-1}``) sorted: diagonal
    matrices of one size commute. A matrix and its inverse sort next to each other."""
    out, run = [], []
    for f in (*factors, None):
        if f is not None and _diagonal(f):
            run.append(f)
            continue
        out += sorted(run, key=lambda a: (sympy.srepr(a.arg if isinstance(a, Inverse) else a), isinstance(a, Inverse)))
        run = []
        if f is not None:
            out.append(f)
    return tuple(out)


def _scalars_out(factors: Factors, ctx: _Context) -> tuple[Factors, sympy.Expr]:
    """The product with each 1 x 1 stretch (``x^T A y``) taken out as the scalar ``tr(x^T A y)``
    (:func:`_cyclic`): a 1 x 1 matrix is a scalar, and a scalar commutes with every factor."""
    out, scalar, i = [], sympy.Integer(1), 0
    while i < len(factors):
        if factors[i].shape[0] == 1:
            j = next((j for j in range(i, len(factors)) if factors[j].shape[1] == 1), None)
            if j is not None:
                scalar *= _cyclic(factors[i : j + 1], ctx)
                i = j + 1
                continue
        out.append(factors[i])
        i += 1
    return tuple(out), scalar


def _cyclic(factors: Factors, ctx: _Context) -> sympy.Expr:
    """``tr(X_1 ... X_k)`` with the product turned to a canonical one of its rotations and of the
    rotations of its transpose (``tr(AB) = tr(BA)``, ``tr(M^T) = tr(M)``), as the symbol that
    stands for it in this normal form; a rotation on which a product rule applies (``1^T 1 = n``)
    is reduced first."""
    words = (factors, tuple(_transpose_atom(a) for a in reversed(factors)))
    rotations = [w[i:] + w[:i] for w in words for i in range(len(w))]
    for rotation in rotations:
        reduced = _reduce_product(_sorted_diagonals(rotation), sympy.Integer(1), ctx)
        if not reduced:
            return sympy.Integer(0)
        (shorter, coeff), = reduced.items()
        if len(shorter) < len(factors):
            return coeff * (_cyclic(shorter, ctx) if shorter else rotation[0].shape[0])
    best = _key(min(rotations, key=_key))
    # an opaque scalar per canonical trace: sympy's simplify is slow on Trace nodes
    return ctx.traces.setdefault(best, sympy.Dummy(f"tr{len(ctx.traces)}"))


def _traces(coeff, ctx: _Context, facts) -> sympy.Expr:
    """``coeff`` with every trace written in the canonical form: ``tr`` of the expanded argument,
    by linearity, each product turned by :func:`_cyclic`."""
    found = sympy.sympify(coeff).atoms(Trace)
    if not found:
        return coeff
    values = {}
    for trace in found:
        terms = _expand(trace.arg, ctx)
        if facts:
            terms = _rewrite(terms, facts, ctx)
        values[trace] = sympy.Add(*(c * _cyclic(f, ctx) if f else c * trace.arg.shape[0] for f, c in terms.items()))
    return sympy.sympify(coeff).xreplace(values)


def _canonical(terms: Terms, ctx: _Context, facts=()) -> Terms:
    """``terms`` rewritten by rules the expansion does not apply as it goes: diagonal matrices
    commute, a 1 x 1 product is a scalar equal to its transpose, traces are cyclic. Each rule holds
    for every size; like terms are collected again and zeros dropped."""
    out: Terms = {}
    for factors, coeff in terms.items():
        current = {factors: coeff}
        for _ in range(len(factors) + 1):  # sorting and cancelling until neither changes the product
            (f, c), = current.items()
            current = _reduce_product(_sorted_diagonals(f), c, ctx)
            if not current or next(iter(current)) == f:
                break
        for f, c in current.items():
            rest, scalar = _scalars_out(f, ctx)
            _add(out, rest, _traces(c, ctx, facts) * scalar)
    # the coefficients were simplified before; what is new is sums and products of symbols
    return {f: c for f, c in ((f, sympy.expand(c)) for f, c in out.items()) if c != 0}


def _check_definitions(definitions: Mapping, invertible) -> None:
    for key, value in definitions.items():
        key_shape = shape_of(key, definitions, invertible) if _is_matrix(key) else None
        value_shape = shape_of(value, definitions, invertible)
        if (key_shape is None) != (value_shape is None) or (
            key_shape is not None and not all(map(same_size, key_shape, value_shape))
        ):
            raise IllTyped(f"definition of {key}: shape {key_shape} := shape {value_shape}")


def normal_form(expr, definitions: Mapping | None = None, facts=(), invertible=()) -> Terms:
    """Expand ``expr`` into ``{factors: coefficient}`` with like terms collected and zeros dropped.

    ``definitions`` maps a symbol to the expression it abbreviates; each is unfolded wherever it
    occurs. ``facts`` are ``(product, value)`` pairs assumed to hold (say ``A 1 = 1`` for an
    attention pattern); every contiguous occurrence of ``product`` is replaced by ``value``.
    ``invertible`` lists the square matrices whose inverses may appear (and cancel). Every
    expression is type-checked first (:class:`IllTyped`, :class:`NotExact`). Coefficients are
    simplified with ``sympy.simplify``.
    """
    definitions = dict(definitions or {})
    _check_definitions(definitions, invertible)
    shape = shape_of(expr, definitions, invertible)
    if shape is None:
        raise IllTyped(f"expected a matrix expression, got the scalar {expr!r}")
    for lhs, rhs in facts:
        left, right = shape_of(lhs, definitions, invertible), shape_of(rhs, definitions, invertible)
        if right is None or not all(map(same_size, left, right)):
            raise IllTyped(f"the fact {lhs} = {rhs} equates shapes {left} and {right}")
    ctx = _Context(definitions, invertible)
    terms = _expand(expr, ctx)
    if facts:
        terms = _rewrite(terms, facts, ctx)
    terms = {f: c for f, c in ((f, sympy.simplify(c)) for f, c in terms.items()) if c != 0}
    # What is left may still vanish by the rules of the canonical form; when it does not, the
    # terms are returned as expanded, which is how a reader wrote them.
    return terms if terms and _canonical(terms, ctx, facts) else {}


def is_zero(expr, definitions: Mapping | None = None, facts=(), invertible=()) -> bool:
    """True when the normal form of ``expr`` has no terms: a proof that ``expr`` is zero.

    ``definitions`` maps a symbol to the expression it stands for (unfolded first), ``facts`` are
    ``(product, value)`` rewrites, ``invertible`` the matrices whose inverses may appear. False
    means "not proved", not "nonzero": a counterexample is :func:`evaluate`'s job."""
    return not normal_form(expr, definitions, facts, invertible)
