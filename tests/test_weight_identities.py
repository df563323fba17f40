"""One contract, driven by the registry, for every weight identity (the circuits identities have
theirs in test_circuit_identities.py): on a model it applies to, its check holds; each of its
wrong rewrites that differs there is rejected by the same check; its transform is pure, keeps
the dtype, records itself and refuses a second application; and its checker recognises it."""

import pytest
import torch

import circuitmath as cm
from circuitmath import testing

F64 = torch.float64
BASE = dict(n_layers=2, d_model=6, n_heads=4, d_head=3, d_vocab=9, n_ctx=5, d_mlp=12)

#: Models to try, in order; each identity is checked on the first it applies to.
CANDIDATES = (
    {},
    {"n_key_value_heads": 2},
    {"normalization_type": "RMS", "gated_mlp": True},
    {"positional_embedding_type": "shortformer"},
    {"normalization_type": "LNPre", "eps": 0.0},
    {"eps": 0.0},
    {"embedding_scale": 6**0.5, "logit_scale": 0.0625},
    {"normalization_type": "RMS", "gated_mlp": True, "act_fn": "silu", "n_experts": 4, "experts_per_token": 2},
    {"positional_embedding_type": "rotary", "d_head": 6, "rotary_dim": 4, "rotary_interleaved": True},
)
WEIGHT_IDENTITIES = [i for i in cm.identities() if i.compare is None]


def _applying(identity):
    """``(cfg, state_dict, prepared, prepared_cfg, out, out_cfg)`` on the first candidate model the
    identity applies to, after its preparation."""
    for changes in CANDIDATES:
        cfg = cm.Config(**BASE).replace(**changes)
        state_dict = cm.random_state_dict(cfg, seed=0, dtype=F64)
        try:
            prepared, prepared_cfg = identity.prepare(state_dict, cfg) if identity.prepare else (state_dict, cfg)
            out, out_cfg = identity.transform(prepared, prepared_cfg)
        except cm.PreconditionError:
            continue
        return cfg, state_dict, prepared, prepared_cfg, out, out_cfg
    pytest.fail(f"{identity.name} applies to none of the candidate models")


@pytest.mark.parametrize("identity", WEIGHT_IDENTITIES, ids=[i.name for i in WEIGHT_IDENTITIES])
def test_the_check_holds_and_every_wrong_rewrite_is_rejected_where_it_differs(identity):
    cfg, state_dict, prepared, prepared_cfg, out, out_cfg = _applying(identity)
    assert identity.check(state_dict, cfg).passed
    rejected = 0
    for name, wrong in identity.wrong_rewrites_for(prepared_cfg).items():
        after, after_cfg = wrong(prepared, prepared_cfg)
        same = after_cfg == out_cfg and after.keys() == out.keys() and all(
            torch.allclose(after[k], out[k], rtol=1e-12, atol=1e-12) for k in out
        )
        if same:
            continue  # the exact rewrite up to rounding on this model (e.g. a grouped-query mistake without GQA)
        result = identity.check_wrong_rewrite(name, state_dict, cfg)
        assert not result.passed, f"{identity.name}.{name} passed: {result}"
        rejected += 1
    assert rejected, f"no wrong rewrite of {identity.name} differs on its model: the check cannot be seen to fail"


@pytest.mark.parametrize("identity", WEIGHT_IDENTITIES, ids=[i.name for i in WEIGHT_IDENTITIES])
def test_the_transform_is_pure_keeps_the_dtype_records_itself_and_runs_once(identity):
    cfg, state_dict, prepared, prepared_cfg, out, out_cfg = _applying(identity)
    copies = {k: v.clone() for k, v in prepared.items()}
    identity.transform(prepared, prepared_cfg)
    assert all(torch.equal(prepared[k], copies[k]) for k in copies), "the input was modified"
    assert {v.dtype for v in out.values()} == {F64}
    recorded = out_cfg.applied[len(prepared_cfg.applied):]
    assert recorded, f"{identity.name} records nothing in cfg.applied"
    if identity.name in COMPOSING:  # a second rotation or permutation is another one: allowed, exact
        again, again_cfg = identity.transform(out, out_cfg)
        assert again_cfg.applied[-1] == identity.name
    elif identity.name in recorded:  # a pipeline records its steps instead
        with pytest.raises(cm.PreconditionError):  # AlreadyAppliedError, or an earlier refusal
            identity.transform(out, out_cfg)


#: Symmetries whose transform composes with itself (two rotations are a rotation; two
#: permutations a permutation): applying them twice is exact and is not refused.
COMPOSING = {"layer_norm_rotation", "rms_norm_rotation", "rotate_residual_stream", "permute_heads", "permute_neurons",
             "permute_experts",
             "rotate_heads", "scale_neurons"}


#: Identities whose checker cannot recognise their exact rewrite (strict xfail: a gap that closes
#: fails the suite until it is taken off). Empty: checking rotate_residual_stream alone once reported
#: its preparation "not recognised"; the replay now keeps the exact route when a search through
#: wrong rewrites explains no more of the model.
CHECKER_GAPS: set[str] = set()


@pytest.mark.parametrize("identity", [
    pytest.param(i, marks=pytest.mark.xfail(strict=True, reason="the preparation is rewritten by the rotation"))
    if i.name in CHECKER_GAPS else i
    for i in WEIGHT_IDENTITIES if i.name in testing.CHECKERS
], ids=lambda i: i.name)
def test_the_checker_recognises_the_exact_rewrite(identity):
    cfg, state_dict, _prepared, _prepared_cfg, out, out_cfg = _applying(identity)
    report = testing.CHECKERS[identity.name](state_dict, out, cfg, after_cfg=out_cfg)
    assert report.ok, report
    assert any(f.name == identity.name and f.rewrite == "exact" for f in report.findings)
