"""Attacks on what a proof may assume: a definition names a fresh symbol, everything else is a
fact, and every fact is an assumption the report, ``prove --json`` and the book show.

Each attack is a proof that, before definitions had to be fresh, verified a false reading of its
claim (``A B = B A`` with ``A := 0`` hidden in a definition); each must now be refused, and the
same proof with the equation stated as a :class:`Fact` is proved *with the assumption listed*.
"""

import json

import pytest
import sympy
from sympy import Identity as Eye, MatMul, MatrixSymbol, Rational, Symbol, ZeroMatrix

import circuitmath as cm
from circuitmath._kronecker import Apply, tensor
from circuitmath._proof import Definition, Fact, Nonzero, Proof, Step

n = Symbol("n", positive=True, integer=True)
A, B, C, M = (MatrixSymbol(s, n, n) for s in "ABCM")
X = MatrixSymbol("X", n, n)
DIMS = {n: 3}

#: The values of ``A`` that make ``A B = B A`` hold, which a definition used to slip in unseen.
HIDDEN = {
    "A := 0": ZeroMatrix(n, n),
    "A := B B": MatMul(B, B),
    "A := I": Eye(n),
}


def commute(**options) -> Proof:
    """``A B = B A`` in one step: false for matrices ``A``, ``B``, true for some values of ``A``."""
    return Proof(lhs=MatMul(A, B), rhs=MatMul(B, A), steps=(Step(MatMul(B, A), "claimed"),), explicit_dims=DIMS, **options)


@pytest.mark.parametrize("name", sorted(HIDDEN))
def test_a_definition_of_a_claim_symbol_is_refused(name):
    report = commute(definitions=(Definition(A, HIDDEN[name], name),)).verify()
    assert not report.proved and not report.concrete_check
    assert any("A already occurs in the claim" in r and "Fact" in r for r in report.reasons), report.reasons


@pytest.mark.parametrize("name", sorted(HIDDEN))
def test_the_same_equation_as_a_fact_is_proved_and_listed_as_an_assumption(name):
    report = commute(facts=(Fact(A, HIDDEN[name], name),)).verify()
    assert report.proved, report.reasons
    listed = report.as_dict()["assumptions"]
    assert [(a["kind"], a["text"]) for a in listed] == [("value", name)]
    assert listed[0]["latex"].startswith("A = ")


def test_without_the_assumption_the_claim_is_rejected():
    assert not commute().verify().proved  # the control: A B = B A is false


@pytest.mark.parametrize(
    "name, options, words",
    [
        ("a symbol used by an earlier definition, then defined",
         dict(definitions=(Definition(M, MatMul(C, B), "M"), Definition(C, ZeroMatrix(n, n), "C := 0"))),
         "C already occurs in definition 1"),
        ("a sampled symbol, then defined",
         dict(definitions=(Definition(C, Eye(n), "C := I"),), samplers={C: lambda rng, shape: sympy.eye(shape[0])}),
         "C already occurs in a sampler"),
        ("a dimension of the claim defined", dict(definitions=(Definition(n, sympy.Integer(1), "n := 1"),)),
         "n already occurs in the claim"),
        ("a scalar of the claim defined", dict(definitions=(Definition(Symbol("t"), sympy.Integer(0), "t := 0"),)),
         "t already occurs in the claim"),
        ("a fact and a definition of the same symbol",
         dict(definitions=(Definition(C, Eye(n), "C := I"),), facts=(Fact(C, ZeroMatrix(n, n), "C = 0"),)),
         "given a value 2 times"),
        ("two facts giving one symbol two values",
         dict(facts=(Fact(A, Eye(n), "A = I"), Fact(A, ZeroMatrix(n, n), "A = 0"))), "given a value 2 times"),
        ("a fact giving a sampled symbol a value",
         dict(facts=(Fact(A, Eye(n), "A = I"),), samplers={A: lambda rng, shape: sympy.zeros(*shape)}),
         "has a sampler and a fact"),
        ("circular facts", dict(facts=(Fact(A, C, "A = C"), Fact(C, A, "C = A"))), "circular"),
    ],
)
def test_what_is_not_a_fresh_definition_or_a_single_value_is_refused(name, options, words):
    """(Malformed facts, a float or sides of two shapes, are bad input: tests/test_proof_rules.py.)"""
    claim = Symbol("t") * MatMul(A, B) if "scalar" in name else MatMul(A, B)
    steps = (Step(MatMul(B, A), "claimed"),) if "scalar" not in name else (Step(MatMul(Symbol("t"), B, A), "claimed"),)
    rhs = steps[-1].expr
    report = Proof(lhs=claim, rhs=rhs, steps=steps, explicit_dims=DIMS, **options).verify()
    assert not report.proved
    assert any(words in r for r in report.reasons), report.reasons


