"""circuitmath.render on its own: what the book prints comes from the proof and the registry."""

import pytest

import circuitmath as cm
from circuitmath import render

NAMES = ["fold_layer_norm", "center_unembed", "fold_value_biases"]


@pytest.mark.parametrize("name", NAMES)
def test_statement_lists_the_claim_and_every_registered_precondition(name):
    identity = cm.get_identity(name)
    text = render.statement(identity)
    assert f"`{identity.name}`" in text and "**Preconditions**" in text
    for precondition in identity.preconditions:
        assert render.prose(getattr(precondition, "statement", precondition)) in text


@pytest.mark.parametrize("name", NAMES)
def test_derivation_has_one_block_per_step_and_twins_one_row_per_twin(name):
    identity = cm.get_identity(name)
    derivation = render.derivation(identity)
    assert all(step.reason in derivation for step in identity.proof.steps)
    report = identity.prove()
    table = render.twins(report, identity)
    assert all(f"| `{t.name}` |" in table for t in identity.proof.twins)
    assert "**NO**" not in table and "**NO**" not in render.steps(report)
    assert render.summary(report).startswith(f"{name}: proved")


def test_a_failed_step_is_marked():
    report = cm.get_identity("center_unembed").prove()
    broken = type(report)(**{**report.__dict__, "steps": (report.steps[0].__class__(**{**report.steps[0].__dict__, "holds": False}),)})
    assert "**NO**" in render.steps(broken)
