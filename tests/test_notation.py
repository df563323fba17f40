"""The tensor-product notation in the proof engine (circuitmath._kronecker) and in torch."""

import pytest
import sympy
import torch
from hypothesis import given, strategies as st
from sympy import Identity, MatAdd, MatMul, MatrixSymbol, Symbol, Transpose
from sympy.matrices.expressions.kronecker import KroneckerProduct, combine_kronecker

import circuitmath as cm
from circuitmath._algebra import is_zero, normal_form
from circuitmath._instances import evaluate, random_instance
from circuitmath._latex import to_latex
from circuitmath._kronecker import Apply, act, expand_operator, notation_definitions, tensor
from circuitmath._proof import Proof, Step
from circuitmath.circuits import TensorProduct, vec

n, d = Symbol("n", positive=True, integer=True), Symbol("d", positive=True, integer=True)
A, C = MatrixSymbol("A", n, n), MatrixSymbol("C", n, n)
B, D = MatrixSymbol("B", d, d), MatrixSymbol("D", d, d)
X = MatrixSymbol("X", n, d)


def _definitions(*exprs):
    return {definition.symbol: definition.value for definition in notation_definitions(exprs)}


def _equal(lhs, rhs) -> bool:
    return is_zero(lhs - rhs, _definitions(lhs, rhs))


def test_action_is_the_papers_definition():
    assert act(tensor(A, B), X) == MatMul(A, X, Transpose(B))
    assert act(Identity(n * d), X) == X
    assert _equal(Apply(tensor(A, B), X), MatMul(A, X, Transpose(B)))


def test_products_act_right_to_left_and_sums_term_by_term():
    product = MatMul(tensor(A, B), tensor(C, D))
    assert _equal(Apply(product, X), Apply(tensor(A, B), Apply(tensor(C, D), X)))
    assert _equal(Apply(MatAdd(tensor(A, B), tensor(C, D)), X), MatAdd(Apply(tensor(A, B), X), Apply(tensor(C, D), X)))
    assert _equal(Apply(MatMul(2, tensor(A, B)), X), MatMul(2, A, X, Transpose(B)))
    assert _equal(Apply(Transpose(tensor(A, B)), X), MatMul(Transpose(A), X, B))


def test_mixed_product_and_its_wrong_orders():
    lhs = Apply(tensor(A, B), Apply(tensor(C, D), X))
    assert _equal(lhs, Apply(tensor(MatMul(A, C), MatMul(B, D)), X))
    assert not _equal(lhs, Apply(tensor(MatMul(C, A), MatMul(B, D)), X))
    assert not _equal(lhs, Apply(tensor(MatMul(A, C), MatMul(D, B)), X))


def test_apply_nodes_are_opaque_without_their_definition():
    """Soundness guard: the engine never reads meaning into an undefined node."""
    lhs = Apply(tensor(A, B), X)
    assert not is_zero(lhs - MatMul(A, X, Transpose(B)))


def test_apply_keeps_its_shape_and_survives_sympy_rewrites():
    V = Symbol("V", positive=True, integer=True)
    E = MatrixSymbol("E", d, V)
    t = MatrixSymbol("t", n, V)
    node = Apply(tensor(A, E), t)
    assert node.shape == (n, d)
    assert node.doit() is node and node.xreplace({A: C}).shape == (n, d)
    assert to_latex(node) == r"\left(A \otimes E\right) \cdot t"


def test_combine_kronecker_is_unsound_on_sums_and_expand_operator_is_not():
    """sympy 1.14 rewrites A⊗B + C⊗D as (A+C)⊗(B+D); expand_operator must never do that."""
    total = MatAdd(tensor(A, B), tensor(C, D))
    sympys = combine_kronecker(total)
    if sympys != total:  # the unsound rewrite: the engine must refute it, symbolically and exactly
        assert not _equal(Apply(total, X), Apply(sympys, X))
        values = random_instance([Apply(total, X), Apply(sympys, X)], {n: 2, d: 2}, seed=0,
                                 definitions=_definitions(Apply(total, X), Apply(sympys, X)))
        gap = evaluate(Apply(total, X) - Apply(sympys, X), values, _definitions(Apply(total, X), Apply(sympys, X)))
        assert any(v != 0 for v in gap)
    ours = expand_operator(total)
    assert isinstance(ours, MatAdd) and len(ours.args) == 2
    assert _equal(Apply(total, X), Apply(ours, X))


