"""The normal form proves what is true and refuses what is false."""

import pytest
import sympy
from sympy import DiagMatrix, Identity, MatAdd, MatMul, MatPow, MatrixSymbol, OneMatrix, Symbol, Transpose

from circuitmath._algebra import IllTyped, is_zero, normal_form
from circuitmath._instances import evaluate, random_instance
from circuitmath._latex import to_latex
from circuitmath._proof import Proof, Step, Twin

n, k = Symbol("n", positive=True, integer=True), Symbol("k", positive=True, integer=True)
A, B, C = MatrixSymbol("A", n, n), MatrixSymbol("B", n, n), MatrixSymbol("C", n, k)
v = MatrixSymbol("v", n, 1)
ones = OneMatrix(n, 1)
P = MatrixSymbol("P", n, n)
CENTERING = {P: MatAdd(Identity(n), MatMul(-1 / n, ones, ones.T))}


def test_distributivity_and_powers():
    assert is_zero(MatMul(A, MatAdd(B, A)) - MatAdd(MatMul(A, B), MatPow(A, 2)))
    assert is_zero(MatPow(MatAdd(A, B), 2) - MatAdd(MatPow(A, 2), MatMul(A, B), MatMul(B, A), MatPow(B, 2)))


def test_non_commutativity_is_respected():
    assert not is_zero(MatMul(A, B) - MatMul(B, A))
    assert not is_zero(MatPow(MatAdd(A, B), 2) - MatAdd(MatPow(A, 2), MatMul(2, A, B), MatPow(B, 2)))


def test_transpose_of_product_reverses():
    assert is_zero(Transpose(MatMul(A, C)) - MatMul(Transpose(C), Transpose(A)))
    D = MatrixSymbol("D", n, n)
    assert not is_zero(Transpose(MatMul(A, D)) - MatMul(Transpose(A), Transpose(D)))
    with pytest.raises(IllTyped, match="times"):  # A^T C^T does not even type-check for n != k
        is_zero(Transpose(MatMul(A, C)) - MatMul(Transpose(A), Transpose(C)))


def test_centering_matrix_is_idempotent_symmetric_and_kills_ones():
    assert is_zero(MatMul(P, P) - P, CENTERING)
    assert is_zero(Transpose(P) - P, CENTERING)
    assert is_zero(MatMul(P, ones), CENTERING)
    assert not is_zero(MatMul(P, v), CENTERING)


def test_ones_products_count_the_inner_dimension():
    terms = normal_form(MatMul(ones.T, ones))
    assert terms == {(): n}


def test_diag_matrix_does_not_commute():
    assert not is_zero(MatMul(DiagMatrix(v), A) - MatMul(A, DiagMatrix(v)))


def test_evaluate_matches_explicit_arithmetic():
    values = random_instance([MatMul(A, B)], {n: 3, k: 2}, seed=1)
    explicit = sympy.Matrix(values[A]) * sympy.Matrix(values[B])
    assert evaluate(MatMul(A, B), values) == explicit


def test_proof_with_a_broken_step_is_not_proved():
    proof = Proof(
        lhs=MatMul(A, MatAdd(B, A)),
        rhs=MatAdd(MatMul(A, B), MatMul(A, A)),
        steps=(Step(MatAdd(MatMul(B, A), MatMul(A, A)), "a wrong step: A B = B A"),
               Step(MatAdd(MatMul(A, B), MatMul(A, A)), "back")),
        explicit_dims={n: 3, k: 2},
    )
    report = proof.verify()
    assert not report.proved
    assert [s.holds for s in report.steps] == [False, False]


def test_proof_whose_chain_does_not_reach_the_claim_is_not_proved():
    proof = Proof(lhs=MatMul(A, B), rhs=MatMul(B, A), steps=(Step(MatMul(A, B), "nothing"),), explicit_dims={n: 3, k: 2})
    assert not proof.verify().proved


def test_a_true_twin_is_not_rejected():
    proof = Proof(
        lhs=MatMul(A, MatAdd(B, A)),
        rhs=MatAdd(MatMul(A, B), MatMul(A, A)),
        steps=(Step(MatAdd(MatMul(A, B), MatMul(A, A)), "distribute"),),
        explicit_dims={n: 3, k: 2},
        twins=(Twin("true", "actually true", MatMul(A, B), MatMul(A, B)),
               Twin("false", "commute", MatMul(A, B), MatMul(B, A))),
    )
    report = proof.verify()
    assert report.proved
    assert [t.rejected for t in report.twins] == [False, True]
    assert not report.ok


