"""Quantisation pipelines' rewrites: scale migration across a norm (SmoothQuant) and rotations
inside the heads, their transforms, their recovery by the diagnosis, the issue's two cases (a
migration computed in bfloat16; rotations with W_E centered behind RMSNorm) and a whole pipeline."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import circuitmath as cm
from circuitmath import testing
from circuitmath._processing.quantisation import nearest_commuting
from circuitmath.testing import NotEquivalentError, assert_equivalent, check_migrate_norm_scales, diagnose

F64 = torch.float64
LLAMA = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=50, n_ctx=8, d_mlp=64, normalization_type="RMS",
             gated_mlp=True, act_fn="silu", positional_embedding_type="rotary")


def _model(dtype=F64, seed=0, **changes):
    cfg = cm.Config(**LLAMA).replace(**changes)
    return cfg, {k: v.to(dtype) for k, v in cm.random_state_dict(cfg, seed=seed, dtype=F64).items()}


def _scales(cfg, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return {f"blocks.{l}.{ln}": torch.exp(torch.randn(cfg.d_model, generator=generator, dtype=F64))
            for l in range(cfg.n_layers) for ln in ("ln1", "ln2")}


def _smoothquant_elsewhere(sd, cfg, scales, dtype, spoil=None):
    """A migration as another library computes it: in the model's dtype, the scales rounded to it
    (``s.to(dtype)``) or kept in float32 and the products rounded once; ``spoil`` names a reader
    left unscaled."""
    after = dict(sd)
    for norm, pairs in cm._processing.readers(cfg):
        if norm not in scales:
            continue
        s = scales[norm].to(dtype)
        after[f"{norm}.w"] = (sd[f"{norm}.w"] / s).to(dtype)
        for weight, _bias in pairs:
            if weight != spoil:
                after[weight] = (sd[weight] * s[:, None]).to(dtype)
    return after


# -- the transform ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["RMS", "LN", "RMSPre", "LNPre"])
def test_the_migration_keeps_the_function_and_moves_s_into_the_readers(kind):
    cfg, sd = _model(normalization_type=kind, n_key_value_heads=2, act_fn="relu" if kind.startswith("LN") else "silu")
    scales = _scales(cfg)
    copies = {k: v.clone() for k, v in sd.items()}
    out, out_cfg = cm.migrate_norm_scales(sd, cfg, scales)
    assert all(torch.equal(sd[k], copies[k]) for k in sd), "the input was modified"
    assert out_cfg.applied == ("migrate_norm_scales",) and out_cfg.normalization_type == kind.removesuffix("Pre")
    assert_equivalent(sd, out, cfg, after_cfg=out_cfg)
    s = scales["blocks.1.ln1"]
    gain = sd.get("blocks.1.ln1.w", torch.ones(cfg.d_model, dtype=F64))
    assert torch.allclose(out["blocks.1.ln1.w"] * s, gain, rtol=1e-15, atol=0)
    assert torch.allclose(out["blocks.1.attn._W_K"], s[:, None] * sd["blocks.1.attn._W_K"], rtol=1e-15, atol=0)
    assert out["ln_final.w"].equal(sd.get("ln_final.w", torch.ones(cfg.d_model, dtype=F64)))  # ln_final left alone
    assert out["unembed.W_U"] is sd["unembed.W_U"]


def test_a_slightly_wrong_scale_is_refused_by_the_check():
    """The tolerance pin: one channel's reader rows off by a relative 1e-4 (float64) fail."""
    cfg, sd = _model()
    scales = _scales(cfg)
    out, out_cfg = cm.migrate_norm_scales(sd, cfg, scales)
    assert_equivalent(sd, out, cfg, after_cfg=out_cfg)
    spoiled = dict(out)
    spoiled["blocks.0.mlp.W_in"] = out["blocks.0.mlp.W_in"].clone()
    spoiled["blocks.0.mlp.W_in"][3] *= 1 + 1e-4
    with pytest.raises(NotEquivalentError):
        assert_equivalent(sd, spoiled, cfg, after_cfg=out_cfg)


def test_dtype_and_device_are_kept_and_half_precision_is_rounded_once():
    cfg, sd = _model(torch.bfloat16)
    scales = _scales(cfg)
    out, _ = cm.migrate_norm_scales(sd, cfg, scales)
    exact, _ = cm.migrate_norm_scales({k: v.double() for k, v in sd.items()}, cfg, scales)
    assert all(v.dtype == torch.bfloat16 and v.device == sd["embed.W_E"].device for v in out.values())
    assert all(torch.equal(out[k], exact[k].to(torch.bfloat16)) for k in out)


def test_a_second_application_and_models_it_cannot_rewrite_are_refused():
    cfg, sd = _model()
    out, out_cfg = cm.migrate_norm_scales(sd, cfg, _scales(cfg))
    with pytest.raises(cm.AlreadyAppliedError):
        cm.migrate_norm_scales(out, out_cfg, _scales(cfg))
    cases = [
        (dict(normalization_type=None), "every reader sits behind a norm whose gain can take 1/s"),
        (dict(norm_position="post", normalization_type="LN", positional_embedding_type="standard", act_fn="gelu",
              gated_mlp=False), "pre-norm"),
        (dict(normalization_type="LN", positional_embedding_type="shortformer"), "norm output read only by linear maps"),
    ]
    for changes, precondition in cases:
        other, other_sd = _model(**changes)
        with pytest.raises(cm.PreconditionError) as caught:
            cm.migrate_norm_scales(other_sd, other, torch.ones(other.d_model, dtype=F64))
        assert caught.value.identity == "migrate_norm_scales" and caught.value.precondition == precondition


