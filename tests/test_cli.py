"""``python -m circuitmath prove``."""

import json
import subprocess
import sys

import pytest

import circuitmath as cm
from circuitmath import _cli
from circuitmath._proof import Twin

KEYS = {"name", "status", "symbolic_dims", "steps", "seconds", "twins_rejected", "twins_total"}


def test_prove_json_lists_every_identity_as_proved():
    out = subprocess.run([sys.executable, "-m", "circuitmath", "prove", "--json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    assert [r["name"] for r in rows] == [i.name for i in cm.identities()]
    for row in rows:
        assert KEYS <= row.keys()
        assert row["status"] == "proved" and row["twins_rejected"] == row["twins_total"] >= 1
        assert isinstance(row["seconds"], float) and isinstance(row["steps"], int) and row["steps"] >= 1
    assert {r["name"]: r["symbolic_dims"] for r in rows}["fold_layer_norm"] is True


def test_prove_table_names_and_filters(capsys):
    assert _cli.main(["prove", "fold_layer_norm"]) == 0
    out = capsys.readouterr().out
    assert "fold_layer_norm" in out and "center_reading_weights" not in out and "5/5" in out


def test_unknown_identity_exits_2(capsys):
    assert _cli.main(["prove", "no_such_identity"]) == 2
    assert "no identity named" in capsys.readouterr().err


def test_an_accepted_twin_makes_prove_exit_1(monkeypatch, capsys):
    """A proof whose 'wrong' variant is actually true must fail the run."""
    identity = cm.get_identity("fold_layer_norm")
    proof = identity.proof
    true_twin = Twin("not_wrong", "a restatement of the claim itself", proof.lhs, proof.rhs)
    broken = type(proof)(**{**proof.__dict__, "twins": proof.twins + (true_twin,)})
    monkeypatch.setitem(identity.__dict__, "proof", broken)
    assert _cli.main(["prove", "fold_layer_norm", "--json"]) == 1
    row = json.loads(capsys.readouterr().out)[0]
    assert row["status"] == "failed" and row["accepted_twins"] == ["not_wrong"]