def test_latex_writes_ones_and_diag_the_usual_way():
    assert to_latex(ones) == r"\mathbf{1}_{n}"
    assert to_latex(DiagMatrix(v)) == r"\operatorname{diag}(v)"
    assert to_latex(Transpose(MatMul(A, B))) == r"\left(A B\right)^{\top}"


@pytest.mark.parametrize("bad", [MatPow(A, -1)])
def test_negative_powers_are_refused(bad):
    with pytest.raises(ValueError):
        normal_form(bad)


def test_facts_rewrite_contiguous_products_only():
    pattern = MatrixSymbol("A", n, n)
    fact = [(MatMul(pattern, ones), ones)]
    assert is_zero(MatMul(B, pattern, ones) - MatMul(B, ones), facts=fact)
    assert not is_zero(MatMul(pattern, B, ones) - MatMul(B, ones), facts=fact)
    assert not is_zero(MatMul(B, pattern, ones) - MatMul(B, ones))


def test_a_sampler_that_breaks_a_fact_is_an_error():
    from circuitmath._proof import Fact

    proof = Proof(
        lhs=MatMul(A, ones), rhs=ones, steps=(Step(ones, "rows of A sum to 1"),),
        explicit_dims={n: 3, k: 2}, facts=(Fact(MatMul(A, ones), ones, "rows of A sum to 1"),),
    )
    report = proof.verify()
    assert not report.proved
    assert any("breaks the assumption" in reason for reason in report.reasons), report.reasons


# -- the normal form on its own refuses what it cannot read ------------------------------------

W = MatrixSymbol("W", n, k)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: normal_form(n), IllTyped, "got the scalar"),
        (lambda: normal_form(A, {A: W}), IllTyped, "definition of A"),
        (lambda: normal_form(MatMul(A, v), facts=[(MatMul(A, v), MatrixSymbol("w", k, 1))]), IllTyped, "the fact"),
        (lambda: normal_form(MatMul(A, v), facts=[(MatAdd(A, B), A)]), ValueError, "plain product"),
        (lambda: normal_form(MatMul(P, sympy.Inverse(P)), CENTERING, invertible=[P]), IllTyped, "inverse of a defined"),
        (
            lambda: normal_form(MatMul(A, B), facts=[(MatMul(A, B), MatMul(B, A)), (MatMul(B, A), MatMul(A, B))]),
            ValueError,
            "did not terminate",
        ),
    ],
)
def test_normal_form_refusals(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_evaluate_refuses_an_unknown_node():
    from sympy import HadamardProduct

    values = random_instance([A, B], {n: 2, k: 3}, seed=0)
    with pytest.raises(TypeError, match="cannot evaluate"):
        evaluate(HadamardProduct(A, B), values)


def test_real_scalars_are_drawn_with_both_signs():
    a, s = Symbol("a", real=True), Symbol("s", positive=True)
    drawn = [random_instance([MatMul(a, s, A)], {n: 2, k: 3}, seed=seed) for seed in range(20)]
    assert min(d[a] for d in drawn) < 0 < max(d[a] for d in drawn)
    assert all(d[s] > 0 for d in drawn)


def test_a_twin_equating_a_matrix_and_a_scalar_is_ill_typed_not_a_crash():
    proof = Proof(
        lhs=MatMul(A, B), rhs=MatMul(A, B), steps=(Step(MatMul(A, B), "nothing"),), explicit_dims={n: 3, k: 2},
        twins=(Twin("scalar", "a matrix equals a number", MatMul(ones.T, ones), n),),
    )
    report = proof.verify()
    assert report.proved and not report.twins[0].rejected
    assert report.twins[0].symbolic_residual.startswith("ill-typed")


def test_derivation_latex_has_one_line_per_step():
    proof = Proof(
        lhs=MatMul(A, MatAdd(B, A)), rhs=MatAdd(MatMul(A, B), MatMul(A, A)),
        steps=(Step(MatAdd(MatMul(A, B), MatMul(A, A)), "distribute"),), explicit_dims={n: 3, k: 2},
    )
    latex = proof.derivation_latex()
    assert latex.count(r"\\") == len(proof.steps) and r"\text{distribute}" in latex