@pytest.mark.parametrize("scales, found", [
    ({"blocks.0.ln1": torch.zeros(32, dtype=F64)}, "zero, NaN or infinite"),
    ({"blocks.0.ln1": torch.full((32,), float("nan"), dtype=F64)}, "zero, NaN or infinite"),
    ({"blocks.0.ln1": torch.ones(31, dtype=F64)}, "shape [31], expected [32]"),
    ({"blocks.9.ln1": torch.ones(32, dtype=F64)}, "are no norms of this model"),
    ({"blocks.0.ln1": torch.ones(32, dtype=torch.long)}, "not a floating tensor"),
    ({}, "non-empty mapping"),
])
def test_bad_scales_are_refused_naming_the_norm(scales, found):
    cfg, sd = _model()
    with pytest.raises(cm.PreconditionError, match="a finite nonzero scale per channel") as caught:
        cm.migrate_norm_scales(sd, cfg, scales)
    assert found in str(caught.value)


def test_the_scales_are_recovered_from_the_tensors():
    cfg, sd = _model(n_key_value_heads=2)
    scales = _scales(cfg)
    out, _ = cm.migrate_norm_scales(sd, cfg, scales)
    found = cm.recover_norm_scales(sd, out, cfg)
    assert set(found) == set(scales)
    assert all(torch.allclose(found[n], scales[n], rtol=1e-13, atol=0) for n in scales)
    assert cm.recover_norm_scales(sd, dict(sd), cfg) is None  # nothing migrated: nothing recovered


# -- the case (a): a migration computed elsewhere, in bfloat16 -------------------------


@pytest.mark.parametrize("n_key_value_heads", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales_dtype", [None, torch.float32])
def test_a_migration_computed_elsewhere_is_accepted_and_named(dtype, n_key_value_heads, scales_dtype):
    cfg, sd = _model(dtype, n_key_value_heads=n_key_value_heads)
    scales = _scales(cfg)
    after = _smoothquant_elsewhere(sd, cfg, scales, scales_dtype or dtype)
    after = {k: v.to(dtype) for k, v in after.items()}
    assert_equivalent(sd, after, cfg)
    report = diagnose(sd, after, cfg)
    assert report.ok
    assert [(f.name, f.rewrite) for f in report.findings if f.kind == "identity"] == [("migrate_norm_scales", "exact")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_control_one_reader_left_unscaled_is_refused_and_named(dtype):
    cfg, sd = _model(dtype, n_key_value_heads=2)
    after = _smoothquant_elsewhere(sd, cfg, _scales(cfg), dtype, spoil="blocks.1.mlp.W_gate")
    with pytest.raises(NotEquivalentError):
        assert_equivalent(sd, after, cfg)
    row = next(f for f in diagnose(sd, after, cfg).findings if f.name == "migrate_norm_scales")
    assert row.rewrite == "migrate_norm_scales.gate_unscaled"
    assert "blocks.1.mlp.W_gate" in {p.name for p in row.parameters}


def test_negative_control_a_bfloat16_reader_one_percent_off_is_refused():
    """In bfloat16 the log-probs cannot tell a 1 % error in one reader from rounding (the
    tolerance is wide); the tensor certificate against the recovered migration can."""
    cfg, sd = _model(torch.bfloat16)
    after = _smoothquant_elsewhere(sd, cfg, _scales(cfg), torch.bfloat16)
    after["blocks.0.attn.W_V"] = (after["blocks.0.attn.W_V"].double() * 1.01).to(torch.bfloat16)
    with pytest.raises(NotEquivalentError, match="blocks.0.attn.W_V"):
        assert_equivalent(sd, after, cfg)


@pytest.mark.parametrize("wrong", ["readers_unscaled", "wrong_way", "value_unscaled", "bias_unscaled"])
def test_the_planted_error_is_named(wrong):
    cfg, sd = _model(normalization_type="LN", act_fn="relu")
    identity = cm.get_identity("migrate_norm_scales")
    after, after_cfg = identity.wrong_rewrites[wrong](sd, cfg)
    report = check_migrate_norm_scales(sd, after, cfg, after_cfg=after_cfg)
    assert not report.ok
    assert any(f.rewrite == f"migrate_norm_scales.{wrong}" for f in report.findings), report


# -- rotations inside the heads ---------------------------------------------------------------


def _head_rotations(cfg, seed=5, rotary_commuting=False):
    shape = (cfg.n_layers, cfg.n_key_value_heads or cfg.n_heads, cfg.d_head, cfg.d_head)
    R = torch.linalg.qr(torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed)))[0]
    return nearest_commuting(R, cfg) if rotary_commuting else R


