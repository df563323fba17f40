"""The head identities under a QK-norm, proved: permuting the heads under OLMo-2's norm over the
whole projection (its gains moved with their heads), and turning each head's queries and keys by
an orthogonal R under a QK-norm, exact when each head's gain is one number and not otherwise.
Each lemma is proved for symbolic sizes and its twins are rejected; the parent proofs, ``prove``
and ``prove --json`` report them; the weights of an OLMo-2 model agree with each verdict."""

import dataclasses
import json

import pytest
import torch

import circuitmath as cm
from circuitmath import _cli
from circuitmath._proof import Twin
from circuitmath.circuits._bases import change_bases
from circuitmath.io import FAMILIES

LEMMAS = {  # identity: (lemma, its twins)
    "permute_heads": ("projection_qk_norm",
                      ["qk_norm_gains_not_permuted", "key_norm_gains_not_permuted", "keys_not_permuted"]),
    "rotate_heads": ("uniform_qk_norm_gains", ["gain_not_uniform", "key_gain_not_uniform"]),
}


def _lemma(identity: str):
    name, _twins = LEMMAS[identity]
    return dict(cm.get_identity(identity).proof.lemmas)[name]


@pytest.mark.parametrize("identity", sorted(LEMMAS))
def test_each_lemma_is_proved_for_symbolic_sizes_and_rejects_each_twin(identity):
    name, twins = LEMMAS[identity]
    report = _lemma(identity).verify(name)
    assert report.proved and report.concrete_check and report.symbolic_dims, report.reasons
    assert all(step.holds and step.instances_agree for step in report.steps)
    assert [t.name for t in report.twins] == twins
    for twin in report.twins:
        assert twin.rejected and twin.counterexample_gap > 0, twin.name
    assert report.ok
    assert any(a["kind"] == "stated" and "sum of squares" in a["text"] for a in report.assumptions)


@pytest.mark.parametrize("identity", sorted(LEMMAS))
def test_a_lemma_proves_nothing_with_its_conclusion_changed(identity):
    """Control: the lemma's claim replaced by its first twin's (a wrong rewrite) is not proved."""
    lemma = _lemma(identity)
    wrong = dataclasses.replace(lemma, lhs=lemma.twins[0].lhs, rhs=lemma.twins[0].rhs, twins=())
    assert not wrong.verify().proved


def test_the_rotation_needs_each_gain_to_be_one_number():
    """Control: without the facts that the gains are ``c I`` the rotated scores are not proved."""
    lemma = _lemma("rotate_heads")
    kept = tuple(f for f in lemma.facts if "gain" not in f.text)
    assert len(kept) == len(lemma.facts) - 4
    assert not dataclasses.replace(lemma, facts=kept).verify().proved


def test_the_identities_reports_carry_the_lemmas_and_fail_when_a_lemma_twin_is_accepted():
    for identity, (name, twins) in LEMMAS.items():
        report = cm.get_identity(identity).prove()
        assert report.ok
        lemma = next(r for r in report.lemmas if r.name == name)
        assert lemma.twins_rejected == len(twins) == len(lemma.twins)
        row = next(r for r in report.as_dict()["lemmas"] if r["name"] == name)
        assert row["status"] == "proved" and row["twins_rejected"] == row["twins_total"] == len(twins)
    proof = cm.get_identity("permute_heads").proof
    (name, lemma), = proof.lemmas
    true_twin = Twin("not_wrong", "the claim itself", lemma.lhs, lemma.rhs)
    broken = dataclasses.replace(proof, lemmas=((name, dataclasses.replace(lemma, twins=lemma.twins + (true_twin,))),))
    report = broken.verify("permute_heads")
    assert report.proved and not report.ok  # the claim holds, a lemma's twin was accepted
    assert report.as_dict()["status"] == "failed"
    assert report.as_dict()["accepted_twins"] == [f"{name}/not_wrong"]


