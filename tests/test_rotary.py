"""Partial and interleaved rotary embeddings: which rotations of the query/key space commute with
them, proved for symbolic sizes in both layouts, and what rotate_heads accepts and refuses,
checked against what each rotation does to the log-probs."""

import pytest
import torch

import circuitmath as cm
from circuitmath import testing
from circuitmath._identities.rotary import _commuting_proof, _mixing_the_rest, _other_layout, _query_key_rotation, _reflected_pair
from circuitmath.circuits._bases import change_bases

TOKENS = torch.tensor([[1, 4, 2, 7, 0, 3, 5, 6]])
ROTARY = cm.Config(n_layers=2, d_model=12, n_heads=4, d_head=6, d_vocab=11, n_ctx=8, d_mlp=16, n_key_value_heads=2,
                   normalization_type="RMS", gated_mlp=True, act_fn="silu", positional_embedding_type="rotary")
#: GPT-NeoX and GPT-J layouts, full and partial (rotary_dim 4 of d_head 6: two pairs and two dimensions left).
MODELS = {f"{'interleaved' if inter else 'neox'}, rotary_dim {rd}": ROTARY.replace(rotary_dim=rd, rotary_interleaved=inter)
          for inter in (False, True) for rd in (4, 6)}
WRONG = {"reflection_in_a_pair": _reflected_pair, "mixes_a_pair_with_the_rest": _mixing_the_rest,
         "pairs_of_the_other_layout": _other_layout}


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_the_commuting_rotations_are_proved_for_symbolic_sizes_in_each_layout_and_every_twin_is_rejected(layout):
    report = _commuting_proof(layout).verify(layout)
    assert report.proved and report.symbolic_dims and report.concrete_check
    assert len(report.instances) == 2 and all(len(i) == 2 for i in report.instances)  # h and r drawn at two sizes
    assert {t.name for t in report.twins if t.rejected} == {
        "mixes_a_pair_with_the_rest", "pairs_of_the_other_layout", "reflection_in_a_pair"}
    assert any(("GPT-NeoX" if layout == "neox" else "GPT-J") in a["text"] for a in report.as_dict()["assumptions"])


def test_the_registered_identity_proves_both_layouts():
    identity = cm.get_identity("rotate_rotary_pairs")
    assert identity.prove().ok
    assert dict(identity.proof.lemmas)["interleaved_pairs"].verify().ok


def _gap(sd, cfg, out, out_cfg):
    return float((cm.log_probs(sd, cfg, TOKENS) - cm.log_probs(out, out_cfg, TOKENS)).abs().max())


@pytest.mark.parametrize("model", MODELS)
def test_rotate_heads_accepts_exactly_the_rotations_that_keep_the_model(model):
    """A commuting rotation is accepted and keeps the log-probs; each wrong one that differs on
    the model is refused naming the rotary precondition, and would have changed the log-probs
    (the refusal is not a false alarm)."""
    cfg = MODELS[model]
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    R = _query_key_rotation(cfg)
    out, out_cfg = cm.rotate_heads(sd, cfg, query_key=R)
    assert _gap(sd, cfg, out, out_cfg) < 1e-12
    differing = cm.get_identity("rotate_rotary_pairs").wrong_rewrites_for(cfg)
    assert {"reflection_in_a_pair", "pairs_of_the_other_layout"} <= set(differing)
    assert ("mixes_a_pair_with_the_rest" in differing) == (cfg.rotary_dim < cfg.d_head)
    for name in differing:
        wrong = WRONG[name](R, cfg)
        with pytest.raises(cm.PreconditionError, match="rotate_heads: precondition 'the query/key rotation commutes"
                                                       " with the rotary embedding'"):
            cm.rotate_heads(sd, cfg, query_key=wrong)
        assert _gap(sd, cfg, change_bases(sd, cfg, query=wrong, key=wrong), cfg) > 1e-2, name


@pytest.mark.parametrize("model", MODELS)
def test_the_identity_checks_and_rejects_each_wrong_rotation(model):
    cfg = MODELS[model]
    sd = cm.random_state_dict(cfg, seed=1, dtype=torch.float64)
    identity = cm.get_identity("rotate_rotary_pairs")
    assert identity.check(sd, cfg).passed
    for name in identity.wrong_rewrites_for(cfg):
        assert not identity.check_wrong_rewrite(name, sd, cfg).passed, name


