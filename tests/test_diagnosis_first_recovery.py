"""The residual rotation recovered through its identities' hooks, as every other symmetry is:
``recover`` (a :class:`~circuitmath._registry.SharedRotation`), ``with_parameters`` and
``recovered_first`` (how the diagnosis recognises it before the other recovered symmetries)."""

import pytest
import torch

import circuitmath as cm
from circuitmath._diagnosis import _replay, _uncertain
from circuitmath._identities._residual_fit import fixes_ones
from circuitmath._processing.rotation import procrustes, rotated_tensors
from circuitmath._registry import SharedRotation
from test_quantisation import _model, _pipeline

F64 = torch.float64
LN = dict(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=40, n_ctx=8, d_mlp=32, normalization_type="LN")


def _lnpre(dtype=F64):
    """A LayerNorm model folded and with centered writes (``LNPre``), in float64, and its config."""
    cfg = cm.Config(**LN)
    sd, cfg = cm.center_writing_weights(*cm.fold_layer_norm(cm.random_state_dict(cfg, seed=0, dtype=F64), cfg))
    return sd, cfg


def _rms_pre():
    cfg, sd = _model(F64)
    return cm.fold_rms_norm(sd, cfg)


@pytest.mark.parametrize("kind", ["RMSPre", "LNPre"])
def test_each_rotation_identity_recovers_q_and_rewrites_with_it(kind):
    """``recover`` finds the ``Q`` a model was rotated by and ``with_parameters`` reproduces the
    rotated model (recording the identity the rotation is on that model); in an ``LNPre`` model
    the ``Q`` the rewrite takes maps 1 to ±1 to rounding."""
    sd, cfg = _rms_pre() if kind == "RMSPre" else _lnpre()
    Q = cm.random_orthogonal(cfg.d_model, seed=2) if kind == "RMSPre" else -cm.orthogonal_fixing_ones(cfg.d_model, seed=2)
    after, after_cfg = cm.rotate_residual_stream(sd, cfg, Q)
    for identity in _replay.FIRST[0].performed(cfg), cm.get_identity("rotate_residual_stream"):
        fit = identity.recover(sd, after, cfg)
        assert isinstance(fit, SharedRotation) and fit.matrix.shape == (cfg.d_model, cfg.d_model)
        assert float((fit.exact - Q).abs().max()) < 1e-12
        out, out_cfg = identity.with_parameters(sd, cfg, fit)
        assert out_cfg.applied == after_cfg.applied
        assert max(float((out[n] - after[n]).abs().max()) for n in after) < 1e-12
    if kind == "LNPre":
        ones = torch.ones(cfg.d_model, dtype=F64)
        assert fixes_ones(fit.matrix) and float((fit.exact @ ones + ones).abs().max()) < 1e-14


def test_negative_control_no_rotation_is_recovered_between_models_of_other_tensors():
    """A tensor ``after`` has and the model has not (other than a norm's gain, which a later scale
    migration gives back) means no rotation of it: ``recover`` answers ``None``; a gain is allowed."""
    sd, cfg = _rms_pre()
    after, _cfg = cm.rotate_residual_stream(sd, cfg, cm.random_orthogonal(cfg.d_model, seed=2))
    identity = cm.get_identity("rotate_residual_stream")
    assert identity.recover(sd, dict(after, extra=torch.ones(3, dtype=F64)), cfg) is None
    assert identity.recover(sd, dict(after, **{"blocks.0.ln1.w": torch.ones(cfg.d_model, dtype=F64)}), cfg) is not None


def test_the_rotation_is_recognised_first_and_once():
    """Both rotation identities share one :class:`FirstRecovery`, which picks the identity by the
    model's norms; the other recovered symmetries come after it, and none of them is first."""
    first = cm.get_identity("rotate_residual_stream").recovered_first
    assert _replay.FIRST == (first,) and cm.get_identity("layer_norm_rotation").recovered_first is first
    assert _replay.RECOVERED and all(i.recovered_first is None and i.recover is not None for i in _replay.RECOVERED)
    rms, rms_cfg = _rms_pre()
    lnpre, lnpre_cfg = _lnpre()
    assert first.performed(rms_cfg).name == "rotate_residual_stream"
    assert first.performed(lnpre_cfg).name == "layer_norm_rotation"


