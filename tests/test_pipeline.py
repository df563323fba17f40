"""The whole weight-processing pipeline on every architecture the steps support."""

import contextlib
import inspect

import pytest
import torch
from hypothesis import given, settings, strategies as st

import circuitmath as cm
from circuitmath._identities.pipeline import EVERYTHING_APPLICABLE
from circuitmath._processing import dispatch as dispatch_module, fused as fused_module
from circuitmath._processing.fused import FUSED_RMS_STEPS, FUSED_STEPS, fusable, rms_fusable
from circuitmath._processing.steps import DEFAULTS, PIPELINE_STEPS, STEPS, leaving_out, steps_between
from circuitmath.strategies import models, tokens
from circuitmath.testing import compare_log_probs, default_tokens
from support import VISIBLE, assert_caught, assume_above, same, snapshot, wide

PIPELINE = cm.get_identity("process_weights")
EVERY_ARCHITECTURE = dict(
    norm_positions=("pre", "post"), positional_embedding_types=("standard", "shortformer", "rotary")
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
KEYWORDS = [keyword for keyword, _step in PIPELINE_STEPS]
# What each keyword records in cfg.applied when it applies (the fold of a LayerNorm records three:
# the shortformer tables when there are some, the fold, and the centering of its readers).
RECORDS = {
    "fold_ln": {"fold_layer_norm", "fold_rms_norm"},
    "fold_value_biases": {"fold_value_biases"},
    "center_writing_weights": {"center_writing_weights"},
    "center_unembed": {"center_unembed"},
    "refactor_factored_attn_matrices": {"refactor_factored_attn_matrices"},
}


@DTYPES
@given(data=st.data())
def test_everything_applicable_preserves_log_probs(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **EVERY_ARCHITECTURE)))
    before = snapshot(sd)
    result = PIPELINE.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, result
    assert same(sd, before), "the input state dict was modified"
    processed, processed_cfg = cm.process_weights(sd, cfg, **EVERYTHING_APPLICABLE)
    assert {t.dtype for t in processed.values()} == {dtype}
    cm.validate_state_dict(processed, processed_cfg)
    assert processed_cfg.applied[: len(cfg.applied)] == cfg.applied


@given(models(**wide(**EVERY_ARCHITECTURE)))
def test_a_step_is_left_out_only_where_asking_for_it_is_refused(model):
    """With None a step that does not apply is left out; asked for with True, it raises."""
    cfg, sd = model
    processed, processed_cfg = cm.process_weights(sd, cfg, **EVERYTHING_APPLICABLE)
    for keyword in KEYWORDS:
        alone = dict.fromkeys(KEYWORDS, False) | {keyword: True}
        if RECORDS[keyword] & set(processed_cfg.applied):
            assert RECORDS[keyword] & set(cm.process_weights(sd, cfg, **alone)[1].applied)
        else:
            with pytest.raises(cm.PreconditionError):
                cm.process_weights(sd, cfg, **alone)


@given(models(**wide(**EVERY_ARCHITECTURE)))
def test_steps_run_in_the_documented_order_and_everything_twice_is_everything_once(model):
    cfg, sd = model
    processed, processed_cfg = cm.process_weights(sd, cfg, **EVERYTHING_APPLICABLE)
    order = {name: i for i, keyword in enumerate(KEYWORDS) for name in RECORDS[keyword]}
    ranks = [order[name] for name in processed_cfg.applied if name in order]
    assert ranks == sorted(ranks)
    again, again_cfg = cm.process_weights(processed, processed_cfg, **EVERYTHING_APPLICABLE)
    assert again_cfg == processed_cfg and same(again, processed)


@given(models(**wide(dtype=torch.float32, normalization_types=("LN",), gated_mlp=(False,),
              positional_embedding_types=("standard", "shortformer", "rotary"))))
def test_defaults_on_a_layer_norm_model_give_the_canonical_form(model):
    """Readers and writers centered over d_model, value biases zero, unembed centered over the vocabulary."""
    cfg, sd = model
    processed, processed_cfg = cm.process_weights(sd, cfg)
    assert processed_cfg.normalization_type == "LNPre"
    assert set(processed_cfg.applied) >= {"fold_layer_norm", "center_reading_weights", "fold_value_biases",
                                          "center_writing_weights", "center_unembed"}
    scale = max(float(t.abs().max()) for t in processed.values())
    small = 64 * torch.finfo(torch.float32).eps * scale * cfg.d_model
    for norm, pairs in cm._processing.readers(processed_cfg):
        for weight, _bias in pairs:
            assert processed[weight].mean(dim=-2).abs().max() <= small, weight
    for name in cm._processing.writers(processed_cfg):
        assert processed[name].mean(dim=-1).abs().max() <= small, name
    for layer in range(cfg.n_layers):
        bias = "_b_V" if cfg.n_key_value_heads else "b_V"
        assert not processed[f"blocks.{layer}.attn.{bias}"].any()
    assert processed["unembed.W_U"].mean(dim=-1).abs().max() <= small
    assert processed["unembed.b_U"].mean().abs() <= small


