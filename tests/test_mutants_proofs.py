"""A proof's report, pinned where mutation testing (``make mutate``) found it unpinned: a chain
whose steps each hold but that stops short of the claim fails for that reason alone, its steps
not listed as failed; and the records a report is made of cannot be changed afterwards."""

import dataclasses

import pytest
import sympy

from circuitmath._proof import Fact, Proof, Step

n = sympy.Symbol("n", integer=True, positive=True)
A, B, C = (sympy.MatrixSymbol(name, n, n) for name in "ABC")
DIMS = {n: 3}  # the sizes of the exact check on instances


def test_a_chain_of_true_steps_that_stops_short_fails_without_blaming_its_steps():
    """(A + B) C = A C + B C claimed as (A + B) C = A C + B C + C, by one true step: not proved,
    the reason says the chain does not end at the right side, and no step is listed as failed.
    Control: a false step is listed by its reason."""
    short = Proof(lhs=(A + B) * C, rhs=A * C + B * C + C, steps=(Step(A * C + B * C, "distribute"),),
                  explicit_dims=DIMS).verify("short")
    row = short.as_dict()
    assert not short.proved and row["status"] == "failed"
    assert any("does not end at the right side" in reason for reason in row["reasons"])
    assert row["failed_steps"] == []
    wrong = Proof(lhs=(A + B) * C, rhs=C * A + C * B, steps=(Step(C * A + C * B, "distribute on the wrong side"),),
                  explicit_dims=DIMS)
    assert wrong.verify("wrong").as_dict()["failed_steps"] == ["distribute on the wrong side"]


def test_a_step_a_fact_and_a_steps_report_cannot_be_changed():
    """A Step, a Fact and the report of a verified step are frozen: assigning a field raises."""
    fact = Fact.invertible(A, "A is invertible")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fact.text = "changed"
    step = Step(A * C + B * C, "distribute")
    report = Proof(lhs=(A + B) * C, rhs=A * C + B * C, steps=(step,), explicit_dims=DIMS).verify("distributive")
    assert report.proved
    for record, field in ((step, "reason"), (report.steps[0], "reason")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, field, "changed")


def test_diag_takes_a_vector_and_of_a_square_matrix_is_ill_typed():
    """shape_of diag(v) for a column and a row vector is square of its length; diag of an n x n
    matrix is refused as ill-typed, naming why."""
    from circuitmath._algebra import IllTyped, shape_of

    column, row = sympy.MatrixSymbol("v", n, 1), sympy.MatrixSymbol("r", 1, n)
    assert shape_of(sympy.DiagMatrix(column)) == (n, n) == shape_of(sympy.DiagMatrix(row))
    with pytest.raises(IllTyped, match="diag of a matrix that is not a vector"):
        shape_of(sympy.DiagMatrix(A))
