"""circuitmath._proof on its own: a proof holds only when every step and the concrete check do,
and a twin counts as rejected only when it is wrong."""

from sympy import MatAdd, MatMul, MatrixSymbol, Symbol

from circuitmath import Proof
from circuitmath._proof import Step, Twin

d, m = Symbol("d", positive=True, integer=True), Symbol("m", positive=True, integer=True)
x, W = MatrixSymbol("x", 1, d), MatrixSymbol("W", d, m)
LHS, RHS = MatMul(x, MatAdd(W, W)), MatMul(2, x, W)
STEPS = (Step(MatAdd(MatMul(x, W), MatMul(x, W)), "distribute"), Step(RHS, "collect"))


def _proof(steps=STEPS, twins=(), rhs=RHS):
    return Proof(lhs=LHS, rhs=rhs, steps=steps, explicit_dims={d: 3, m: 2}, twins=twins)


def test_a_correct_proof_is_proved_with_symbolic_dimensions():
    report = _proof(twins=(Twin("drop_one", "forget one W", LHS, MatMul(x, W)),)).verify("double")
    assert report.proved and report.ok and report.symbolic_dims and report.concrete_check
    assert [s.holds for s in report.steps] == [True, True]
    twin = report.twins[0]
    assert twin.rejected and twin.counterexample_gap and twin.counterexample_gap > 0
    assert report.as_dict()["status"] == "proved" and report.as_dict()["twins_rejected"] == 1


def test_a_wrong_step_fails_the_proof():
    wrong = (Step(MatAdd(MatMul(x, W), MatMul(x, W), MatMul(x, W)), "distribute, badly"), Step(RHS, "collect"))
    report = _proof(steps=wrong).verify()
    assert not report.proved and not report.ok
    assert [s.holds for s in report.steps] == [False, False]


def test_a_false_claim_fails_the_concrete_check_even_without_steps_that_fail():
    three = MatMul(3, x, W)
    report = _proof(steps=(Step(three, "claimed"),), rhs=three).verify()
    assert not report.proved and not report.concrete_check


def test_a_twin_that_holds_is_not_rejected_and_the_report_is_not_ok():
    report = _proof(twins=(Twin("restated", "the claim itself", LHS, RHS),)).verify()
    assert report.proved and not report.twins[0].rejected and not report.ok