def test_expand_operator_distributes_then_combines_each_term():
    U = MatrixSymbol("U", d, d)
    op = MatMul(tensor(Identity(n), U), MatAdd(Identity(n * d), tensor(A, B), tensor(C, D)), tensor(Identity(n), D))
    expanded = expand_operator(op)
    assert len(expanded.args) == 3
    assert all(isinstance(term, KroneckerProduct) for term in expanded.args)
    assert _equal(Apply(op, X), Apply(expanded, X))


def test_a_proof_with_tensor_products_checks_each_step():
    lhs = Apply(tensor(A, B), Apply(tensor(C, D), X))
    wrong = Apply(tensor(MatMul(C, A), MatMul(B, D)), X)
    proof = Proof(
        lhs=lhs, rhs=wrong, steps=(Step(wrong, "a wrong mixed product"),),
        explicit_dims={n: 2, d: 3}, definitions=notation_definitions([lhs, wrong]),
    )
    assert not proof.verify().proved


def test_notation_identities_are_proved_with_symbolic_dimensions_except_kronecker_vec():
    for name in ("tensor_product_action", "tensor_mixed_product", "row_column_convention"):
        assert cm.get_identity(name).proof.symbolic_dims, name
    kron = cm.get_identity("kronecker_vec").proof
    assert not kron.symbolic_dims and "explicit" in kron.explicit_only


# -- torch -----------------------------------------------------------------------------------

shapes = st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**31))


def _random(shape, generator):
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


@given(shapes)
def test_tensor_product_acts_as_a_x_b_transpose_and_as_kron_on_row_major_vec(sizes):
    n_out, n_in, d_out, d_in, seed = sizes
    g = torch.Generator().manual_seed(seed)
    P, F, x = _random((n_out, n_in), g), _random((d_out, d_in), g), _random((n_in, d_in), g)
    op = TensorProduct(P, F)
    torch.testing.assert_close(op.apply(x), P @ x @ F.T)
    torch.testing.assert_close(op.kron(), torch.kron(P, F))
    torch.testing.assert_close(op.kron() @ vec(x), vec(op.apply(x)))
    torch.testing.assert_close(op.T.apply(op.apply(x).new_ones(n_out, d_out)), P.T @ torch.ones(n_out, d_out, dtype=x.dtype) @ F)
    if n_in > 1 and d_in > 1:  # column-major vec needs kron(F, P), not kron(P, F)
        assert not torch.allclose(op.kron() @ vec(x.T.contiguous()), vec(op.apply(x).T.contiguous()))


@given(shapes)
def test_mixed_product_in_torch(sizes):
    n_, m_, d_, q_, seed = sizes
    g = torch.Generator().manual_seed(seed)
    first = TensorProduct(_random((m_, n_), g), _random((q_, d_), g))
    second = TensorProduct(_random((n_, m_), g), _random((d_, q_), g))
    x = _random((n_, d_), g)
    torch.testing.assert_close((second @ first).apply(x), second.apply(first.apply(x)))


def test_batched_kron_matches_torch_kron_per_batch():
    g = torch.Generator().manual_seed(0)
    P, F = _random((3, 2, 2), g), _random((4, 3), g)
    batched = TensorProduct(P, F).kron()
    for b in range(3):
        torch.testing.assert_close(batched[b], torch.kron(P[b], F))


def test_tensor_product_refuses_other_operands():
    op = TensorProduct(torch.eye(2), torch.eye(2))
    with pytest.raises(TypeError):
        op @ torch.eye(2)


def test_sympy_is_the_pinned_version():
    assert sympy.__version__ == "1.14.0"