def test_an_lnpre_model_rotated_by_a_q_that_moves_one_is_switched_to_rms_norm_first():
    """``first`` names the switch to RMSNorm where an ``LNPre`` model's rotation moves 1 (the
    SliceGPT route), and nothing where it fixes 1 or the model is ``RMSPre`` (the controls)."""
    first = cm.get_identity("rotate_residual_stream").recovered_first
    sd, cfg = _lnpre()
    moving = dict(sd) | rotated_tensors(sd, cfg, cm.random_orthogonal(cfg.d_model, seed=2))
    fixing = dict(sd) | rotated_tensors(sd, cfg, cm.orthogonal_fixing_ones(cfg.d_model, seed=2))
    assert first.first(sd, moving, cfg).name == "layer_norm_to_rms_norm"
    assert first.first(sd, fixing, cfg) is None
    rms, rms_cfg = _rms_pre()
    assert first.first(rms, dict(rms) | rotated_tensors(rms, rms_cfg, cm.random_orthogonal(32, seed=2)), rms_cfg) is None


def test_in_bfloat16_the_recovered_rotation_widens_by_its_refit_on_the_tensors_it_was_fitted_on():
    """The widening of a tensor rewritten with the recovered ``Q``: :data:`~_uncertain.SPREAD` times
    the columns of ``Q' - Q``, ``Q'`` re-fitted on the tensors ``Q`` was fitted on, to the rewrite
    rounded to bfloat16; a re-fit on every tensor (the control) gives another widening."""
    cfg, sd = _model(torch.bfloat16)
    after, _after_cfg = _pipeline(sd, cfg, smooth=False)
    folded, folded_cfg = cm.fold_rms_norm({k: v.float() for k, v in sd.items()}, cfg)
    identity = cm.get_identity("rotate_residual_stream")
    widenings = _uncertain.Widenings(torch.bfloat16)
    fit, widen = widenings.recovered(identity, folded, after, folded_cfg)
    assert fit.names is not None and len(fit.names) > 1
    out, _cfg = widen(lambda s, c: identity.with_parameters(s, c, fit))(folded, folded_cfg)
    (writer,), (reader,) = widenings.of(out["blocks.0.mlp.W_out"]), widenings.of(out["blocks.0.mlp.W_in"])
    assert (writer.axis, reader.axis) == (-1, -2)
    rewrite = _uncertain.rounded(dict(folded) | rotated_tensors(folded, folded_cfg, fit.matrix), torch.bfloat16)
    refit = procrustes(folded, rewrite, folded_cfg, fit.names)
    assert writer.coefficient == _uncertain.spread(fit.matrix, refit)
    assert torch.equal(writer.columns, _uncertain.column_spreads(fit.matrix, refit))
    everything = procrustes(folded, rewrite, folded_cfg)
    assert writer.coefficient != _uncertain.spread(fit.matrix, everything)
    float32 = _uncertain.Widenings(torch.float32)
    _fit, unchanged = float32.recovered(identity, folded, after, folded_cfg)
    out, _cfg = unchanged(lambda s, c: identity.with_parameters(s, c, fit))(folded, folded_cfg)
    assert float32.of(out["blocks.0.mlp.W_out"]) == []  # in float32 the recovery is exact to the certificate


# -- the replay's recovery is the identities' -------------------------------------------------

#: The replay's methods that recover a symmetry's parameter and apply it.
RECOVERING = ("transform_of", "wrong_rewrites", "symmetric", "_routes", "_first", "permuted")


def identities_named(source: str, methods=RECOVERING) -> dict[str, set[str]]:
    """For each of ``methods`` (functions anywhere in ``source``): the names it uses that the module
    imports from an identity family (``from .._identities.<family> import NAME``)."""
    import ast

    tree = ast.parse(source)
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("_identities.") for alias in node.names}
    return {node.name: {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in imported}
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in methods}


def test_the_replay_recovers_every_symmetry_through_its_identity_s_hooks():
    """No method of the replay that recovers a parameter names an identity: each reads the
    registry's hooks (``recover``, ``with_parameters``, ``recovered_first``, ``permutes``)."""
    from pathlib import Path

    found = identities_named(Path(_replay.__file__).read_text())
    assert set(found) == set(RECOVERING)
    assert found == {name: set() for name in RECOVERING}


def test_negative_control_a_method_naming_an_identity_is_found():
    source = ("from .._identities.rotation import ROTATION_INVARIANCE\n"
              "def transform_of(identity):\n    return identity is ROTATION_INVARIANCE\n"
              "def symmetric():\n    return None\n")
    assert identities_named(source, ("transform_of", "symmetric")) == {"transform_of": {"ROTATION_INVARIANCE"},
                                                                       "symmetric": set()}
