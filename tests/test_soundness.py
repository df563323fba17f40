"""The proof engine cannot be fooled: false and ill-typed claims, fed through ``Proof``/``Step``
exactly as the identities use them, are all rejected with a reason; true ones still prove.

Each claim is a one-step proof ``lhs = rhs`` (or a longer chain where the trick is in the
chain). "Rejected" means ``verify()`` reports it not proved and says why.
"""

import pytest
import sympy
from sympy import (
    DiagMatrix,
    Identity as Eye,
    Inverse,
    MatAdd,
    MatMul,
    MatPow,
    MatrixSymbol,
    OneMatrix,
    Pow,
    Rational,
    Symbol,
    Trace,
    Transpose,
    ZeroMatrix,
    sqrt,
)
from sympy.matrices.expressions.kronecker import KroneckerProduct

from circuitmath._algebra import IllTyped, normal_form
from circuitmath._identities._circuit_checks import notation_proof
from circuitmath._kronecker import Apply, expand_operator, tensor
from circuitmath._proof import Definition, Fact, Nonzero, Proof, Step

n, k, m = (Symbol(s, positive=True, integer=True) for s in "nkm")
DIMS = {n: 3, k: 2, m: 4}
A, B, C, D = (MatrixSymbol(s, n, n) for s in "ABCD")
W = MatrixSymbol("W", n, k)  # a non-square matrix
X = MatrixSymbol("X", m, n)
E = MatrixSymbol("E", n, n)
u = MatrixSymbol("u", n, 1)
x = MatrixSymbol("x", 1, n)
ones = OneMatrix(n, 1)
a = Symbol("a", real=True)  # may be negative
t = Symbol("t", negative=True)
q, eps, s = Symbol("q", positive=True), Symbol("eps", positive=True), Symbol("s", positive=True)
lam = Symbol("lambda")
CENTERING = MatAdd(Eye(n), MatMul(-1 / n, ones, ones.T))


def claim(lhs, rhs, *, steps=None, **options) -> Proof:
    options.setdefault("explicit_dims", DIMS)
    return Proof(lhs=lhs, rhs=rhs, steps=steps or (Step(rhs, "claimed"),), **options)


def _positive_rows(rng, shape):
    return sympy.Matrix(*shape, lambda i, j: rng.randint(1, 5))


def _masked_first_row(rng, shape):
    return sympy.Matrix(*shape, lambda i, j: 0 if i == 0 else rng.randint(1, 5))


def _unit_triangular(rng, shape):
    return sympy.Matrix(*shape, lambda i, j: 1 if i == j else (rng.randint(-3, 3) if i > j else 0))


def _pattern_with_empty_row(rng, shape):
    return sympy.Matrix(*shape, lambda i, j: 0 if i == 0 else Rational(1, shape[1]))


softmax = MatMul(Inverse(DiagMatrix(MatMul(E, ones))), E)  # rows of E normalised
P = MatrixSymbol("P", n, n)
SOFTMAX = dict(
    facts=(Fact(P, softmax, "softmax rows"), Fact.invertible(DiagMatrix(MatMul(E, ones)), "row sums of E are positive")),
    samplers={E: _positive_rows},
)


def _kron_claim(lhs_op, rhs_op):
    Y = MatrixSymbol("Y", n, n)
    lhs, rhs = Apply(lhs_op, Y), Apply(rhs_op, Y)
    return notation_proof(lhs=lhs, rhs=rhs, steps=(Step(rhs, "claimed"),), explicit_dims=DIMS)


