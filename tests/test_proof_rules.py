"""The rules of the normal form that true identities need, each with a near miss it must reject.

Trace cyclicity (and its limit: only rotations, tr(ABC) != tr(BAC)), 1 x 1 products are scalars
equal to their transposes, diagonal matrices commute, inverses of inverses and of products under
declared invertibility, a declared-invertible sum cancels with its inverse, and a fact applies to
a vector of ones inside a ones matrix. Each true claim is a proof whose twins are the near misses:
``ok`` means the claim is proved on symbolic sizes and on exact instances, and every twin is
rejected with an exact counterexample. Malformed facts are bad input (:class:`FactError`).
"""

import pytest
import sympy
from sympy import DiagMatrix, Identity as Eye, Inverse, MatAdd, MatMul, MatrixSymbol, OneMatrix, Symbol, Trace, Transpose

from circuitmath import CircuitMathError
from circuitmath._proof import Fact, FactError, Proof, Step, Twin

n, k = Symbol("n", positive=True, integer=True), Symbol("k", positive=True, integer=True)
DIMS = {n: 3, k: 2}
A, B, C, D = (MatrixSymbol(s, n, n) for s in "ABCD")
W, V = MatrixSymbol("W", n, k), MatrixSymbol("V", k, n)
x, y, u = MatrixSymbol("x", n, 1), MatrixSymbol("y", n, 1), MatrixSymbol("u", n, 1)
a, b, c = MatrixSymbol("a", n, 1), MatrixSymbol("b", n, 1), MatrixSymbol("c", n, 1)
ones = OneMatrix(n, 1)


def tr(*factors):
    return Trace(MatMul(*factors))


def _unit_lower(rng, shape):
    return sympy.Matrix(*shape, lambda i, j: 1 if i == j else (rng.randint(-3, 3) if i > j else 0))


def _strictly_lower(rng, shape):
    return sympy.Matrix(*shape, lambda i, j: rng.randint(-3, 3) if i > j else 0)


def _rows_sum_to_one(rng, shape):
    rows = [[rng.randint(-3, 3) for _ in range(shape[1] - 1)] for _ in range(shape[0])]
    return sympy.Matrix([r + [1 - sum(r)] for r in rows])


def _columns_sum_to_one(rng, shape):
    return _rows_sum_to_one(rng, shape[::-1]).T


def proof(lhs, *chain, twins=(), **options) -> Proof:
    options.setdefault("explicit_dims", DIMS)
    return Proof(lhs=lhs, rhs=chain[-1], steps=tuple(Step(e, "rule") for e in chain), twins=twins, **options)


def invertible(*matrices):
    return tuple(Fact.invertible(M, "invertible") for M in matrices)


