"""A separate project's tests: TransformerLens 4.3.0's weight processing, verified with circuitmath.

Written as a downstream project would write them: the only circuitmath names used are public
(``circuitmath``, ``circuitmath.testing``, ``circuitmath.strategies``), and the glue that runs
TransformerLens is the project's own. TransformerLens state dicts use circuitmath's names and
shapes, so they are passed as they are; TransformerLens keeps a folded norm with gain 1 and
bias 0, which the checkers read as the same function. Needs ``transformer-lens==4.3.0`` (the
``peers`` extra).
"""

import pytest
import torch
from hypothesis import given, settings
from transformer_lens.config.transformer_lens_config import TransformerLensConfig
from transformer_lens.weight_processing import ProcessWeights

import circuitmath
from circuitmath.strategies import models
from circuitmath.testing import (
    NotEquivalentError,
    assert_equivalent,
    check_center_unembed,
    check_center_writing_weights,
    check_fold_layer_norm,
)


# -- the project's glue ----------------------------------------------------------------------------


def transformer_lens_config(cfg: circuitmath.Config) -> TransformerLensConfig:
    return TransformerLensConfig(
        n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, d_head=cfg.d_head, d_vocab=cfg.d_vocab,
        n_ctx=cfg.n_ctx, d_mlp=cfg.d_mlp, act_fn=cfg.act_fn, eps=cfg.eps, device="cpu",
        normalization_type=cfg.normalization_type, uses_rms_norm=cfg.normalization_type == "RMS",
        positional_embedding_type=cfg.positional_embedding_type, attn_only=cfg.attn_only,
        gated_mlp=cfg.gated_mlp, n_key_value_heads=cfg.n_key_value_heads,
    )


def process(state_dict, cfg, **flags):
    """TransformerLens's full pipeline on a copy (it replaces entries of the dict it is given)."""
    return ProcessWeights.process_weights(dict(state_dict), transformer_lens_config(cfg), **flags)


def model(seed=0, dtype=torch.float32, **options):
    sizes = dict(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=6, d_mlp=16)
    cfg = circuitmath.Config(**{**sizes, **options})
    return cfg, circuitmath.random_state_dict(cfg, seed=seed, dtype=dtype)


# -- where TransformerLens is exact ---------------------------------------------------------------


def _unambiguous(model_):
    """TransformerLens tells a weight's axes apart by their sizes; keep them different (see below),
    and keep LayerNorm away from gated MLPs, whose W_gate has no bias to absorb ln2.b @ W_gate."""
    cfg, _ = model_
    return cfg.d_model not in (cfg.d_vocab, cfg.d_mlp) and not (cfg.gated_mlp and cfg.normalization_type == "LN")


@settings(max_examples=40, deadline=None)
@given(models(dtype=torch.float32, normalization_types=("LN", "RMS"), positional_embedding_types=("standard", "rotary"),
              min_layers=0, grouped_query=(False, True),
              min_d_model=3).filter(_unambiguous))
def test_process_weights_keeps_the_function(model_):
    cfg, state_dict = model_
    assert_equivalent(state_dict, process(state_dict, cfg), cfg)


@pytest.mark.parametrize(
    "options",
    [
        {},  # GPT-2 layout
        {"normalization_type": "RMS", "gated_mlp": True, "act_fn": "silu", "n_key_value_heads": 1,
         "positional_embedding_type": "rotary"},  # LLaMA layout
        {"parallel_attn_mlp": True, "positional_embedding_type": "rotary"},  # GPT-NeoX layout
    ],
    ids=["gpt2", "llama", "neox"],
)
def test_a_few_architectures(options):
    cfg, state_dict = model(**options)
    result = assert_equivalent(state_dict, process(state_dict, cfg), cfg)
    assert result.max_abs_error <= result.tolerance


def test_each_step_checked_on_its_own():
    cfg, state_dict = model()
    tl_cfg = transformer_lens_config(cfg)
    folded = ProcessWeights.fold_layer_norm(dict(state_dict), tl_cfg, fold_biases=True, center_weights=False)
    for report in (
        check_fold_layer_norm(state_dict, folded, cfg),
        check_center_unembed(state_dict, ProcessWeights.center_unembed(dict(state_dict), tl_cfg), cfg),
        check_center_writing_weights(state_dict, ProcessWeights.center_writing_weights(dict(state_dict), tl_cfg), cfg),
    ):
        assert report.ok, report
        assert [f.rewrite for f in report.findings if f.kind == "identity"] == ["exact"]


# -- where it is not: caught, and explained --------------------------------------------------------


def _diagnosis(state_dict, processed, cfg):
    with pytest.raises(NotEquivalentError) as caught:
        assert_equivalent(state_dict, processed, cfg)
    return caught.value.diagnosis


def test_shortformer_divergence_is_caught():
    cfg, state_dict = model(positional_embedding_type="shortformer")
    found = _diagnosis(state_dict, process(state_dict, cfg), cfg)
    rows = {f.name: f for f in found.findings}
    # ln1 is folded into W_Q and W_K as if W_pos entered the residual stream: positions get scaled
    fold = rows["fold_layer_norm"]
    assert fold.status == "violated" and fold.rewrite == "shortformer_to_tables.naive_fold"
    assert fold.max_abs_error > 0.1
    # and the readers are centered although W_pos, added after ln1, is not centered by LNPre
    centering = rows["center_reading_weights"]
    assert centering.status == "violated" and not centering.applicable
    assert centering.precondition == "norm output read only by linear maps"
    assert {"blocks.0.attn.W_Q", "blocks.1.attn.W_K"} <= {p.name for p in centering.parameters}
    assert found.comparison.max_abs_error > 0.5


@pytest.mark.parametrize("square", ["d_vocab", "d_mlp"])
def test_a_square_reader_is_folded_along_the_wrong_axis(square):
    cfg, state_dict = model(**{square: 8})  # equal to d_model: the gain's axis is guessed from the shape
    found = _diagnosis(state_dict, process(state_dict, cfg), cfg)
    fold = next(f for f in found.violations if f.kind == "identity")
    assert fold.name == "fold_layer_norm"
    weight, bias = ("unembed.W_U", "unembed.b_U") if square == "d_vocab" else ("blocks.0.mlp.W_in", "blocks.0.mlp.b_in")
    assert weight in fold.explanation.split("scale_columns explains ")[1].split(":")[0]
    assert bias in fold.explanation.split("bias_through_transpose explains ")[1].split(":")[0]
    assert fold.max_abs_error > 0.1


def test_float64_weights_come_back_with_float32_rounding():
    cfg, state_dict = model(dtype=torch.float64)
    found = _diagnosis(state_dict, process(state_dict, cfg), cfg)
    assert all(f.rewrite == "exact" for f in found.findings if f.kind == "identity")
    residual = next(f for f in found.findings if f.name == "residual")
    assert residual.status == "violated" and "within float32 rounding" in residual.explanation
    assert 1e-9 < found.comparison.max_abs_error < 1e-5


def test_a_layer_norm_bias_before_a_gated_mlp_needs_a_bias_the_architecture_lacks():
    cfg, state_dict = model(gated_mlp=True, act_fn="silu")
    with pytest.raises(circuitmath.StateDictError, match=r"unexpected keys \['blocks.0.mlp.b_gate'"):
        assert_equivalent(state_dict, process(state_dict, cfg), cfg)