FALSE_CLAIMS = {
    # non-commutativity
    "AB = BA": lambda: claim(MatMul(A, B), MatMul(B, A)),
    "(A+B)^2 = A^2 + 2AB + B^2": lambda: claim(
        MatPow(MatAdd(A, B), 2), MatAdd(MatPow(A, 2), MatMul(2, A, B), MatPow(B, 2))
    ),
    "ABC = CBA": lambda: claim(MatMul(A, B, C), MatMul(C, B, A)),
    "diag(u) A = A diag(u)": lambda: claim(MatMul(DiagMatrix(u), A), MatMul(A, DiagMatrix(u))),
    # transpose order
    "(AB)^T = A^T B^T": lambda: claim(Transpose(MatMul(A, B)), MatMul(Transpose(A), Transpose(B))),
    "(A+B)^T = A + B": lambda: claim(Transpose(MatAdd(A, B)), MatAdd(A, B)),
    "(XW)^T = X^T W^T (ill-typed)": lambda: claim(Transpose(MatMul(X, W)), MatMul(Transpose(X), Transpose(W))),
    # Kronecker sums and products
    "A⊗B + C⊗D = (A+C)⊗(B+D)": lambda: _kron_claim(
        MatAdd(tensor(A, B), tensor(C, D)), tensor(MatAdd(A, C), MatAdd(B, D))
    ),
    "(A⊗B)(C⊗D) = CA⊗BD": lambda: _kron_claim(MatMul(tensor(A, B), tensor(C, D)), tensor(MatMul(C, A), MatMul(B, D))),
    "(A⊗B)^T = A⊗B": lambda: _kron_claim(Transpose(tensor(A, B)), tensor(A, B)),
    "(A⊗B) = (B⊗A)": lambda: _kron_claim(tensor(A, B), tensor(B, A)),
    "sympy's combine on a transposed sum": lambda: _kron_claim(
        MatMul(Transpose(MatAdd(tensor(A, B), tensor(C, D))), tensor(A, D)),
        tensor(MatMul(MatAdd(Transpose(A), Transpose(C)), A), MatMul(MatAdd(Transpose(B), Transpose(D)), D)),
    ),
    # inverses
    "(A+B)^-1 = A^-1 + B^-1": lambda: claim(
        Inverse(MatAdd(A, B)), MatAdd(Inverse(A), Inverse(B)),
        facts=tuple(Fact.invertible(M, "invertible") for M in (A, B, MatAdd(A, B))),
    ),
    "(AB)^-1 = A^-1 B^-1": lambda: claim(
        Inverse(MatMul(A, B)), MatMul(Inverse(A), Inverse(B)),
        facts=tuple(Fact.invertible(M, "invertible") for M in (A, B, MatMul(A, B))),
    ),
    "X W W^-1 = X, W not square": lambda: claim(MatMul(X, W, Inverse(W)), X, facts=(Fact.invertible(W, "W"),)),
    "1 1^-1 = I (n x n ones, undeclared)": lambda: claim(MatMul(OneMatrix(n, n), Inverse(OneMatrix(n, n))), Eye(n)),
    "A A^-1 = I, A never declared invertible": lambda: claim(MatMul(A, Inverse(A)), Eye(n)),
    "A^-1 B A = B": lambda: claim(MatMul(Inverse(A), B, A), B, facts=(Fact.invertible(A, "A"),)),
    "(A^T)^-1 A = I": lambda: claim(MatMul(Inverse(Transpose(A)), A), Eye(n), facts=(Fact.invertible(A, "A"),)),
    "declared invertible but sampled singular": lambda: claim(
        MatMul(A, Inverse(A)), Eye(n), facts=(Fact.invertible(A, "A"),), samplers={A: lambda rng, shape: sympy.zeros(*shape)}
    ),
    # wrong axes
    "center over the wrong axis": lambda: claim(
        MatMul(x, CENTERING, MatAdd(W, MatMul(-1 / k, W, OneMatrix(k, 1), OneMatrix(1, k)))), MatMul(x, CENTERING, W)
    ),
    "softmax columns sum to 1": lambda: claim(MatMul(ones.T, P), ones.T, **SOFTMAX),
    "A^T 1 = 1 for a softmax A": lambda: claim(MatMul(Transpose(P), ones), ones, **SOFTMAX),
    "1^T diag(u) = u (a row is not a column)": lambda: claim(MatMul(ones.T, DiagMatrix(u)), u),
    # centering signs
    "C 1 = 0 with C = I + 1 1^T / n": lambda: claim(MatMul(MatAdd(Eye(n), MatMul(1 / n, ones, ones.T)), ones), ZeroMatrix(n, 1)),
    "C C = C with 1/sqrt(n) once": lambda: claim(
        MatMul(MatAdd(Eye(n), MatMul(-1 / sqrt(n), ones, ones.T)), MatAdd(Eye(n), MatMul(-1 / sqrt(n), ones, ones.T))),
        MatAdd(Eye(n), MatMul(-1 / sqrt(n), ones, ones.T)),
    ),
    "x C = x": lambda: claim(MatMul(x, CENTERING), x),
    "C 1 = 1": lambda: claim(MatMul(CENTERING, ones), ones),
    # trace misuse
    "tr(ABC) = tr(ACB)": lambda: claim(MatMul(Trace(MatMul(A, B, C)), D), MatMul(Trace(MatMul(A, C, B)), D)),
    "tr(AB) = tr(A) tr(B)": lambda: claim(MatMul(Trace(MatMul(A, B)), D), MatMul(Trace(A), Trace(B), D)),
    "tr(A) I = A": lambda: claim(MatMul(Trace(A), Eye(n)), A),
    # masked softmax rows
    "a fully masked row still sums to 1": lambda: claim(
        MatMul(MatrixSymbol("Q", n, n), ones), ones, samplers={MatrixSymbol("Q", n, n): _pattern_with_empty_row}
    ),
    "softmax without declaring the row sums invertible": lambda: claim(
        MatMul(softmax, ones), ones, samplers={E: _positive_rows}
    ),
    "softmax of a fully masked row": lambda: claim(
        MatMul(softmax, ones), ones, facts=SOFTMAX["facts"][1:], samplers={E: _masked_first_row}
    ),
    # square roots and eps
    "sqrt(a^2) = a for real a": lambda: claim(MatMul(sqrt(a**2), x), MatMul(a, x)),
    "sqrt(t^2) = t for t < 0": lambda: claim(MatMul(sqrt(t**2), x), MatMul(t, x)),
    "scale invariance with eps": lambda: claim(
        MatMul(Pow(s**2 * q / n + eps, Rational(-1, 2)), s, x), MatMul(Pow(q / n + eps, Rational(-1, 2)), x)
    ),
    "dropped eps": lambda: claim(MatMul(Pow(q / n + eps, Rational(-1, 2)), x), MatMul(Pow(q / n, Rational(-1, 2)), x)),
    "eps outside the root": lambda: claim(
        MatMul(Pow(q / n + eps, Rational(-1, 2)), x), MatMul(Pow(sqrt(q / n) + eps, -1), x)
    ),
    # ill-typed identities
    "I_n = I_m": lambda: claim(Eye(n), Eye(m)),
    "1_n^T 1_n = n I_n": lambda: claim(MatMul(ones.T, ones), MatMul(n, Eye(n))),
    "1_n^T 1_m = n": lambda: claim(MatMul(ones.T, OneMatrix(m, 1)), MatMul(n, OneMatrix(1, 1))),
    "a matrix equals a scalar": lambda: claim(MatMul(ones.T, ones), n),
    "A + W (n x n plus n x k)": lambda: claim(MatAdd(A, MatMul(W, Transpose(W))), MatAdd(W, A)),
    "diag of a square matrix": lambda: claim(MatMul(DiagMatrix(A), ones), MatMul(A, ones)),
    "power of a non-square matrix": lambda: claim(MatPow(W, 2), MatMul(W, W)),
    "ill-typed middle step, typed ends": lambda: claim(
        MatMul(A, B), MatMul(A, B), steps=(Step(MatMul(A, W), "a detour"), Step(MatMul(A, B), "back"))
    ),
    "a fact of two shapes": lambda: claim(MatMul(A, ones), ones, facts=(Fact(MatMul(A, ones), OneMatrix(m, 1), "bad"),)),
    # floats
    "A + 1e-50 A = A": lambda: claim(MatAdd(A, MatMul(1e-50, A)), A),
    "0.5 A + 0.5 A = A (true, but floats)": lambda: claim(MatAdd(MatMul(0.5, A), MatMul(0.5, A)), A),
    "a float in a definition": lambda: claim(
        MatrixSymbol("H", n, n), MatMul(Rational(1, 2), A),
        definitions=(Definition(MatrixSymbol("H", n, n), MatMul(0.5, A), "half"),),
    ),
    "a float from a sampler": lambda: claim(
        MatMul(2, A), MatAdd(A, A), samplers={A: lambda rng, shape: sympy.Matrix(*shape, lambda i, j: 0.5)}
    ),
    # definitions
    "circular definitions A := B, B := A": lambda: claim(
        MatMul(A, B), MatMul(B, A), definitions=(Definition(A, B, "a"), Definition(B, A, "b"))
    ),
    "self-referential definition": lambda: claim(A, B, definitions=(Definition(A, MatAdd(A, B, MatMul(-1, A)), "a"),)),
    "an expression as a definition's key": lambda: claim(
        MatMul(A, B), MatMul(B, A), definitions=(Definition(MatMul(A, B), MatMul(B, A), "AB := BA"),)
    ),
    "redefine a statement symbol as another": lambda: claim(MatMul(A, B), MatMul(B, A), definitions=(Definition(A, B, "A := B"),)),
    "definition of another shape": lambda: claim(
        MatMul(A, ones), MatMul(A, ones), definitions=(Definition(A, MatMul(W, OneMatrix(k, 1)), "n x n := n x 1"),)
    ),
    "a symbol defined twice": lambda: claim(
        A, B, definitions=(Definition(A, B, "one"), Definition(A, C, "two")),
    ),
    # chains
    "a wrong step hidden in a chain that closes": lambda: claim(
        MatMul(A, B), MatMul(A, B), steps=(Step(MatMul(B, A), "commute"), Step(MatMul(A, B), "commute back"))
    ),
    "a chain that stops short": lambda: claim(MatMul(A, B), MatMul(B, A), steps=(Step(MatMul(A, B), "nothing"),)),
    "a bare dimension symbol as a coefficient": lambda: claim(MatMul(n, A), A),
    "n 1_n = 1_n^T 1_m 1_n (sizes differ)": lambda: claim(MatMul(n, ones), MatMul(ones, OneMatrix(1, m), OneMatrix(m, 1))),
    # nonzero hypotheses
    "a nonzero claim derived from a false equation": lambda: claim(
        MatMul(A, u), MatMul(A, u),
        nonzero=(Nonzero(u, "u != 0"), Nonzero(MatMul(A, u), "A u != 0", because=(B, u))),
    ),
    "an eigenvalue that is 0 on the sample": lambda: claim(
        MatMul(lam, u), MatMul(lam, u), nonzero=(Nonzero(lam, "lambda != 0"),), samplers={lam: lambda rng, shape: 0}
    ),
}