RULES = {
    "tr(AB) = tr(BA)": lambda: proof(
        MatMul(tr(A, B), D), MatMul(tr(B, A), D),
        twins=(Twin("one_factor_transposed", "tr(AB) = tr(A^T B)", MatMul(tr(A, B), D), MatMul(tr(Transpose(A), B), D)),),
    ),
    "tr(ABC) = tr(CAB) = tr(BCA), not tr(BAC)": lambda: proof(
        MatMul(tr(A, B, C), D), MatMul(tr(C, A, B), D), MatMul(tr(B, C, A), D),
        twins=(Twin("swap", "tr(ABC) = tr(BAC): a swap is not a rotation", MatMul(tr(A, B, C), D), MatMul(tr(B, A, C), D)),
               Twin("reverse", "tr(ABC) = tr(CBA)", MatMul(tr(A, B, C), D), MatMul(tr(C, B, A), D))),
    ),
    "tr(W V) = tr(V W) for W n x k": lambda: proof(
        MatMul(tr(W, V), D), MatMul(tr(V, W), D),
        twins=(Twin("transposed", "tr(W V) = tr(W V^T ...)", MatMul(tr(W, V), D), MatMul(tr(Transpose(V), Transpose(W), A), D)),),
    ),
    "tr(A^T B) = tr(B^T A)": lambda: proof(
        MatMul(tr(Transpose(A), B), D), MatMul(tr(Transpose(B), A), D),
        twins=(Twin("untransposed", "tr(A^T B) = tr(A B)", MatMul(tr(Transpose(A), B), D), MatMul(tr(A, B), D)),),
    ),
    "x^T y = y^T x": lambda: proof(
        MatMul(x.T, y), MatMul(y.T, x),
        twins=(Twin("outer", "x y^T = y x^T: an outer product is not symmetric", MatMul(x, y.T), MatMul(y, x.T)),),
    ),
    "x^T A y = y^T A^T x": lambda: proof(
        MatMul(x.T, A, y), MatMul(y.T, A.T, x),
        twins=(Twin("A_untransposed", "x^T A y = y^T A x", MatMul(x.T, A, y), MatMul(y.T, A, x)),),
    ),
    "u (x^T y) = (y^T x) u": lambda: proof(
        MatMul(u, x.T, y), MatMul(y.T, x, u.T).T,
        twins=(Twin("wrong_vector", "u x^T y = x y^T u", MatMul(u, x.T, y), MatMul(x, y.T, u)),),
    ),
    "diag(a) diag(b) = diag(b) diag(a)": lambda: proof(
        MatMul(DiagMatrix(a), DiagMatrix(b)), MatMul(DiagMatrix(b), DiagMatrix(a)),
        twins=(Twin("past_a_matrix", "diag(a) B diag(b) = diag(b) B diag(a)",
                    MatMul(DiagMatrix(a), B, DiagMatrix(b)), MatMul(DiagMatrix(b), B, DiagMatrix(a))),),
    ),
    "diag(a) B diag(b) diag(c) = diag(a) B diag(c) diag(b)": lambda: proof(
        MatMul(DiagMatrix(a), B, DiagMatrix(b), DiagMatrix(c)), MatMul(DiagMatrix(a), B, DiagMatrix(c), DiagMatrix(b)),
        twins=(Twin("diag_and_matrix", "diag(a) B = B diag(a)", MatMul(DiagMatrix(a), B), MatMul(B, DiagMatrix(a))),),
    ),
    "(A^-1)^-1 = A": lambda: proof(
        Inverse(Inverse(A)), A, facts=invertible(A), samplers={A: _unit_lower},
        twins=(Twin("inverse_kept", "(A^-1)^-1 = A^-1", Inverse(Inverse(A)), Inverse(A)),),
    ),
    "(AB)^-1 = B^-1 A^-1": lambda: proof(
        Inverse(MatMul(A, B)), MatMul(Inverse(B), Inverse(A)), facts=invertible(A, B),
        samplers={A: _unit_lower, B: _unit_lower},
        twins=(Twin("same_order", "(AB)^-1 = A^-1 B^-1", Inverse(MatMul(A, B)), MatMul(Inverse(A), Inverse(B))),),
    ),
    "(2A)^-1 = A^-1 / 2": lambda: proof(
        Inverse(MatMul(2, A)), MatMul(sympy.Rational(1, 2), Inverse(A)), facts=invertible(A), samplers={A: _unit_lower},
        twins=(Twin("scalar_kept", "(2A)^-1 = 2 A^-1", Inverse(MatMul(2, A)), MatMul(2, Inverse(A))),),
    ),
    "(A+B)(A+B)^-1 = I = (A+B)^-1 (A+B)": lambda: proof(
        MatMul(MatAdd(A, B), Inverse(MatAdd(A, B))), Eye(n), MatMul(Inverse(MatAdd(A, B)), MatAdd(A, B)),
        facts=invertible(MatAdd(A, B), MatAdd(A, MatMul(-1, B))), samplers={A: _unit_lower, B: _strictly_lower},
        twins=(Twin("other_sum", "(A+B)(A-B)^-1 = I", MatMul(MatAdd(A, B), Inverse(MatAdd(A, MatMul(-1, B)))), Eye(n)),),
    ),
    "(A+B)(C+D)(C+D)^-1 (A+B)^-1 = I: the inner pair cancelled, then the pair it leaves adjacent": lambda: proof(
        MatMul(MatAdd(A, B), MatAdd(C, D), Inverse(MatAdd(C, D)), Inverse(MatAdd(A, B))), Eye(n),
        facts=invertible(MatAdd(A, B), MatAdd(C, D)),
        samplers={A: _unit_lower, B: _strictly_lower, C: _unit_lower, D: _strictly_lower},
        twins=(Twin("outer_pair_swapped", "(A+B)(C+D)(A+B)^-1 (C+D)^-1 = I: inverses cancel only as neighbours",
                    MatMul(MatAdd(A, B), MatAdd(C, D), Inverse(MatAdd(A, B)), Inverse(MatAdd(C, D))), Eye(n)),),
    ),
    "A 1 1^T = 1 1^T given A 1 = 1": lambda: proof(
        MatMul(A, ones, ones.T), MatMul(ones, ones.T), facts=(Fact(MatMul(A, ones), ones, "rows of A sum to 1"),),
        samplers={A: _rows_sum_to_one},
        twins=(Twin("other_side", "1 1^T A = 1 1^T: the rows sum to 1, not the columns",
                    MatMul(ones, ones.T, A), MatMul(ones, ones.T)),),
    ),
    "1 1^T A = 1 1^T given 1^T A = 1^T": lambda: proof(
        MatMul(ones, ones.T, A), MatMul(ones, ones.T), facts=(Fact(MatMul(ones.T, A), ones.T, "columns of A sum to 1"),),
        samplers={A: _columns_sum_to_one},
        twins=(Twin("other_side", "A 1 1^T = 1 1^T", MatMul(A, ones, ones.T), MatMul(ones, ones.T)),),
    ),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_proves_its_claim_and_rejects_its_near_miss(name):
    report = RULES[name]().verify(name)
    assert report.proved, report.reasons
    assert len(report.instances) == 2
    assert report.twins and all(t.rejected and t.counterexample_gap for t in report.twins), \
        [(t.name, t.symbolic_residual) for t in report.twins if not t.rejected]


#: Claims the rules must not reach: what they need is not declared, or it is false.
REJECTED = {
    "(A^-1)^-1 = A, A not declared invertible": lambda: proof(Inverse(Inverse(A)), A),
    "(AB)^-1 = B^-1 A^-1, B not declared invertible": lambda: proof(
        Inverse(MatMul(A, B)), MatMul(Inverse(B), Inverse(A)), facts=invertible(A)),
    "(sA)^-1 = A^-1 / s, s may be 0": lambda: proof(
        Inverse(MatMul(Symbol("s"), A)), MatMul(1 / Symbol("s"), Inverse(A)), facts=invertible(A)),
    "(A+B)(A+B)^-1 = I, A + B not declared invertible": lambda: proof(
        MatMul(MatAdd(A, B), Inverse(MatAdd(A, B))), Eye(n), facts=invertible(A, B)),
    "(A+B)^-1 (A+B) = I with A, B (not A + B) declared": lambda: proof(
        MatMul(Inverse(MatAdd(A, B)), MatAdd(A, B)), Eye(n), facts=invertible(A, B)),
    "A 1 1^T = 1 1^T without the fact": lambda: proof(MatMul(A, ones, ones.T), MatMul(ones, ones.T)),
    "tr(ABC) = tr(BAC)": lambda: proof(MatMul(tr(A, B, C), D), MatMul(tr(B, A, C), D)),
    "tr(W) of a non-square W": lambda: proof(MatMul(Trace(MatMul(W, V, W)), D), MatMul(Trace(MatMul(W, V, W)), D)),
    "x^T A y = y^T A x": lambda: proof(MatMul(x.T, A, y), MatMul(y.T, A, x)),
}


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_what_the_rules_must_not_prove_is_rejected(name):
    try:
        report = REJECTED[name]().verify(name)
    except (ValueError, CircuitMathError):  # refused while built: ill-typed
        return
    assert not report.proved


@pytest.mark.parametrize(
    "facts, words",
    [
        (invertible(sympy.ZeroMatrix(n, n)), "declares 0 invertible"),
        (invertible(OneMatrix(n, n)), "invertible, which is singular"),
        (invertible(MatAdd(A, MatMul(-1, A))), "invertible, which is singular"),
        (invertible(sympy.ImmutableMatrix([[1, 2], [2, 4]])), "invertible, which is singular"),
        ((Fact(MatMul(A, ones), OneMatrix(n, n), "rows"),), "fact 'rows' equates"),
        ((Fact(A, ones, "A is ones"),), "fact 'A is ones' equates"),
        ((Fact(A, MatMul(0.5, B), "half"),), "float"),
    ],
)
def test_a_malformed_fact_is_bad_input_that_names_it(facts, words):
    claim = proof(MatMul(A, Inverse(sympy.ZeroMatrix(n, n))) if "0 invertible" in words else MatMul(A, B),
                  MatMul(A, B), facts=facts)
    with pytest.raises(FactError, match=words) as raised:
        claim.verify("malformed")
    assert isinstance(raised.value, CircuitMathError) and "malformed" in str(raised.value)


def test_prove_exits_2_naming_a_malformed_fact(monkeypatch, capsys):
    """The CLI treats a malformed fact as bad input: exit 2 and one line naming it, no traceback."""
    import dataclasses

    import circuitmath as cm
    from circuitmath import _cli

    identity = cm.get_identity("fold_value_biases")
    broken = dataclasses.replace(identity.proof, facts=identity.proof.facts + invertible(sympy.ZeroMatrix(n, n)))
    monkeypatch.setitem(identity.__dict__, "proof", broken)
    assert _cli.main(["prove", "fold_value_biases"]) == 2
    err = capsys.readouterr().err
    assert "declares 0 invertible" in err and "Traceback" not in err