@pytest.mark.parametrize("n_key_value_heads", [None, 2])
def test_head_rotations_keep_the_function_and_are_recovered(n_key_value_heads):
    cfg, sd = _model(n_key_value_heads=n_key_value_heads, rotary_dim=6)
    value, query_key = _head_rotations(cfg), _head_rotations(cfg, seed=6, rotary_commuting=True)
    copies = {k: v.clone() for k, v in sd.items()}
    out, out_cfg = cm.rotate_heads(sd, cfg, value=value, query_key=query_key)
    assert all(torch.equal(sd[k], copies[k]) for k in sd) and out_cfg.applied == ("rotate_heads",)
    assert_equivalent(sd, out, cfg, after_cfg=out_cfg)
    found = cm.recover_head_rotations(sd, out, cfg)
    assert torch.allclose(found["value"], value, atol=1e-12) and torch.allclose(found["query_key"], query_key, atol=1e-12)
    again, again_cfg = cm.rotate_heads(out, out_cfg, value=value)  # two rotations are one: not refused
    assert again_cfg.applied == ("rotate_heads", "rotate_heads")
    assert_equivalent(sd, again, cfg, after_cfg=again_cfg)


def test_head_rotations_that_break_the_identity_are_refused():
    cfg, sd = _model(n_key_value_heads=2)
    generic = _head_rotations(cfg)
    with pytest.raises(cm.PreconditionError, match="commutes with the rotary embedding") as caught:
        cm.rotate_heads(sd, cfg, query_key=generic)  # mixes rotary pairs
    assert caught.value.identity == "rotate_heads"
    for bad, found in ((generic * 1.001, "max |R^T R - I|"), (generic[:, :1], "expected [2, 2, 8, 8]"), (None, "neither")):
        with pytest.raises(cm.PreconditionError, match="an orthogonal rotation per key/value head") as caught:
            cm.rotate_heads(sd, cfg, value=bad)
        assert found in str(caught.value)


def test_a_generic_query_key_rotation_keeps_a_model_without_rotary():
    cfg, sd = _model(positional_embedding_type="standard")
    out, out_cfg = cm.rotate_heads(sd, cfg, query_key=_head_rotations(cfg))
    assert_equivalent(sd, out, cfg, after_cfg=out_cfg)


@pytest.mark.parametrize("wrong", ["per_query_head", "value_bias_unrotated", "key_unrotated", "output_not_transposed",
                                   "query_key_generic"])
def test_the_planted_head_rotation_error_is_named(wrong):
    cfg, sd = _model(n_key_value_heads=2)
    after, after_cfg = cm.get_identity("rotate_heads").wrong_rewrites[wrong](sd, cfg)
    report = testing.check_rotate_heads(sd, after, cfg, after_cfg=after_cfg)
    assert not report.ok
    assert [f.rewrite for f in report.findings if f.kind == "identity"] == [f"rotate_heads.{wrong}"], report


# -- compositions: the case (b) and a whole pipeline -----------------------------------


#: The steps of :func:`_pipeline`, as the diagnosis names them.
STEPS = ("fold_rms_norm", "rotate_residual_stream", "rotate_heads", "migrate_norm_scales")


def _pipeline(sd, cfg, *, center_embedding=False, smooth=True, seed=0):
    """fold -> rotate the stream -> rotate the heads' values -> migrate scales into the folded norms
    (the rotations and scales drawn from ``seed``)."""
    out, out_cfg = cm.fold_rms_norm({k: v.double() for k, v in sd.items()}, cfg)
    if center_embedding:  # behind RMSNorm: not exact
        out = dict(out, **{"embed.W_E": out["embed.W_E"] - out["embed.W_E"].mean(-1, keepdim=True)})
    out, out_cfg = cm.rotate_residual_stream(out, out_cfg, cm.random_orthogonal(cfg.d_model, seed=3 + seed))
    out, out_cfg = cm.rotate_heads(out, out_cfg, value=_head_rotations(cfg, seed=5 + seed))
    if smooth:
        out, out_cfg = cm.migrate_norm_scales(out, out_cfg, _scales(cfg, seed=7 + seed))
    return {k: v.to(sd["embed.W_E"].dtype) for k, v in out.items()}, out_cfg.replace(applied=())