def _rejection(build) -> str:
    """Why the claim built by ``build`` is rejected ('' if it is proved)."""
    try:
        report = build().verify()
    except (IllTyped, ValueError) as error:  # refused while the proof is built or checked
        return f"{type(error).__name__}: {error}"
    return "" if report.proved else "; ".join(report.reasons)


@pytest.mark.parametrize("name", sorted(FALSE_CLAIMS))
def test_false_or_ill_typed_claim_is_rejected_with_a_reason(name):
    reason = _rejection(FALSE_CLAIMS[name])
    assert reason, f"{name} was proved"


def test_the_suite_is_large_enough():
    assert len(FALSE_CLAIMS) >= 40


@pytest.mark.parametrize(
    "name, build, words",
    [
        ("ill-typed step names the step", FALSE_CLAIMS["ill-typed middle step, typed ends"], "step 1"),
        ("floats are refused", FALSE_CLAIMS["A + 1e-50 A = A"], "float"),
        ("undeclared inverse", FALSE_CLAIMS["A A^-1 = I, A never declared invertible"], "declares invertible"),
        ("non-square inverse", FALSE_CLAIMS["X W W^-1 = X, W not square"], "not square"),
        ("circularity", FALSE_CLAIMS["circular definitions A := B, B := A"], "circular"),
        ("key is an expression", FALSE_CLAIMS["an expression as a definition's key"], "not a fresh symbol"),
        ("identity sizes", FALSE_CLAIMS["I_n = I_m"], "claim"),
    ],
)
def test_reasons_say_what_is_wrong(name, build, words):
    assert words in _rejection(build)