def _chain(sd, cfg, steps=PIPELINE_STEPS[:4]):
    """The public transforms one after the other, as process_weights runs them when not fused."""
    for _keyword, step in steps:
        sd, cfg = step(sd, cfg)
    return sd, cfg


def _largest_gap(a, b):
    """max |a - b| over every tensor, relative to each tensor's largest entry."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) / max(1.0, float(b[k].abs().max())) for k in a)


# The fused pass and the chain add the same terms in other orders, so entries differ by rounding
# only: at most a few units of u per term summed, and the longest sums (the vocabulary mean of
# W_U, the d_model terms of b @ W) have max(d_model, d_vocab) terms.
def _rounding_allowance(cfg, dtype):
    return 8 * torch.finfo(dtype).eps * max(cfg.d_model, cfg.d_vocab)


FUSABLE = dict(normalization_types=("LN",), gated_mlp=(False,), positional_embedding_types=("standard", "rotary"))


@contextlib.contextmanager
def fused_runs():
    """The normalization types of the models process_weights hands to the fused pass while open.
    Equal bits or the same error alone cannot tell that the fused pass ran (the chain gives them
    too): a test of the fused pass requires it to have run. A spy, not monkeypatch: hypothesis
    tests take no function-scoped fixture."""
    calls = []
    original = dispatch_module.fused_default_steps

    def spy(state_dict, cfg, **kwargs):
        calls.append(cfg.normalization_type)
        return original(state_dict, cfg, **kwargs)

    dispatch_module.fused_default_steps = spy
    try:
        yield calls
    finally:
        dispatch_module.fused_default_steps = original


@DTYPES
@given(data=st.data())
def test_the_fused_default_steps_give_the_chains_weights(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype, **FUSABLE)))
    assert fusable(cfg)
    before = snapshot(sd)
    with fused_runs() as runs:
        fused, fused_cfg = cm.process_weights(sd, cfg)
    assert runs == ["LN"]
    chained, chained_cfg = _chain(sd, cfg)
    assert fused_cfg == chained_cfg
    assert {t.dtype for t in fused.values()} == {dtype}
    assert _largest_gap(fused, chained) <= _rounding_allowance(cfg, dtype)
    assert same(sd, before), "the input state dict was modified"


@given(models(**wide(dtype=torch.float64, **FUSABLE)))
def test_negative_control_a_chain_without_the_unembed_centering_is_told_apart(model):
    cfg, sd = model
    fused, _ = cm.process_weights(sd, cfg)
    chained, _ = _chain(sd, cfg, PIPELINE_STEPS[:3])
    # what the left-out step would have subtracted: the unembed's means over the vocabulary
    means = max(float(chained[k].mean(dim=-1).abs().max()) / max(1.0, float(chained[k].abs().max()))
                for k in ("unembed.W_U", "unembed.b_U"))
    assume_above("vocabulary mean of the unembed", means, 2 * _rounding_allowance(cfg, torch.float64))
    assert _largest_gap(fused, chained) > _rounding_allowance(cfg, torch.float64)


@given(models(**wide(**EVERY_ARCHITECTURE)))
def test_the_fused_pass_is_taken_exactly_when_every_default_step_applies_whatever_the_weights(model):
    cfg, sd = model
    if fusable(cfg):
        assert _chain(sd, cfg)[1].applied == FUSED_STEPS
    else:
        assert cfg.normalization_type != "LN" or cfg.norm_position != "pre" or cfg.gated_mlp \
            or cfg.positional_embedding_type == "shortformer"


@given(models(**wide(normalization_types=("RMS", "RMSPre", "LN"), **EVERY_ARCHITECTURE)))
def test_the_fused_rms_pass_is_taken_exactly_when_its_steps_apply_whatever_the_weights(model):
    """Equal bits alone cannot tell that the fused pass ran (the chain gives them too): a spy does."""
    cfg, sd = model
    calls = []
    original = fused_module._fused_rms_steps

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    fused_module._fused_rms_steps = spy
    try:
        _out, out_cfg = cm.process_weights(sd, cfg, refactor_factored_attn_matrices=False)
    finally:
        fused_module._fused_rms_steps = original
    assert bool(calls) == rms_fusable(cfg), (cfg.normalization_type, cfg.norm_position, cfg.applied)
    if rms_fusable(cfg):
        assert out_cfg.applied == FUSED_RMS_STEPS
        steps = [PIPELINE_STEPS[i] for i in (0, 1, 3)]  # RMSNorm does not center the writers
        assert _chain(sd, cfg, steps)[1].applied == FUSED_RMS_STEPS  # the chain applies the same steps


REFUSALS = [
    (dict(normalization_types=("RMS",), positional_embedding_types=("standard", "rotary")),
     dict(), "center_writing_weights", "center_writing_weights", "every reader sits behind a centering norm"),
    (dict(normalization_types=("LN",), norm_positions=("post",), positional_embedding_types=("standard", "rotary")),
     dict(center_writing_weights=False), "fold_ln", "fold_layer_norm", "pre-norm"),
    (dict(normalization_types=("LN", "LNPre", "RMS"), positional_embedding_types=("rotary",), gated_mlp=(False,)),
     dict(fold_ln=False, center_writing_weights=False, refactor_factored_attn_matrices=True),
     "refactor_factored_attn_matrices", "refactor_factored_attn_matrices", "keys and queries are not rotated by position"),
    (dict(normalization_types=("LN",), gated_mlp=(True,), attn_only=False, min_layers=1,
          positional_embedding_types=("standard",)),
     dict(), "fold_ln", "fold_layer_norm", "every reader has a bias to absorb b @ W"),
]


@pytest.mark.parametrize("options, flags, keyword, identity, precondition", REFUSALS,
                         ids=["center-writers-behind-rms", "fold-post-norm", "refactor-rotary", "ln-gated-mlp"])
@given(data=st.data())
def test_a_requested_step_that_cannot_apply_exactly_raises_its_own_error_and_the_default_leaves_it_out(
    options, flags, keyword, identity, precondition, data
):
    cfg, sd = data.draw(models(**wide(**options)))
    before = snapshot(sd)
    with pytest.raises(cm.PreconditionError) as info:
        cm.process_weights(sd, cfg, **(flags | {keyword: True}))
    assert (info.value.identity, info.value.precondition) == (identity, precondition)
    assert same(sd, before)
    for left_out in (None, "default"):  # the default applies what fits, like None
        asked = flags | {keyword: None} if left_out is None else {k: v for k, v in flags.items() if k != keyword}
        _processed, processed_cfg = cm.process_weights(sd, cfg, **asked)
        assert not RECORDS[keyword] & set(processed_cfg.applied)


@given(models(**wide(normalization_types=("LN", "RMS"), positional_embedding_types=("standard", "rotary"), gated_mlp=(False,))))
def test_a_step_already_applied_is_refused_when_asked_for_and_left_out_otherwise(model):
    cfg, sd = model
    processed, processed_cfg = cm.process_weights(sd, cfg, center_writing_weights=None)
    with pytest.raises(cm.AlreadyAppliedError):
        cm.process_weights(processed, processed_cfg, fold_ln=False, center_writing_weights=False,
                           center_unembed=False, fold_value_biases=True)
    with pytest.raises(cm.AlreadyAppliedError):
        cm.process_weights(processed, processed_cfg, fold_ln=True, center_writing_weights=False,
                           center_unembed=False, fold_value_biases=False)
    again, again_cfg = cm.process_weights(processed, processed_cfg)  # by default, what is done is left out
    assert again_cfg.applied == processed_cfg.applied


def test_the_keywords_are_the_steps_and_name_their_identities():
    """process_weights' keyword-only parameters are its steps' keywords, and each step's keyword is
    the name of the identity its transform applies (the norm fold's fold_ln aside), in the order applied."""
    keywords = [p.name for p in inspect.signature(cm.process_weights).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert sorted(keywords) == sorted(KEYWORDS)
    assert KEYWORDS[0] == "fold_ln" and [step.identity for _keyword, step in PIPELINE_STEPS[1:]] == KEYWORDS[1:]
    assert KEYWORDS == ["fold_ln", "fold_value_biases", "center_writing_weights", "center_unembed",
                        "refactor_factored_attn_matrices"]


@pytest.mark.parametrize("value", [1, 0, "yes", "if applicable"])
def test_flags_are_true_false_or_none(value):
    cfg = cm.Config(n_layers=1, d_model=4, n_heads=1, d_head=2, d_vocab=5, n_ctx=3)
    with pytest.raises(TypeError, match="center_unembed must be True, False or None"):
        cm.process_weights(cm.random_state_dict(cfg, seed=0), cfg, center_unembed=value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_processed_in_float32_and_rounded_once(dtype):
    """Rounded once at the end, the processed model is no further from the original than the
    original is from its own weights rounded once more: no error builds up over the steps."""
    cfg = cm.Config(n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=40, n_ctx=8, d_mlp=64)
    sd = cm.random_state_dict(cfg, seed=0, dtype=dtype)
    processed, processed_cfg = cm.process_weights(sd, cfg)
    assert {t.dtype for t in processed.values()} == {dtype}
    exact, exact_cfg = cm.process_weights({k: v.double() for k, v in sd.items()}, cfg)
    for name, tensor in processed.items():
        assert torch.equal(tensor, exact[name].to(dtype)) or (
            (tensor.double() - exact[name]).abs().max() <= 2 * torch.finfo(dtype).eps * exact[name].abs().max()
        ), name
    assert compare_log_probs(sd, cfg, processed, processed_cfg).passed


# -- negative controls: wrong pipelines the same check catches ----------------------------------

# A wrong order or a doubled gain only shows where gains are far from 1 and biases sizeable;
# no softmax may saturate (a saturated pattern is one-hot whatever its scores); d_model >= 3
# (behind a LayerNorm over two dimensions only the sign of the stream survives).
DISCRIMINATING_WEIGHTS = dict(min_gain_spread=0.4, min_bias_scale=0.5, max_outlier_scale=3.0)
DISCRIMINATING = {
    "center_readers_before_fold": dict(normalization_types=("LN",), gated_mlp=(False,)),
    "fold_gain_twice": dict(normalization_types=("LN", "RMS"), gated_mlp=(False,)),
    "value_biases_before_ln_fold": dict(normalization_types=("LN",), gated_mlp=(False,), min_layers=1),
    "center_readers_behind_rms_norm": dict(normalization_types=("RMS",)),
}


def test_every_numeric_twin_has_a_discriminating_strategy():
    assert set(DISCRIMINATING) == set(PIPELINE.wrong_everywhere)


@pytest.mark.parametrize("wrong_name", sorted(DISCRIMINATING))
@given(data=st.data())
def test_negative_control_wrong_pipeline_is_caught(wrong_name, data):
    cfg, sd = data.draw(
        models(**wide(weights=DISCRIMINATING_WEIGHTS, positional_embedding_types=("standard", "rotary"),
               **DISCRIMINATING[wrong_name])).filter(lambda model: model[0].d_model >= 3)
    )
    toks = default_tokens(cfg)
    assert_caught(PIPELINE, wrong_name, sd, cfg, toks, wrong_name, weights=VISIBLE)


@given(models(**wide(dtype=torch.float32, **FUSABLE)), st.data())
def test_a_nan_or_inf_anywhere_in_the_input_is_named_when_the_steps_run_fused(model, data):
    """The fused steps check only their output's entries: every input entry must reach one."""
    cfg, sd = model
    name = data.draw(st.sampled_from(sorted(sd)))
    bad = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    broken = dict(sd)
    broken[name] = sd[name].clone()
    broken[name].view(-1)[data.draw(st.integers(0, sd[name].numel() - 1))] = bad
    with fused_runs() as runs, pytest.raises(cm.StateDictError, match=rf"{name} has 1 NaN or Inf entries"):
        cm.process_weights(broken, cfg)
    assert runs == ["LN"]


def test_an_overflow_of_finite_weights_is_reported_as_such():
    cfg = cm.Config(n_layers=1, d_model=4, n_heads=1, d_head=2, d_vocab=5, n_ctx=3)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    sd["ln_final.w"] = torch.full((4,), 3e38)
    sd["unembed.W_U"] = sd["unembed.W_U"] * 1e10
    with pytest.raises(cm.StateDictError, match="overflowed torch.float32: the input is finite"):
        cm.process_weights(sd, cfg)


@pytest.mark.parametrize("normalization_type", ["LN", "RMS"])
def test_a_half_precision_rounding_that_overflows_is_refused(normalization_type):
    """The fused path computes a float16 model in float32: a folded reader finite in float32 but
    beyond float16's range when rounded must be refused, not returned with Inf entries (the
    in-cache sums are of the rounded outputs)."""
    cfg = cm.Config(n_layers=1, d_model=4, n_heads=1, d_head=2, d_vocab=5, n_ctx=3, normalization_type=normalization_type)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float16)
    sd["blocks.0.ln1.w"] = torch.full((4,), 300.0, dtype=torch.float16)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float16)[:, None]  # mean 0 over d_model
    sd["blocks.0.attn.W_Q"] = (300 * signs).expand_as(sd["blocks.0.attn.W_Q"]).clone()  # 300 * 300 > 65504
    assert all(torch.isfinite(t).all() for t in sd.values())
    with pytest.raises(cm.OverflowedError, match=r"overflowed torch.float16: .*blocks.0.attn.W_Q has 8 NaN or Inf"):
        cm.process_weights(sd, cfg)


@settings(max_examples=30, deadline=None)
@given(models(max_layers=3, min_layers=1, positional_embedding_types=("standard",), grouped_query=(False, True),
              norm_positions=("pre",)).filter(lambda model: fusable(model[0]) or rms_fusable(model[0])))
def test_the_refactor_after_the_fused_steps_is_the_whole_model_step(model):
    """After the fused steps the refactor runs a block at a time (so that one block, not the
    attention of the whole model, is held twice): the same bits as the public transform on the
    whole model."""
    cfg, sd = model
    got, got_cfg = cm.process_weights(sd, cfg, refactor_factored_attn_matrices=True)
    expected, expected_cfg = cm.refactor_factored_attn_matrices(*cm.process_weights(sd, cfg))
    assert got_cfg == expected_cfg
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("normalization_type", ["LN", "RMS"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_bits_do_not_depend_on_the_block_sizes_of_a_device(monkeypatch, normalization_type, dtype):
    """Off the CPU the fused steps cut weights into other blocks of rows (few, large ones): each
    block's rows are computed alone, and the unembed's products are summed in blocks of 64 rows
    as on the CPU, so the result has the same bits. Here the CPU computes with the blocks a GPU gets
    (the CPU's own kernels: this pins the blocking, not CUDA's reductions, which the suite checks
    under ``pytest --device cuda``; nor the single mixed-dtype kernel a GPU takes for an unscaled
    reader, which the CPU never takes)."""
    from circuitmath._processing import _memory, centering

    cfg = cm.Config(n_layers=2, d_model=192, n_heads=4, d_head=16, d_vocab=300, n_ctx=8, d_mlp=384,
                    normalization_type=normalization_type)
    sd = cm.random_state_dict(cfg, seed=0, dtype=dtype)
    with fused_runs() as runs:
        expected, _cfg = cm.process_weights(sd, cfg)

    def on_a_device(count, row_bytes, device, *, cpu_rows=None, staged=True):
        return _memory.rows_per_block(count, row_bytes, torch.device("meta"), staged=staged)

    monkeypatch.setattr(fused_module, "rows_per_block", on_a_device)
    monkeypatch.setattr(centering, "rows_per_block", on_a_device)
    with fused_runs() as more_runs:
        got, _cfg = cm.process_weights(sd, cfg)
    assert runs + more_runs == [normalization_type] * 2
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def test_leaving_out_sets_only_what_is_left_to_apply_where_it_can():
    """The whole model's decision that a part-at-a-time caller passes on: a step asked for "if
    applicable" (None, also by default) is left out as if it did not apply; asked for explicitly
    (True), it still applies; with nothing left out, as the keywords say."""
    cfg = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    sd = cm.random_state_dict(cfg, seed=0)
    left_out = frozenset({"center_writing_weights"})
    assert leaving_out({}, left_out)["center_writing_weights"] is False
    out = cm.process_weights(sd, cfg, **leaving_out({}, left_out))[1].applied
    asked = cm.process_weights(sd, cfg, **leaving_out({"center_writing_weights": True}, left_out))[1].applied
    assert "center_writing_weights" not in out and "center_unembed" in out
    assert "center_writing_weights" in asked
    assert cm.process_weights(sd, cfg, **leaving_out({}, frozenset()))[1].applied == FUSED_STEPS
    assert tuple(DEFAULTS) == STEPS  # one keyword per step, in the order applied
    assert DEFAULTS == {name: p.default for name, p in inspect.signature(cm.process_weights).parameters.items()
                        if name in DEFAULTS}


def test_the_steps_two_parts_differ_in_are_keywords_and_nothing_else_is_taken_for_one():
    """Two parts of a model that differ in a step name its keyword; an identity that is no step
    of process_weights cannot differ between parts, and is an internal error saying both records."""
    assert steps_between(("fold_layer_norm",), ("fold_layer_norm", "center_unembed")) == {"center_unembed"}
    assert steps_between(("fold_layer_norm",), ("fold_layer_norm",)) == frozenset()
    with pytest.raises(RuntimeError, match="parts of a model applied"):
        steps_between(("fold_layer_norm",), ("rotate_residual_stream",))
