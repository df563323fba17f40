"""Quantisation pipelines' rewrites: scale migration across a norm (SmoothQuant), its transform,
its recovery by the diagnosis, and the issue's case of a migration computed in bfloat16."""

import pytest
import torch

import circuitmath as cm
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