# -- positive controls: the same machinery proves what is true -------------------------------

TRUE_CLAIMS = {
    "A(B + C) = AB + AC": lambda: claim(MatMul(A, MatAdd(B, C)), MatAdd(MatMul(A, B), MatMul(A, C))),
    "(XW)^T = W^T X^T": lambda: claim(Transpose(MatMul(X, W)), MatMul(Transpose(W), Transpose(X))),
    "declared inverse cancels": lambda: claim(
        MatMul(X, A, B, Inverse(B), Inverse(A)), X, facts=(Fact.invertible(A, "A"), Fact.invertible(B, "B")),
        samplers={A: _unit_triangular, B: _unit_triangular},
    ),
    "softmax rows sum to 1": lambda: claim(MatMul(P, ones), ones, **SOFTMAX),
    "C 1 = 0": lambda: claim(MatMul(CENTERING, ones), ZeroMatrix(n, 1)),
    "sqrt(s^2) = s for s > 0": lambda: claim(MatMul(sqrt(s**2), x), MatMul(s, x)),
    "mixed product": lambda: _kron_claim(MatMul(tensor(A, B), tensor(C, D)), tensor(MatMul(A, C), MatMul(B, D))),
    "expand_operator on a transposed sum": lambda: _kron_claim(
        MatMul(Transpose(MatAdd(tensor(A, B), tensor(C, D))), tensor(A, D)),
        expand_operator(MatMul(Transpose(MatAdd(tensor(A, B), tensor(C, D))), tensor(A, D))),
    ),
    "a derived nonzero": lambda: claim(
        MatMul(A, B, u), MatMul(lam, u),
        steps=(Step(MatMul(lam, u), "A B u = lambda u"),),
        facts=(Fact(MatMul(A, B, u), MatMul(lam, u), "eigenvector"),),
        nonzero=(Nonzero(lam, "l"), Nonzero(u, "u"), Nonzero(MatMul(B, u), "B u", because=(A, MatMul(lam, u)))),
        samplers={A: lambda rng, shape: sympy.eye(shape[0]), B: lambda rng, shape: 2 * sympy.eye(shape[0]),
                  lam: lambda rng, shape: 2},
    ),
}