def test_prove_shows_the_lemmas_with_their_twins(capsys):
    assert _cli.main(["prove", "permute_heads", "rotate_heads"]) == 0
    out = capsys.readouterr().out
    assert "lemma projection_qk_norm" in out and "lemma uniform_qk_norm_gains" in out and "2/2 proved" in out
    lines = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("  lemma")}
    assert lines["projection_qk_norm"][-2:] == ["3/3", "proved"]
    assert lines["uniform_qk_norm_gains"][-2:] == ["2/2", "proved"]
    assert _cli.main(["prove", "rotate_heads", "--json"]) == 0
    row, = json.loads(capsys.readouterr().out)
    assert row["lemmas"] == [{"name": "uniform_qk_norm_gains", "status": "proved", "symbolic_dims": True, "steps": 2,
                              "twins_rejected": 2, "twins_total": 2, "accepted_twins": [], "lemmas": []}]


# -- what the weights say -------------------------------------------------------------------

OLMO = next(f for f in FAMILIES if f.name == "OLMo-2").cfg
TOKENS = torch.tensor([[1, 5, 9, 2, 33, 7, 60, 4], [0, 12, 12, 40, 3, 8, 21, 63]])


def _change(after, before) -> float:
    return float((cm.log_probs(after, OLMO, TOKENS) - cm.log_probs(before, OLMO, TOKENS)).abs().max())


def _turns() -> torch.Tensor:
    """One rotation per key/value head, each turning every rotary pair within itself by angles of
    its own: ``[n_layers, kv_heads, d_head, d_head]``."""
    half, heads = OLMO.d_head // 2, OLMO.n_key_value_heads
    R = torch.zeros(OLMO.n_layers, heads, OLMO.d_head, OLMO.d_head, dtype=torch.float64)
    for g in range(heads):
        for i, angle in enumerate(torch.linspace(0.3 + g, 1.2 + 2 * g, half, dtype=torch.float64)):
            c, s = torch.cos(angle), torch.sin(angle)
            R[:, g, i, i], R[:, g, i, i + half], R[:, g, i + half, i], R[:, g, i + half, i + half] = c, s, -s, c
    return R


def _gains(sd, *, query_uniform: bool, key_uniform: bool):
    """``sd`` with each head's query (key) gains one number, different for each head, where asked."""
    out = dict(sd)
    for layer in range(OLMO.n_layers):
        for side, uniform in (("q", query_uniform), ("k", key_uniform)):
            name = f"blocks.{layer}.attn.{side}_norm.w"
            if uniform:
                numbers = 0.6 + 0.35 * torch.arange(sd[name].shape[0], dtype=torch.float64)
                out[name] = numbers[:, None].expand_as(sd[name]).clone()
    return out


def test_olmo2_heads_turn_exactly_when_each_gain_is_one_number_on_its_head():
    """The lemma's verdicts on an OLMo-2 model: queries and keys turned by a rotation per key/value
    head (commuting with the rotary embedding) keep the log-probs when every head's gains are one
    number (a different one per head, so the gain is not uniform over the projection), and change
    them when the gains differ within a head, on the keys' side alone too (the twins)."""
    assert OLMO.qk_norm and OLMO.qk_norm_over == "projection" and OLMO.positional_embedding_type == "rotary"
    sd = cm.random_state_dict(OLMO, seed=3, dtype=torch.float64)
    R = _turns()
    for query_uniform, key_uniform, exact in ((True, True, True), (False, False, False), (True, False, False)):
        before = _gains(sd, query_uniform=query_uniform, key_uniform=key_uniform)
        after = change_bases(before, OLMO, query=R, key=R)
        change = _change(after, before)
        assert (change < 1e-11) if exact else (change > 1e-3), (query_uniform, key_uniform, change)
    with pytest.raises(cm.PreconditionError, match="rotate_heads.*QK-norm"):
        cm.rotate_heads(_gains(sd, query_uniform=True, key_uniform=True), OLMO, query_key=R)


@pytest.mark.parametrize("kept", [("q_norm.w",), ("k_norm.w",), ("q_norm.w", "k_norm.w")])
def test_olmo2_head_permutation_needs_both_projections_gains_moved(kept):
    """The permutation's twins on the weights: moving the heads (whole groups) with their gains keeps
    the log-probs; putting back the query gains, the key gains or both changes them."""
    sd = cm.random_state_dict(OLMO, seed=4, dtype=torch.float64)
    permuted, _cfg = cm.permute_heads(sd, OLMO, torch.tensor([2, 3, 0, 1]))
    assert _change(permuted, sd) < 1e-11
    wrong = permuted | {name: sd[name] for name in sd if name.endswith(kept)}
    assert _change(wrong, sd) > 1e-3