def _row_changed(after, name, row, r):
    changed = after[name].double().clone()
    changed[row] *= 1 + r
    return dict(after, **{name: changed.to(after[name].dtype)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_key_value_heads", [None, 2])
def test_every_step_of_a_quantisation_pipeline_is_recovered_and_named(n_key_value_heads, dtype):
    """fold -> rotate -> per-head rotate -> smooth, computed in float64 and rounded once: accepted,
    and each step named exact; in bfloat16 the migration's scales, recovered after the rotations,
    are certified against a bound widened by their own uncertainty and the rotations'."""
    cfg, sd = _model(dtype, n_key_value_heads=n_key_value_heads)
    after, after_cfg = _pipeline(sd, cfg)
    assert_equivalent(sd, after, cfg, after_cfg=after_cfg)
    report = diagnose(sd, after, cfg, after_cfg=after_cfg)
    assert report.ok, report
    assert {f.name: f.rewrite for f in report.findings if f.kind == "identity"} == dict.fromkeys(STEPS, "exact"), report


def test_in_bfloat16_the_migration_carries_the_rotation_s_widening_and_no_more():
    """The migration after the rotations scales each reader's rows by s: the rotation's error
    operator on them becomes diag(s) E diag(s)^-1, which the widening carries along (its weights).
    Carried unweighted, the exact pipeline is not certified; carried, a 3 % change of one row of
    a reader the migration scaled is still refused, naming the tensor."""
    from circuitmath._diagnosis import _uncertain

    cfg, sd = _model(torch.bfloat16, seed=1, n_key_value_heads=2)
    after, after_cfg = _pipeline(sd, cfg, seed=1)
    assert {f.name: f.rewrite for f in diagnose(sd, after, cfg, after_cfg=after_cfg).findings
            if f.kind == "identity"} == dict.fromkeys(STEPS, "exact")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_uncertain.Term, "scaled", lambda term, scaling: term)
        rows = {f.name: f.rewrite for f in diagnose(sd, after, cfg, after_cfg=after_cfg).findings if f.kind == "identity"}
        assert rows != dict.fromkeys(STEPS, "exact"), rows
    changed = _row_changed(after, "blocks.1.mlp.W_gate", 5, 10**-1.5)
    with pytest.raises(NotEquivalentError, match="blocks.1.mlp.W_gate"):
        assert_equivalent(sd, changed, cfg, after_cfg=after_cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_key_value_heads", [None, 2])
def test_case_b_rotations_recovered_and_the_embedding_centered_behind_rms_norm_named(n_key_value_heads, dtype):
    cfg, sd = _model(dtype, n_key_value_heads=n_key_value_heads)
    after, after_cfg = _pipeline(sd, cfg, center_embedding=True, smooth=False)
    with pytest.raises(NotEquivalentError):
        assert_equivalent(sd, after, cfg, after_cfg=after_cfg)
    report = diagnose(sd, after, cfg, after_cfg=after_cfg)
    rows = {f.name: f for f in report.findings if f.kind == "identity"}
    assert set(rows) == {"fold_rms_norm", "rotate_residual_stream", "rotate_heads"}
    assert rows["rotate_heads"].rewrite == "exact" and rows["fold_rms_norm"].rewrite == "exact"
    assert rows["rotate_residual_stream"].rewrite == "rotate_residual_stream.centered_embedding"
    assert [p.name for p in rows["rotate_residual_stream"].parameters] == ["embed.W_E"]
    assert "only for LayerNorm readers" in str(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_key_value_heads", [None, 2])
def test_case_b_negative_control_without_the_centering_everything_is_exact(n_key_value_heads, dtype):
    cfg, sd = _model(dtype, n_key_value_heads=n_key_value_heads)
    after, after_cfg = _pipeline(sd, cfg, smooth=False)
    assert_equivalent(sd, after, cfg, after_cfg=after_cfg)
    report = diagnose(sd, after, cfg, after_cfg=after_cfg)
    assert report.ok, report
    assert {f.name: f.rewrite for f in report.findings if f.kind == "identity"} == {
        "fold_rms_norm": "exact", "rotate_residual_stream": "exact", "rotate_heads": "exact"}, report


def test_in_bfloat16_the_recovered_rotation_s_uncertainty_covers_its_error_and_no_more():
    """The re-fit's spread bounds the recovered Q's error, column by column (each entry of a
    rotated tensor is its vector along the rotated axis times a column of the error); without it
    nothing rotated is certified, and with it a 1 % change of one row of a rotated tensor is still
    caught (twice the spread lets it through: the widening is pinned within a factor of two)."""
    from circuitmath._diagnosis import _uncertain
    from circuitmath._identities._residual_fit import best_rotation
    from circuitmath._processing.rotation import procrustes, rotate_residual_stream

    cfg, sd = _model(torch.bfloat16)
    after, after_cfg = _pipeline(sd, cfg, smooth=False)
    folded, folded_cfg = cm.fold_rms_norm({k: v.float() for k, v in sd.items()}, cfg)
    Q, names = best_rotation(folded, after, folded_cfg)
    assert len(names) > 1  # refined on every tensor the first fit reproduces, not on W_E alone
    rewrite = _uncertain.rounded(rotate_residual_stream(folded, folded_cfg, Q)[0], torch.bfloat16)
    refit = procrustes(folded, rewrite, folded_cfg, names)
    E = Q - cm.random_orthogonal(cfg.d_model, seed=3).double()
    error, bound = float(torch.linalg.matrix_norm(E, 2)), _uncertain.spread(Q, refit)
    assert 1e-3 < error <= bound < 8 * error, (error, bound)  # known to about 1e-3, and covered
    columns, column_bounds = torch.linalg.vector_norm(E, dim=0), _uncertain.column_spreads(Q, refit)
    assert bool((columns <= column_bounds).all()) and float((column_bounds / columns).median()) < 8
    changed = _row_changed(after, "blocks.0.mlp.W_in", 3, 0.01)
    with pytest.raises(NotEquivalentError):
        assert_equivalent(sd, changed, cfg, after_cfg=after_cfg)
    row = next(f for f in diagnose(sd, changed, cfg, after_cfg=after_cfg).findings if f.name == "rotate_residual_stream")
    assert [(p.name, p.at[0]) for p in row.parameters] == [("blocks.0.mlp.W_in", 3)], row  # the changed row
    spread = _uncertain.SPREAD
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_uncertain, "SPREAD", 0.0)  # the certificate of 1 ulp against the recovered Q
        rows = {f.name: f.rewrite for f in diagnose(sd, after, cfg, after_cfg=after_cfg).findings if f.kind == "identity"}
        assert rows.get("rotate_residual_stream") != "exact", rows  # not named, or named with a wrong rewrite
        patch.setattr(_uncertain, "SPREAD", 2 * spread)  # too wide: the change passes
        assert_equivalent(sd, changed, cfg, after_cfg=after_cfg)


@pytest.mark.parametrize("seed", range(8))
def test_a_widening_term_bounds_its_error_operator_through_later_scalings_and_rotations(seed):
    """A reader ``x`` ``[d, n]`` rewritten with ``Q + E`` is off by ``E^T x``; scaled by ``diag(s)``
    along its rows the error is ``diag(s) E^T diag(s)^-1`` of the new tensor, bounded entry by
    entry by the term with the scales as weights (and not without them); rotated by ``M`` along
    the same axis, by the term :meth:`Term.rotated` makes; an entrywise relative error by its
    relative term, through a scaling and, turned into a norm, through a rotation."""
    from circuitmath._diagnosis._uncertain import Term

    g = torch.Generator().manual_seed(seed)
    d, n = 16, 24
    x = torch.randn(d, n, dtype=F64, generator=g)
    E = 1e-3 * torch.randn(d, d, dtype=F64, generator=g)
    s = torch.exp(2 * torch.randn(d, dtype=F64, generator=g))
    M = torch.linalg.qr(torch.randn(d, d, dtype=F64, generator=g))[0]
    term = Term(-2, float(torch.linalg.matrix_norm(E, 2)), torch.linalg.vector_norm(E, dim=0))
    assert bool(((E.T @ x).abs() <= term.bound(x) * (1 + 1e-12)).all())
    scaled, scaled_term = s[:, None] * x, term.scaled((-2, s))
    error = s[:, None] * (E.T @ x)
    assert bool((error.abs() <= scaled_term.bound(scaled) * (1 + 1e-12)).all())
    assert not bool((error.abs() <= term.bound(scaled)).all())  # unweighted, the bound breaks
    assert bool(((M @ error).abs() <= scaled_term.rotated(-2).bound(M @ scaled) * (1 + 1e-12)).all())
    assert term.scaled((-1, torch.ones(n, dtype=F64))) is term  # a scaling along another axis commutes
    delta = 1e-3 * torch.rand(d, n, dtype=F64, generator=g)  # entrywise relative errors up to 1e-3
    relative = Term(None, 1e-3)
    assert bool(((delta * scaled).abs() <= relative.scaled((-2, s)).bound(scaled) * (1 + 1e-12)).all())
    assert bool(((M @ (delta * scaled)).abs() <= relative.rotated(-2).bound(M @ scaled) * (1 + 1e-12)).all())


# -- scales through the MLP's product or its ReLU --------------------------------------------


@pytest.mark.parametrize("changes", [{}, {"gated_mlp": False, "act_fn": "relu", "normalization_type": "LN"}])
def test_neuron_scales_keep_the_function_and_are_recovered(changes):
    cfg, sd = _model(**changes)
    s = torch.exp(torch.randn(cfg.n_layers, cfg.d_mlp, dtype=F64, generator=torch.Generator().manual_seed(2)))
    copies = {k: v.clone() for k, v in sd.items()}
    out, out_cfg = cm.scale_neurons(sd, cfg, s)
    assert all(torch.equal(sd[k], copies[k]) for k in sd) and out_cfg.applied == ("scale_neurons",)
    assert_equivalent(sd, out, cfg, after_cfg=out_cfg)
    assert torch.allclose(cm.recover_neuron_scales(sd, out, cfg), s, rtol=1e-13, atol=0)
    assert cm.recover_neuron_scales(sd, dict(sd), cfg) is None
    if cfg.gated_mlp:  # any nonzero scale through the product
        assert_equivalent(sd, *cm.scale_neurons(sd, cfg, -s)[:1], cfg, after_cfg=out_cfg)
    twice, twice_cfg = cm.scale_neurons(out, out_cfg, s)  # two scalings are one: not refused
    assert twice_cfg.applied == ("scale_neurons", "scale_neurons")
    assert_equivalent(sd, twice, cfg, after_cfg=twice_cfg)


@pytest.mark.parametrize("changes, scale, found", [
    ({"gated_mlp": False, "act_fn": "gelu"}, 2.0, "act_fn is 'gelu' in an ungated MLP"),
    ({"gated_mlp": False, "act_fn": "silu"}, 2.0, "act_fn is 'silu' in an ungated MLP"),
    ({"gated_mlp": False, "act_fn": "relu"}, -2.0, "negative scales through ReLU"),
])
def test_scales_through_a_non_homogeneous_activation_are_refused(changes, scale, found):
    cfg, sd = _model(**changes)
    with pytest.raises(cm.PreconditionError, match="reaches W_out linearly") as caught:
        cm.scale_neurons(sd, cfg, torch.full((cfg.d_mlp,), scale, dtype=F64))
    assert caught.value.identity == "scale_neurons" and found in str(caught.value)
    # negative control: the rewrite applied regardless changes the model, and the diagnosis names the refusal
    after, after_cfg = cm.get_identity("scale_neurons").wrong_rewrites["regardless"](
        sd, cfg, torch.full((cfg.n_layers, cfg.d_mlp), scale, dtype=F64))
    with pytest.raises(NotEquivalentError):
        assert_equivalent(sd, after, cfg, after_cfg=after_cfg)
    row = next(f for f in testing.check_scale_neurons(sd, after, cfg, after_cfg=after_cfg).findings if f.name == "scale_neurons")
    assert row.rewrite == "scale_neurons.regardless" and row.precondition == "the scaled pre-activation reaches W_out linearly"


@pytest.mark.parametrize("wrong", ["through_gate", "out_not_divided", "bias_not_scaled"])
def test_the_planted_neuron_scale_error_is_named(wrong):
    cfg, sd = _model(n_key_value_heads=2)
    after, after_cfg = cm.get_identity("scale_neurons").wrong_rewrites[wrong](sd, cfg)
    report = testing.check_scale_neurons(sd, after, cfg, after_cfg=after_cfg)
    assert not report.ok
    assert [f.rewrite for f in report.findings if f.kind == "identity"] == [f"scale_neurons.{wrong}"], report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_neuron_scaling_computed_elsewhere_is_accepted_and_named(dtype):
    cfg, sd = _model(dtype, n_key_value_heads=2)
    s = torch.exp(torch.randn(cfg.d_mlp, generator=torch.Generator().manual_seed(2))).to(dtype)
    after = dict(sd)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.mlp"
        after[f"{p}.W_in"], after[f"{p}.b_in"] = sd[f"{p}.W_in"] * s, sd[f"{p}.b_in"] * s
        after[f"{p}.W_out"] = sd[f"{p}.W_out"] / s[:, None]
    assert_equivalent(sd, after, cfg)
    report = diagnose(sd, after, cfg)
    assert [(f.name, f.rewrite) for f in report.findings if f.kind == "identity"] == [("scale_neurons", "exact")]


def test_a_query_key_rotation_is_refused_under_qk_norm_and_values_still_rotate():
    cfg, sd = _model(qk_norm=True)
    with pytest.raises(cm.PreconditionError, match="QK-norm") as caught:
        cm.rotate_heads(sd, cfg, query_key=_head_rotations(cfg, rotary_commuting=True))
    assert caught.value.identity == "rotate_heads"
    out, out_cfg = cm.rotate_heads(sd, cfg, value=_head_rotations(cfg))
    assert_equivalent(sd, out, cfg, after_cfg=out_cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wrong_step, wrong, tensors, n_key_value_heads", [
    ("heads", "rotate_heads.per_query_head", ["blocks.0.attn.W_O", "blocks.1.attn.W_O"], 2),
    ("smooth", "migrate_norm_scales.gate_unscaled", ["blocks.0.mlp.W_gate", "blocks.1.mlp.W_gate"], None),
    ("smooth", "migrate_norm_scales.gate_unscaled", ["blocks.0.mlp.W_gate", "blocks.1.mlp.W_gate"], 2),
])
def test_one_wrong_step_in_a_pipeline_is_named_with_its_tensors(wrong_step, wrong, tensors, n_key_value_heads, dtype):
    """fold -> rotate -> per-head rotate -> smooth with one step wrong: refused, the other steps
    exact, the wrong one named with the tensors it got wrong (a rotation per query head is wrong
    only with grouped-query attention: without it each query head is its own group)."""
    cfg, sd = _model(dtype, n_key_value_heads=n_key_value_heads)
    out, out_cfg = cm.fold_rms_norm({k: v.double() for k, v in sd.items()}, cfg)
    out, out_cfg = cm.rotate_residual_stream(out, out_cfg, cm.random_orthogonal(cfg.d_model, seed=3))
    heads, smooth = cm.get_identity("rotate_heads"), cm.get_identity("migrate_norm_scales")
    rotations = {"value": _head_rotations(cfg)}
    out, out_cfg = (heads.wrong_rewrites["per_query_head"] if wrong_step == "heads" else heads.transform)(out, out_cfg, rotations)
    out, out_cfg = (smooth.wrong_rewrites["gate_unscaled"] if wrong_step == "smooth" else smooth.transform)(
        out, out_cfg, _scales(cfg, seed=7))
    after, after_cfg = {k: v.to(dtype) for k, v in out.items()}, out_cfg.replace(applied=())
    with pytest.raises(NotEquivalentError):
        assert_equivalent(sd, after, cfg, after_cfg=after_cfg)
    report = diagnose(sd, after, cfg, after_cfg=after_cfg)
    assert not report.ok
    rows = {f.name: f for f in report.findings if f.kind == "identity"}
    assert set(rows) == {"fold_rms_norm", "rotate_residual_stream", "rotate_heads", "migrate_norm_scales"}
    assert [(name, f.rewrite) for name, f in rows.items() if f.rewrite != "exact"] == [(wrong.split(".")[0], wrong)]
    assert sorted(p.name for p in rows[wrong.split(".")[0]].parameters) == tensors


class OneDevice(TorchFunctionMode):
    """Refuses any operation whose tensor operands (0-d scalars aside) lie on two devices: with
    the default device set to ``meta`` this catches a hidden host tensor in a matrix product too,
    which PyTorch otherwise computes on the first operand's device without a word."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.ndim}
        if len(devices) > 1:
            raise RuntimeError(f"{func} mixes the devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def test_the_wrong_head_rotations_multiply_on_the_weights_device():
    """The diagnosis replays these wrong rewrites on a model wherever it lies (a GPU): the
    rotations, drawn on the host, go to the weights' device, never the weights to the host. The
    weights here lie on ``meta`` and any operation mixing two devices raises."""
    from circuitmath._identities.quantisation import _output_not_transposed, _per_query_head, check_head_rotations

    cfg, sd = _model(n_key_value_heads=2)
    names = [f"blocks.{l}.attn.W_O" for l in range(cfg.n_layers)]
    before = {n: sd[n].to("meta") for n in names}
    for change in (_per_query_head, _output_not_transposed):
        out = dict(before)
        with OneDevice():
            change(out, before, cfg, check_head_rotations(cfg))
        assert all(out[n].device.type == "meta" for n in names), change.__name__
    with pytest.raises(RuntimeError, match="mixes the devices"), OneDevice():  # negative control: the trap springs
        _ = torch.ones(2, 2, dtype=F64) @ before[names[0]][0, :2]


@pytest.mark.parametrize("name", ["migrate_norm_scales", "rotate_heads", "scale_neurons"])
def test_transforms_wrong_rewrites_and_recovery_make_no_tensor_on_the_default_device(name):
    """Each transform, each wrong rewrite and the recovery, with the default device ``meta`` and
    no operation allowed to mix devices: a tensor made without ``device=`` fails even where it
    only meets the weights in a matrix product."""
    cfg, sd = _model(torch.float32, n_layers=1, d_model=16, d_mlp=32, n_key_value_heads=2)
    identity = cm.get_identity(name)
    torch.set_default_device("meta")
    try:
        with OneDevice():
            for rewrite in [identity.transform, *identity.wrong_rewrites.values()]:
                out, _ = rewrite(sd, cfg)
                assert {t.device.type for t in out.values()} == {"cpu"}
                assert identity.recover(sd, out, cfg) is not None
    finally:
        torch.set_default_device(None)


def test_no_head_rotation_is_recovered_between_row_blocks_that_differ():
    """Positional query/key tables on one side only (a shortformer model against its tables) are
    not a head rotation: recovery answers None instead of fitting blocks of different sizes, and
    the diagnosis of TransformerLens's shortformer processing (the checking chapter) completes."""
    cfg = cm.Config(n_layers=2, d_model=6, n_heads=2, d_head=3, d_vocab=9, n_ctx=5, d_mlp=12,
                    positional_embedding_type="shortformer")
    sd = cm.random_state_dict(cfg, seed=1, dtype=F64)
    tables, tables_cfg = cm.shortformer_to_tables(sd, cfg)
    moved = dict(tables, **{k: v.roll(1, -1) for k, v in tables.items() if k.endswith(("W_Q", "W_K"))})
    assert cm.recover_head_rotations(tables, {k: v for k, v in moved.items() if ".pos_" not in k}, tables_cfg) is None
    assert cm.recover_head_rotations(tables, moved, tables_cfg) is not None  # negative control: same blocks fit


def test_a_scaled_rotation_is_refused_in_half_precision():
    """R = 1.2 I is no rotation: W_V R R^T W_O scales every head's output by 1.44. Orthogonality
    is asked to the precision R is given in (float64 here), not to the model's bfloat16, whose
    4 d_head eps (0.5 at d_head 16) let it through and recorded rotate_heads on a changed model."""
    cfg, sd = _model(torch.bfloat16, d_head=16, n_heads=2)
    with pytest.raises(cm.PreconditionError, match="an orthogonal rotation per key/value head") as caught:
        cm.rotate_heads(sd, cfg, value=1.2 * torch.eye(16, dtype=F64))
    assert "max |R^T R - I| is 0.44" in str(caught.value)
    rounded = _head_rotations(cfg).to(torch.bfloat16)  # a rotation given in bfloat16: to bfloat16's precision
    out, out_cfg = cm.rotate_heads(sd, cfg, value=rounded)
    assert out_cfg.applied == ("rotate_heads",)


# -- one verdict in every form ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_key_value_heads", [None, 2])
def test_the_pipeline_gets_one_verdict_in_memory_from_files_and_from_folders(tmp_path, n_key_value_heads, dtype):
    """fold -> rotate -> per-head rotate -> smooth in float32, bfloat16 and float16, recorded
    nowhere or in ``cfg.applied``, and with the gates left unscaled: ``assert_equivalent`` in
    memory, ``check --processed`` of two files and of two folders read a block at a time give one
    verdict each (the exact processing passes, the wrong step fails)."""
    from circuitmath._checkpoint import CheckpointWriter
    from verdict_corpus import FORMS, verdict

    cfg, sd = _model(dtype, n_key_value_heads=n_key_value_heads)
    after, after_cfg = _pipeline(sd, cfg)
    out, out_cfg = cm.fold_rms_norm({k: v.double() for k, v in sd.items()}, cfg)
    out, out_cfg = cm.rotate_residual_stream(out, out_cfg, cm.random_orthogonal(cfg.d_model, seed=3))
    out, out_cfg = cm.rotate_heads(out, out_cfg, value=_head_rotations(cfg))
    out, out_cfg = cm.get_identity("migrate_norm_scales").wrong_rewrites["gate_unscaled"](out, out_cfg, _scales(cfg, seed=7))
    cases = {
        "exact, recorded nowhere": (after, after_cfg, True),
        "exact, recorded": (after, after_cfg.replace(applied=STEPS), True),
        "gates unscaled": ({k: v.to(dtype) for k, v in out.items()}, out_cfg.replace(applied=()), False),
    }
    folder = tmp_path / "before"
    with CheckpointWriter(folder, 2) as writer:
        writer.write(sd, cfg)
    for case, (processed, processed_cfg, valid) in cases.items():
        found = [verdict(form, folder, sd, cfg, processed, processed_cfg, tmp_path / f"{case}-{form}") for form in FORMS]
        assert found == [valid] * len(FORMS), (case, dict(zip(FORMS, found)))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_folder_s_recovered_steps_are_named_and_its_tensors_certified(tmp_path, dtype):
    """The exact pipeline read from folders a part at a time, recorded nowhere or in
    ``cfg.applied``: every tensor certified against the replay with the fold, the residual
    rotation, the head rotations and the scales recovered, each named; the controls, the gates
    left unscaled and one row of the rotated ``W_in`` times 1.1, are refused naming the tensor."""
    from circuitmath._checkpoint import CheckpointWriter
    from circuitmath._streaming_check_processed import check_processed

    cfg, sd = _model(dtype, n_key_value_heads=2)
    after, after_cfg = _pipeline(sd, cfg)
    out, out_cfg = cm.fold_rms_norm({k: v.double() for k, v in sd.items()}, cfg)
    out, out_cfg = cm.rotate_residual_stream(out, out_cfg, cm.random_orthogonal(cfg.d_model, seed=3))
    out, out_cfg = cm.rotate_heads(out, out_cfg, value=_head_rotations(cfg))
    out, out_cfg = cm.get_identity("migrate_norm_scales").wrong_rewrites["gate_unscaled"](out, out_cfg, _scales(cfg, seed=7))
    tokens = torch.randint(0, cfg.d_vocab, (4, 8), generator=torch.Generator().manual_seed(0))
    rows = {}
    with CheckpointWriter(tmp_path / "before", 2) as writer:
        writer.write(sd, cfg)
    for case, (processed, processed_cfg) in {"exact": (after, after_cfg), "recorded": (after, after_cfg.replace(applied=STEPS)),
                                             "gates unscaled": ({k: v.to(dtype) for k, v in out.items()}, out_cfg.replace(applied=())),
                                             "one row off": (_row_changed(after, "blocks.0.mlp.W_in", 3, 0.1), after_cfg.replace(applied=STEPS)),
                                             }.items():
        with CheckpointWriter(tmp_path / case, 2) as writer:
            writer.write(processed, processed_cfg)
        rows[case] = check_processed(tmp_path / "before", tmp_path / case, tokens=tokens).rows[1]
    for case in ("exact", "recorded"):
        exact = rows[case]
        assert exact["status"] == "holds" and exact["max_abs_error"] <= 1, exact
        assert "34 tensors within" in exact["explanation"], exact
        assert "then fold_rms_norm then rotate_residual_stream then rotate_heads then migrate_norm_scales" in exact["explanation"]
    for case, tensor in (("gates unscaled", "W_gate"), ("one row off", "blocks.0.mlp.W_in")):
        assert rows[case]["status"] == "violated" and tensor in rows[case]["explanation"], rows[case]


@pytest.mark.parametrize("dtype, r", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("n_key_value_heads", [None, 2])
def test_negative_control_the_pipeline_with_one_row_off_is_refused_in_every_form(tmp_path, n_key_value_heads, dtype, r):
    """The pipeline with one row of the rotated ``blocks.0.mlp.W_in`` times ``1 + r`` (0.01 % in
    float32, 10 % in bfloat16): refused in memory, from files and from folders (a folder's
    residual rotation, head rotations and scales are recovered a part at a time, and the other
    tensors certified against them)."""
    from circuitmath._checkpoint import CheckpointWriter
    from verdict_corpus import FORMS, verdict

    cfg, sd = _model(dtype, n_key_value_heads=n_key_value_heads)
    after, after_cfg = _pipeline(sd, cfg)
    changed = _row_changed(after, "blocks.0.mlp.W_in", 3, r)
    folder = tmp_path / "before"
    with CheckpointWriter(folder, 2) as writer:
        writer.write(sd, cfg)
    found = [verdict(form, folder, sd, cfg, changed, after_cfg, tmp_path / form) for form in FORMS]
    assert found == [False] * len(FORMS), dict(zip(FORMS, found))


def test_only_a_rotated_embedding_starts_the_streamed_recovery():
    """The streamed replay looks for a residual rotation where ``after``'s ``W_E`` changed and
    kept its row norms: a rotation; not an unchanged, centered or scaled one."""
    from circuitmath._streaming_recovery import Recovery

    cfg, sd = _model(torch.float32)
    recovery, W = Recovery({}, cfg, torch.float32), sd["embed.W_E"]
    rotated = (W.double() @ cm.random_orthogonal(cfg.d_model, seed=3)).float()
    assert recovery.shows_rotation(W, rotated)
    assert not recovery.shows_rotation(W, W.clone())
    assert not recovery.shows_rotation(W, W - W.mean(-1, keepdim=True))
    assert not recovery.shows_rotation(W, rotated * 1.01)