def test_a_model_without_rotary_is_refused_by_name():
    cfg = ROTARY.replace(positional_embedding_type="standard")
    with pytest.raises(cm.PreconditionError, match="rotate_rotary_pairs: precondition 'queries and keys are rotated"):
        cm.get_identity("rotate_rotary_pairs").transform(cm.random_state_dict(cfg, seed=0), cfg)


@pytest.mark.parametrize("model", ["neox, rotary_dim 4", "interleaved, rotary_dim 4"])
def test_the_checker_recovers_a_commuting_rotation_and_refuses_a_planted_wrong_one(model):
    cfg = MODELS[model]
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    R = _query_key_rotation(cfg)
    out, out_cfg = cm.rotate_heads(sd, cfg, query_key=R)
    assert testing.check_rotate_heads(sd, out, cfg, after_cfg=out_cfg).ok
    for name, change in WRONG.items():
        wrong = change(R, cfg)
        planted = change_bases(sd, cfg, query=wrong, key=wrong)
        report = testing.check_rotate_heads(sd, planted, cfg, after_cfg=out_cfg)
        assert not report.ok, name
        assert {c.name for c in report.culprits()} & {"blocks.0.attn.W_Q", "blocks.0.attn.W_K", "blocks.0.attn._W_K"}, \
            (name, report)


def _scaled_turns(cfg, pairs_of) -> torch.Tensor:
    """An invertible, not orthogonal, N ``[n_layers, kv_heads, d_head, d_head]``: each pair of
    ``pairs_of``'s layout scaled and turned within itself, the dimensions past rotary_dim mixed."""
    half = cfg.rotary_dim // 2
    N = torch.zeros(cfg.d_head, cfg.d_head, dtype=torch.float64)
    for i in range(half):
        first, second = (2 * i, 2 * i + 1) if pairs_of.rotary_interleaved else (i, i + half)
        a, b = 1.5 + i, 0.5 - i
        N[first, first], N[second, second], N[first, second], N[second, first] = a, a, b, -b
    rest = cfg.d_head - cfg.rotary_dim
    N[cfg.rotary_dim:, cfg.rotary_dim:] = torch.eye(rest, dtype=torch.float64) * 2 + torch.ones(rest, rest) * 0.5
    return N.expand(cfg.n_layers, cfg.n_key_value_heads, cfg.d_head, cfg.d_head).clone()


@pytest.mark.parametrize("model", [m for m in MODELS if "rotary_dim 4" in m])
def test_change_head_bases_takes_an_invertible_basis_that_commutes_with_the_rotary_embedding(model):
    """Scaled turns of each pair and any invertible map of the unrotated dimensions keep every
    score (the proof does not use orthogonality); the same built on the other layout's pairs is
    refused, and would have changed the model."""
    from circuitmath.circuits import change_head_bases

    cfg = MODELS[model]
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    N = _scaled_turns(cfg, cfg)
    assert _gap(sd, cfg, change_head_bases(sd, cfg, query_key=N), cfg) < 1e-12
    wrong = _scaled_turns(cfg, cfg.replace(rotary_interleaved=not cfg.rotary_interleaved))
    with pytest.raises(cm.PreconditionError, match="does not commute"):
        change_head_bases(sd, cfg, query_key=wrong)
    inverse = torch.linalg.inv(wrong).transpose(-1, -2)
    assert _gap(sd, cfg, change_bases(sd, cfg, query=wrong, key=inverse), cfg) > 1e-2


def test_the_pairs_of_each_layout():
    from circuitmath._processing._rotary import rotary_generator, rotary_pairs

    cfg = MODELS["neox, rotary_dim 4"]
    assert [t.tolist() for t in rotary_pairs(cfg, "cpu")] == [[0, 1], [2, 3]]
    interleaved = MODELS["interleaved, rotary_dim 4"]
    assert [t.tolist() for t in rotary_pairs(interleaved, "cpu")] == [[0, 2], [1, 3]]
    J = rotary_generator(interleaved)
    assert J[0, 1] == 1 and J[1, 0] == -1 and J[2, 3] == 2 and not J[4:].any() and not J[:, 4:].any()