@pytest.mark.parametrize("name", sorted(TRUE_CLAIMS))
def test_true_claim_is_proved(name):
    report = TRUE_CLAIMS[name]().verify()
    assert report.proved, report.reasons
    assert len(report.instances) >= 2


def test_second_check_uses_distinct_non_square_sizes():
    report = TRUE_CLAIMS["(XW)^T = W^T X^T"]().verify()
    first, second = report.instances
    assert len(set(first.values())) == len(first) and len(set(second.values())) == len(second)
    assert all(first[d] != second[d] for d in first)


def test_diag_rule_holds_entrywise_for_symbolic_size():
    """``diag(r) 1 = r``, the rule behind ``A 1 = 1`` for a softmax ``A``, proved entry by entry
    with sympy's ``Sum`` over a symbolic ``n`` (only the in-range branch can occur)."""
    i = Symbol("i", integer=True)
    r = MatrixSymbol("r", n, 1)
    entry = sympy.simplify((MatMul(DiagMatrix(r), ones) - r)[i, 0].doit())
    pieces = entry.args if isinstance(entry, sympy.Piecewise) else ((entry, True),)
    in_range = [value for value, condition in pieces if condition != True]  # noqa: E712
    assert in_range and all(sympy.simplify(v) == 0 for v in in_range)


def test_expand_operator_never_returns_a_combined_sum():
    op = MatMul(Transpose(MatAdd(tensor(A, B), tensor(C, D))), tensor(A, D))
    expanded = expand_operator(op)
    assert isinstance(expanded, MatAdd) and len(expanded.args) == 2
    assert all(isinstance(term, KroneckerProduct) for term in expanded.args)


def test_normal_form_refuses_undeclared_inverses_directly():
    with pytest.raises(IllTyped, match="declares invertible"):
        normal_form(MatMul(A, Inverse(A)))
