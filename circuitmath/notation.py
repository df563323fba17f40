"""The tensor-product notation, symbolically: write operators and check claims about them.

An operator ``A ⊗ B`` acts on a matrix ``X`` ``[positions, features]`` by ``(A ⊗ B)·X := A X Bᵀ``
(``A`` ``[m, n]`` mixes positions, ``B`` ``[q, d]`` features, ``X`` ``[n, d]``, the result
``[m, q]``). Operators are sympy matrix expressions: :func:`tensor` writes ``A ⊗ B``, sums and
products of operators are ``MatAdd`` and ``MatMul`` (a product acts right to left), and
:class:`Apply` is ``op·X``. The proof engine knows matrix products, sums and transposes, nothing
about operators: :func:`notation_definitions` turns every ``op·X`` into the plain matrix
expression it stands for, and :func:`is_zero` decides, in the engine's normal form with those
definitions unfolded, whether an expression is zero. :func:`expand_operator` multiplies out
products of sums of tensor products with the mixed product, which sympy's ``combine_kronecker``
gets wrong on a sum.

The same notation on torch tensors is :class:`circuitmath.circuits.TensorProduct` and
:func:`circuitmath.circuits.vec`.

>>> from sympy import MatAdd, MatrixSymbol, Symbol
>>> from sympy.matrices.expressions.kronecker import combine_kronecker
>>> n, d = Symbol("n", positive=True, integer=True), Symbol("d", positive=True, integer=True)
>>> A, C, B, D = MatrixSymbol("A", n, n), MatrixSymbol("C", n, n), MatrixSymbol("B", d, d), MatrixSymbol("D", d, d)
>>> X = MatrixSymbol("X", n, d)
>>> total = MatAdd(tensor(A, B), tensor(C, D))
>>> def same_operator(left, right):
...     nodes = [Apply(left, X), Apply(right, X)]
...     definitions = {df.symbol: df.value for df in notation_definitions(nodes)}
...     return is_zero(nodes[0] - nodes[1], definitions)
>>> same_operator(total, expand_operator(total)), same_operator(total, combine_kronecker(total))
(True, False)
"""

from ._algebra import is_zero as is_zero
from ._kronecker import (
    Apply as Apply,
    expand_operator as expand_operator,
    notation_definitions as notation_definitions,
    tensor as tensor,
)

__all__ = ["tensor", "Apply", "notation_definitions", "expand_operator", "is_zero"]
