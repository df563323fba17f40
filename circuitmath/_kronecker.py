"""The tensor-product notation of the circuits framework, for the proof engine.

An operator ``A ⊗ B`` acts on a matrix ``X`` (rows: positions, columns: features) by

    (A ⊗ B)·X := A X Bᵀ,

``A`` mixing positions and ``B`` mixing features. Operators are written with sympy's
``KroneckerProduct`` (it prints as ``A \\otimes B``), added and multiplied with ``MatAdd`` and
``MatMul`` (a product acts right to left: ``(S T)·X := S·(T·X)``) and applied with :class:`Apply`.
``KroneckerProduct(I_n, I_d)`` collapses to sympy's ``Identity(n d)``, the identity operator.

The normal form of :mod:`circuitmath._algebra` knows nothing of operators. Instead, every
``Apply`` node of a proof becomes a :class:`~circuitmath._proof.Definition` whose value is the plain
matrix expression it stands for, computed by :func:`act` from the rules above alone (the paper's
definition of ``⊗``, linearity, composition). The checker then unfolds these definitions like any
other: no property of ``⊗`` (the mixed product, the order of application) is assumed, each is
proved. That ``A ⊗ B`` is also the Kronecker product of matrices acting on the row-major
vectorisation of ``X`` is an identity of its own (``kronecker_vec``).

sympy 1.14's ``combine_kronecker`` rewrites ``A⊗B + C⊗D`` as ``(A+C)⊗(B+D)``, which is false.
:func:`expand_operator` distributes first and combines each product separately.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import sympy
from sympy import Identity, MatAdd, MatMul, MatPow, MatrixExpr, MatrixSymbol, Transpose
from sympy.matrices.expressions.kronecker import KroneckerProduct, combine_kronecker

from ._proof import Definition

__all__ = ["Apply", "act", "expand_operator", "notation_definitions", "tensor"]

#: The text of every definition :func:`notation_definitions` produces.
NOTATION = r"$(A \otimes B)\cdot X := A X B^\top$, extended by linearity and composition"


def tensor(positions, features) -> MatrixExpr:
    """``positions ⊗ features`` as an (unevaluated) sympy ``KroneckerProduct``: with
    ``positions`` ``[m, n]`` and ``features`` ``[q, d]`` it takes an ``X`` ``[n, d]`` to
    ``positions X featuresᵀ`` ``[m, q]`` (its own shape, as a Kronecker matrix, is ``[m q, n d]``)."""
    return KroneckerProduct(positions, features)


def _is_operator_symbol(op, operators: Mapping) -> bool:
    return isinstance(op, MatrixSymbol) and op in operators


def act(op, X, operators: Mapping | None = None) -> MatrixExpr:
    """The plain matrix expression ``op·X`` stands for.

    ``op`` is built from ``KroneckerProduct(A, B)`` (two factors), ``Identity``, ``MatAdd``,
    ``MatMul`` (scalars allowed), non-negative integer ``MatPow``, ``Transpose`` and operator
    symbols listed in ``operators`` (a map from a ``MatrixSymbol`` to the operator it names).
    """
    operators = dict(operators or {})
    if _is_operator_symbol(op, operators):
        return act(operators[op], X, operators)
    if isinstance(op, KroneckerProduct):
        if len(op.args) != 2:
            raise ValueError(f"a tensor-product operator has two factors (positions, features), got {op}")
        A, B = op.args
        return MatMul(A, X, Transpose(B))
    if isinstance(op, Identity):
        return X
    if isinstance(op, MatAdd):
        return MatAdd(*(act(arg, X, operators) for arg in op.args))
    if isinstance(op, MatMul):
        scalars = [a for a in op.args if not isinstance(a, MatrixExpr)]
        result = X
        for factor in reversed([a for a in op.args if isinstance(a, MatrixExpr)]):
            result = act(factor, result, operators)
        return MatMul(*scalars, result) if scalars else result
    if isinstance(op, MatPow):
        base, exponent = op.args
        if not (exponent.is_Integer and exponent >= 0):
            raise ValueError(f"only non-negative integer powers of an operator act: {op}")
        result = X
        for _ in range(int(exponent)):
            result = act(base, result, operators)
        return result
    if isinstance(op, Transpose):
        return act(_transpose(op.arg, operators), X, operators)
    raise TypeError(f"{op} is not a tensor-product operator (KroneckerProduct, sums, products)")


def _transpose(op, operators: Mapping) -> MatrixExpr:
    """``opᵀ`` pushed down to the factors: ``(A ⊗ B)ᵀ = Aᵀ ⊗ Bᵀ``, ``(S T)ᵀ = Tᵀ Sᵀ``."""
    if _is_operator_symbol(op, operators):
        return _transpose(operators[op], operators)
    if isinstance(op, KroneckerProduct):
        return KroneckerProduct(*(Transpose(a) for a in op.args))
    if isinstance(op, Identity):
        return op
    if isinstance(op, MatAdd):
        return MatAdd(*(_transpose(a, operators) for a in op.args))
    if isinstance(op, MatMul):
        scalars = [a for a in op.args if not isinstance(a, MatrixExpr)]
        factors = [_transpose(a, operators) for a in reversed(op.args) if isinstance(a, MatrixExpr)]
        return MatMul(*scalars, *factors)
    if isinstance(op, Transpose):
        return op.arg
    raise TypeError(f"{op} is not a tensor-product operator")


def _output_shape(op, in_shape, operators: Mapping):
    """``(positions, features)`` of ``op·X`` for ``X`` of shape ``in_shape``."""
    if _is_operator_symbol(op, operators):
        return _output_shape(operators[op], in_shape, operators)
    if isinstance(op, KroneckerProduct):
        return (op.args[0].shape[0], op.args[1].shape[0])
    if isinstance(op, MatAdd):
        return _output_shape(op.args[0], in_shape, operators)
    if isinstance(op, MatMul):
        shape = in_shape
        for factor in reversed([a for a in op.args if isinstance(a, MatrixExpr)]):
            shape = _output_shape(factor, shape, operators)
        return shape
    if isinstance(op, (Transpose, MatPow)):
        return act(op, MatrixSymbol("_X", *in_shape), operators).shape
    return in_shape  # Identity


class Apply(MatrixExpr):
    """``op·X``: the operator ``op`` applied to the matrix ``X`` ``[positions, features]``.

    The shape of the result is computed from ``op`` (operator symbols are resolved through
    ``operators``) and kept in the node, so rebuilding it (``xreplace``) needs no ``operators``.
    """

    #: A proof may define this node (``op·X := act(op, X)``) although it is not a symbol.
    is_notation = True

    def __new__(cls, op, X, rows=None, cols=None, *, operators: Mapping | None = None):
        op, X = sympy.sympify(op), sympy.sympify(X)
        if rows is None or cols is None:
            rows, cols = _output_shape(op, X.shape, dict(operators or {}))
        return super().__new__(cls, op, X, sympy.sympify(rows), sympy.sympify(cols))

    @property
    def op(self):
        return self.args[0]

    @property
    def X(self):
        return self.args[1]

    @property
    def shape(self):
        return (self.args[2], self.args[3])

    def doit(self, **hints):
        """Left alone: the node is unfolded through its definition, never rewritten by sympy."""
        return self

    def meaning(self, definitions: Mapping | None = None) -> MatrixExpr | None:
        """The only value a proof may define this node as: :func:`act`'s, operator symbols
        resolved through ``definitions``; ``None`` when ``op`` is not an operator."""
        operators = {k: v for k, v in (definitions or {}).items() if isinstance(k, MatrixSymbol)}
        try:
            return act(self.op, self.X, operators)
        except (TypeError, ValueError):
            return None

    def _latex(self, printer) -> str:
        op = printer._print(self.op)
        if not isinstance(self.op, MatrixSymbol):
            op = rf"\left({op}\right)"
        x = printer._print(self.X)
        if isinstance(self.X, (MatAdd, MatMul, Apply)):
            x = rf"\left({x}\right)"
        return rf"{op} \cdot {x}"

    def _sympystr(self, printer) -> str:
        return f"({printer._print(self.op)}).({printer._print(self.X)})"


def notation_definitions(exprs: Iterable, operators: Mapping | None = None) -> tuple[Definition, ...]:
    """One :class:`Definition` ``op·X := act(op, X)`` for every :class:`Apply` node in ``exprs``."""
    nodes: dict = {}
    for expr in exprs:
        for node in sympy.sympify(expr).atoms(Apply):
            nodes.setdefault(node, None)
    return tuple(Definition(node, act(node.op, node.X, operators), NOTATION) for node in nodes)


def _transposed(op) -> MatrixExpr:
    """``opᵀ`` with the transpose pushed through sums, products and tensor products
    (``(A ⊗ B)ᵀ = Aᵀ ⊗ Bᵀ``), so that no sum hides under a transpose."""
    if isinstance(op, MatAdd):
        return MatAdd(*(_transposed(a) for a in op.args))
    if isinstance(op, MatMul):
        scalars = [a for a in op.args if not isinstance(a, MatrixExpr)]
        return MatMul(*scalars, *(_transposed(a) for a in reversed(op.args) if isinstance(a, MatrixExpr)))
    if isinstance(op, KroneckerProduct):
        return KroneckerProduct(*(_transposed(a) for a in op.args))
    if isinstance(op, Transpose):
        return op.arg
    if isinstance(op, Identity):
        return op
    return Transpose(op)


def _distribute(op) -> list:
    """``op`` as a list of products (each a list of factors, scalars included), sums expanded."""
    if isinstance(op, Transpose):
        pushed = _transposed(op.arg)
        return [[pushed]] if isinstance(pushed, Transpose) else _distribute(pushed)
    if isinstance(op, MatAdd):
        return [p for arg in op.args for p in _distribute(arg)]
    if isinstance(op, MatMul):
        products = [[]]
        for arg in op.args:
            if isinstance(arg, MatrixExpr):
                products = [p + q for p in products for q in _distribute(arg)]
            else:
                products = [p + [arg] for p in products]
        return products
    return [[op]]


def expand_operator(op) -> MatrixExpr:
    """Distribute products of operators over sums, then apply the mixed product to each term.

    ``(S + T)(U + V)`` becomes ``S U + S V + T U + T V``; each product of tensor products is then
    combined with sympy's ``combine_kronecker``, which is sound on a product but not on a sum
    (sympy 1.14 turns ``A⊗B + C⊗D`` into ``(A+C)⊗(B+D)``), so it never sees one. Identity
    operators are dropped from products.
    """
    terms = []
    for product in _distribute(op):
        factors = [f for f in product if not isinstance(f, Identity)]
        matrices = [f for f in factors if isinstance(f, MatrixExpr)]
        if not matrices:  # the identity operator, times scalars
            identity = next(f for f in product if isinstance(f, Identity))
            terms.append(MatMul(*factors, identity) if factors else identity)
            continue
        combined = combine_kronecker(MatMul(*factors)) if len(matrices) > 1 else MatMul(*factors)
        terms.append(combined)
    return MatAdd(*terms) if len(terms) > 1 else terms[0]