def test_a_fresh_definition_is_an_abbreviation_not_an_assumption():
    """``M := A B`` names a fresh symbol: ``M = A B`` proves with no assumption."""
    proof = Proof(lhs=MatMul(A, B), rhs=MatMul(A, B), steps=(Step(MatMul(A, B), "nothing"),), explicit_dims=DIMS,
                  definitions=(Definition(M, MatMul(A, B), "M"),),
                  twins=())
    report = proof.verify()
    assert report.proved and report.as_dict()["assumptions"] == []


@pytest.mark.parametrize(
    "value, words",
    [(ZeroMatrix(n, n), "the notation's rule gives"), (MatMul(A, X, B), "the notation's rule gives")],
)
def test_a_notation_node_is_defined_by_its_rule_only(value, words):
    """``(A ⊗ B)·X`` may only be defined as ``A X B^T``: ``:= 0`` or ``:= A X B`` would prove
    anything about the operator."""
    applied = Apply(tensor(A, B), X)
    proof = Proof(lhs=applied, rhs=ZeroMatrix(n, n), steps=(Step(ZeroMatrix(n, n), "claimed"),), explicit_dims=DIMS,
                  definitions=(Definition(applied, value, "(A ⊗ B)·X"),))
    report = proof.verify()
    assert not report.proved and any(words in r for r in report.reasons), report.reasons
    right = Proof(lhs=applied, rhs=MatMul(A, X, B.T), steps=(Step(MatMul(A, X, B.T), "definition of ⊗"),),
                  explicit_dims=DIMS, definitions=(Definition(applied, applied.meaning(), "(A ⊗ B)·X"),))
    assert right.verify().proved  # the control: the rule itself is accepted


def test_notation_without_a_rule_of_its_own_must_be_a_fact():
    from circuitmath._identities.notation import Vec

    vec = Vec(X)
    value = MatrixSymbol("v", n * n, 1)
    proof = Proof(lhs=vec, rhs=value, steps=(Step(value, "claimed"),), explicit_dims=DIMS,
                  definitions=(Definition(vec, value, "vec(X) := v"),))
    report = proof.verify()
    assert not report.proved and any("no rule of its own" in r for r in report.reasons), report.reasons


def test_a_derived_nonzero_hypothesis_is_not_an_assumption_but_an_assumed_one_is():
    u = MatrixSymbol("u", n, 1)
    lam = Symbol("lambda")
    proof = Proof(
        lhs=MatMul(A, u), rhs=MatMul(lam, u), steps=(Step(MatMul(lam, u), "eigenvector"),), explicit_dims=DIMS,
        facts=(Fact(MatMul(A, u), MatMul(lam, u), "u is an eigenvector of A"),),
        nonzero=(Nonzero(lam, "lambda != 0"), Nonzero(u, "u != 0"), Nonzero(MatMul(A, u), "A u != 0", because=(Eye(n), MatMul(lam, u)))),
        samplers={A: lambda rng, shape: 2 * sympy.eye(shape[0]), lam: lambda rng, shape: Rational(2)},
        assumptions=("A is real",),
    )
    report = proof.verify()
    assert report.proved, report.reasons
    kinds = [(a["kind"], a["text"]) for a in report.as_dict()["assumptions"]]
    assert kinds == [("fact", "u is an eigenvector of A"), ("nonzero", "lambda != 0"), ("nonzero", "u != 0"),
                     ("stated", "A is real")]


def _expected_assumptions(proof: Proof) -> list[tuple[str, str]]:
    """Every assumption of ``proof`` as (text, LaTeX), from the proof object itself."""
    def own(p):
        return [*p.facts, *(h for h in p.nonzero if h.because is None)]

    items = own(proof) + [a for _name, lemma in proof.lemmas for a in own(lemma)]
    stated = list(proof.assumptions) + [a for _name, lemma in proof.lemmas for a in lemma.assumptions]
    return sorted({(a.text, a.latex()) for a in items} | {(s, "") for s in stated})


def test_prove_json_lists_every_assumption_of_every_registered_proof(capsys):
    from circuitmath import _cli

    assert _cli.main(["prove", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {i.name for i in cm.identities()}
    for identity in cm.identities():
        listed = sorted({(a["text"], a["latex"]) for a in rows[identity.name]["assumptions"]})
        assert listed == _expected_assumptions(identity.proof), identity.name
        for fact in identity.proof.facts:  # each fact appears, with its kind
            kind = "invertible" if fact.invertible_matrix is not None else "value" if fact.fixes is not None else "fact"
            assert {"kind": kind, "latex": fact.latex(), "text": fact.text} in rows[identity.name]["assumptions"]
    # the check can fail: a proof with its facts dropped lists fewer than its object holds
    stripped = [a for a in rows["fold_layer_norm"]["assumptions"] if a["kind"] != "value"]
    assert sorted({(a["text"], a["latex"]) for a in stripped}) != _expected_assumptions(cm.get_identity("fold_layer_norm").proof)


def test_every_registered_definition_names_a_fresh_symbol():
    for identity in cm.identities():
        proof = identity.proof
        for p in (proof, *(lemma for _name, lemma in proof.lemmas)):
            assert p._definition_errors() == [], identity.name
