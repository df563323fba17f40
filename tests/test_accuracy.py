"""The float64 accumulations of weight processing are measured, not assumed.

Each transform that promises to accumulate in float64 (the folded biases ``b @ W``, the value
biases through ``W_O``) or to process half precision in float32 is run on inputs where a lower
precision visibly loses: the result must equal the float64 computation rounded once.
"""

import math
import re

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from circuitmath import (
    CircuitMathError, Config, OverflowedError, PreconditionError, fold_layer_norm, identities, process_weights,
    random_state_dict,
)
from circuitmath._registry import AS_THE_FORWARD_PASS, COMPOSES, COMPUTES, MOVES_ENTRIES
from circuitmath._processing.steps import STEPS
from circuitmath.strategies import models
from circuitmath._processing.attention import value_bias_through_output
from circuitmath._processing.layer_norm import fold_reader
from circuitmath._processing.norms import uncentered_writers

BIG = 2.0**24  # float32 has 24 bits: BIG + 1 rounds back to BIG


def _cancelling_column(blocks: int, rows: int = 64) -> torch.Tensor:
    """``[blocks * rows, 1]`` float32 whose blocks of ``rows`` rows sum to BIG, 1, -BIG, 1, ...:
    each block's sum is exact in float32, their total (blocks / 2) is not."""
    W = torch.zeros(blocks * rows, 1)
    for k, value in enumerate([BIG, 1.0, -BIG, 1.0] * (blocks // 4)):
        W[rows * k, 0] = value
    return W


def test_folded_bias_sums_the_blocks_in_float64():
    W = _cancelling_column(16)
    ones = torch.ones(W.shape[0])
    assert float(W.sum()) != 8.0 or float(ones @ W) != 8.0  # float32 loses here...
    _folded, bias = fold_reader(W, ones, ones, torch.zeros(1), center=False)
    assert bias.dtype == torch.float32 and float(bias) == 8.0  # ...the fold does not


def test_folded_and_centered_reader_uses_the_float64_mean():
    W = _cancelling_column(16)
    ones = torch.ones(W.shape[0])
    folded, _bias = fold_reader(W, ones, ones, None, center=True)
    exact = W.double() - W.double().mean(dim=0)  # the mean is 8 / 1024; float32's is not
    # the exact centering rounded once to float32, bit for bit (the zero rows become -8/1024):
    # a float32 mean, no centering or a mean subtracted twice each fail here
    assert torch.equal(folded, exact.float())


def test_value_biases_reach_b_O_through_a_float64_sum():
    W_O = torch.tensor([[[BIG]], [[1.0]], [[-BIG]], [[1.0]]])  # [n_heads, d_head, d_model]
    b_V = torch.ones(4, 1)
    total = value_bias_through_output(b_V, W_O)
    assert total.dtype == torch.float64 and float(total) == 2.0


def _ulps_from(x: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest |x - exact| in units of the last place of ``exact`` in ``dtype`` (subnormals included)."""
    finfo = torch.finfo(dtype)
    spacing = (exact.abs().clamp_min(finfo.tiny).log2().floor() + math.log2(finfo.eps)).exp2()
    return float(((x.double() - exact) / spacing).abs().max())


def test_half_precision_is_processed_in_float32_and_rounded_once():
    cfg = Config(n_layers=2, d_model=64, n_heads=4, d_head=16, d_vocab=50, n_ctx=8, d_mlp=128)
    half = {k: v.to(torch.bfloat16) for k, v in random_state_dict(cfg, seed=0, dtype=torch.float64).items()}
    exact, _ = process_weights({k: v.double() for k, v in half.items()}, cfg)
    got, _ = process_weights(half, cfg)
    worst = max(_ulps_from(got[k], exact[k], torch.bfloat16) for k in got)
    # Rounded once from float32 processing: half an ulp of bfloat16 plus float32's own error.
    # Processing in bfloat16 itself was measured at about 800 ulps on this model.
    assert worst <= 1.0, worst


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("center", [False, True])
def test_fold_layer_norm_on_its_own_rounds_half_precision_once(dtype, center):
    """The public transform, not the fused pipeline: in half precision its folded biases are the
    float64 ``b_W + b @ W`` rounded once (its blocks were summed in the weights' dtype, 285 ulps
    off in float16 on this model), and its weights the float32 fold rounded once (the centered
    ones rounded the mean to half precision first)."""
    cfg = Config(n_layers=2, d_model=256, n_heads=4, d_head=64, d_vocab=300, n_ctx=8, d_mlp=512)
    half = {k: v.to(dtype) for k, v in random_state_dict(cfg, seed=0, dtype=torch.float64).items()}
    got, _ = fold_layer_norm(half, cfg, center_reading_weights=center)
    in_float32, _ = fold_layer_norm({k: v.float() for k, v in half.items()}, cfg, center_reading_weights=center)
    exact, _ = fold_layer_norm({k: v.double() for k, v in half.items()}, cfg, center_reading_weights=center)
    biases = [name for name in got if ".b_" in name]
    assert len(biases) == 13 and all(got[name].dtype == dtype for name in got)
    # half an ulp, plus what the float32 sums of 64 terms may move a result near a tie
    assert max(_ulps_from(got[name], exact[name], dtype) for name in biases) <= 0.51
    assert all(torch.equal(got[name], in_float32[name].to(dtype)) for name in got if name not in biases)


_HALF_MODELS = {
    "LN": Config(n_layers=2, d_model=256, n_heads=4, d_head=64, d_vocab=300, n_ctx=8, d_mlp=512),
    "RMS": Config(n_layers=2, d_model=256, n_heads=4, d_head=64, d_vocab=300, n_ctx=8, d_mlp=512,
                  normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
                  n_key_value_heads=2, act_fn="silu"),
}
_HALF_MODELS["shortformer"] = _HALF_MODELS["LN"].replace(positional_embedding_type="shortformer")
_HALF_MODELS["RMSPre"] = _HALF_MODELS["RMS"].replace(normalization_type="RMSPre")
_HALF_MODELS["LNPre"] = _HALF_MODELS["LN"].replace(normalization_type="LNPre")
_HALF_MODELS["eps 0"] = _HALF_MODELS["LN"].replace(eps=0.0)
_HALF_MODELS["logit scale"] = _HALF_MODELS["RMS"].replace(logit_scale=0.0625 * 1.1)
_HALF_MODELS["experts"] = _HALF_MODELS["RMS"].replace(n_experts=4, experts_per_token=2)


def _half_precision(identity, dtype):
    """For each model of :data:`_HALF_MODELS` that ``identity`` applies to (after its own
    preparation, in float64): that float64 model, its config, the model in ``dtype`` and its
    transform."""
    out = []
    for cfg in _HALF_MODELS.values():
        try:
            before, before_cfg = identity.prepared(random_state_dict(cfg, seed=0, dtype=torch.float64), cfg)
            half = {k: v.to(dtype) for k, v in before.items()}
            got, _ = identity.transform(half, before_cfg)
        except PreconditionError:
            continue
        out.append((before, before_cfg, half, got))
    return out


_DECLARED = [identity for identity in identities() if identity.compare is None]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("identity", [i for i in _DECLARED if i.half_precision == COMPUTES], ids=lambda i: i.name)
def test_each_identity_that_computes_rounds_half_precision_once(identity, dtype):
    """Every weight identity that computes (the registry says which), given half-precision
    weights, returns entry by entry their float64 transform rounded once, up to what float32
    arithmetic may move a result that cancels (measured at most 0.51 ulp here), on every model of
    :data:`_HALF_MODELS` it applies to (at least one). A mean rounded to half precision before it
    is subtracted is 255 ulps off in bfloat16, tables summed in float32 1.27 ulps in float16."""
    runs = _half_precision(identity, dtype)
    assert runs, f"{identity.name} applies to none of the half-precision models"
    for _before, cfg, half, got in runs:
        exact, _ = identity.transform({k: v.double() for k, v in half.items()}, cfg)
        changed = [name for name in got if got[name] is not half.get(name)]
        assert changed and all(got[name].dtype == dtype for name in got)
        assert max(_ulps_from(got[name], exact[name], dtype) for name in changed) <= 0.6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("identity", [i for i in _DECLARED if i.half_precision == MOVES_ENTRIES], ids=lambda i: i.name)
def test_each_identity_that_moves_entries_is_exact_in_half_precision(identity, dtype):
    """A weight identity that only copies, permutes or zeroes entries commutes with rounding: in
    half precision it gives bit for bit its float64 result rounded (on the float64 model: a
    precondition checked to the dtype's rounding may refuse the rounded weights in float64)."""
    runs = _half_precision(identity, dtype)
    assert runs, f"{identity.name} applies to none of the half-precision models"
    for before, cfg, _half, got in runs:
        exact, _ = identity.transform(before, cfg)
        assert got.keys() == exact.keys() and all(torch.equal(got[k], exact[k].to(dtype)) for k in got)


def test_every_weight_identity_declares_its_half_precision_behaviour():
    """Registry guard: each weight identity says what its transform does in half precision; the
    ones that compose others (``process_weights``: :func:`test_half_precision_is_processed_in_float32_and_rounded_once`)
    are measured through the identities they compose, the ones that round as the forward pass does
    (``fold_embedding_scale``) bit for bit against it by their own tests."""
    assert all(identity.half_precision in (COMPUTES, MOVES_ENTRIES, COMPOSES, AS_THE_FORWARD_PASS)
               for identity in _DECLARED)


def test_negative_control_a_mean_rounded_to_half_precision_is_caught():
    """What the 0.6-ulp bound rejects: centering the unembed with its mean computed in bfloat16."""
    cfg = _HALF_MODELS["LN"]
    half = {k: v.to(torch.bfloat16) for k, v in random_state_dict(cfg, seed=0, dtype=torch.float64).items()}
    W_U = half["unembed.W_U"]
    exact = W_U.double() - W_U.double().mean(dim=-1, keepdim=True)
    assert _ulps_from(W_U - W_U.mean(dim=-1, keepdim=True), exact, torch.bfloat16) > 0.6


def test_float32_processing_stays_close_to_float64():
    cfg = Config(n_layers=2, d_model=256, n_heads=4, d_head=64, d_vocab=300, n_ctx=8, d_mlp=512)
    sd = random_state_dict(cfg, seed=1, dtype=torch.float32)
    exact, _ = process_weights({k: v.double() for k, v in sd.items()}, cfg)
    got, _ = process_weights(sd, cfg)
    scale = max(float(v.abs().max()) for v in exact.values())
    worst = max(float((got[k].double() - exact[k]).abs().max()) for k in got) / scale
    # Every output is a short float64 accumulation rounded to float32, or a float32 difference
    # of two float32 values (centering): a few units of float32 roundoff relative to the weights.
    assert worst <= 8 * torch.finfo(torch.float32).eps, worst


def test_uncentered_writers_reports_each_mean_over_d_model():
    cfg = Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
    sd = random_state_dict(cfg, seed=0, dtype=torch.float64)
    sd = {k: v - v.mean(dim=-1, keepdim=True) if v.shape[-1] == cfg.d_model else v for k, v in sd.items()}
    sd["blocks.0.attn.b_O"] = sd["blocks.0.attn.b_O"] + 0.5
    assert uncentered_writers(sd, cfg) == {"blocks.0.attn.b_O": pytest_approx(0.5)}


def pytest_approx(value):
    import pytest

    return pytest.approx(value, rel=1e-12)


def test_refactored_float32_factors_keep_their_products_to_rounding():
    """The SVD factors are computed in float64 and rounded once: the products ``W_Q W_K^T`` and
    ``W_V W_O`` (biases as an extra row) move by under 1.5 float32 epsilons of their size
    (measured 0.44; factors computed in float32 move them by 3 to 5)."""
    from circuitmath import refactor_factored_attn_matrices

    cfg = Config(n_layers=1, d_model=64, n_heads=4, d_head=16, d_vocab=50, n_ctx=8, d_mlp=128)
    sd = random_state_dict(cfg, seed=0, dtype=torch.float32)
    out, _ = refactor_factored_attn_matrices(sd, cfg)
    p = "blocks.0.attn"

    def extended(s, side):
        return torch.cat([s[f"{p}.W_{side}"].double(), s[f"{p}.b_{side}"].double()[:, None, :]], dim=1)

    products = {
        "QK": lambda s: extended(s, "Q") @ extended(s, "K").transpose(-1, -2),
        "OV": lambda s: extended(s, "V") @ s[f"{p}.W_O"].double(),
    }
    for name, product in products.items():
        reference = product(sd)
        error = float((product(out) - reference).abs().max()) / float(reference.abs().max())
        assert error <= 1.5 * torch.finfo(torch.float32).eps, (name, error)


_STEP_CHOICES = st.sampled_from([
    {},  # the defaults: fused on a pre-LN model, a part at a time on any other
    dict.fromkeys(STEPS),  # every step where it applies: the refactor needs the parts
    {"fold_ln": True, "fold_value_biases": False, "center_writing_weights": False, "center_unembed": False},
])


@settings(max_examples=150, deadline=None)
@given(models(max_layers=3, min_layers=0, grouped_query=(False, True), norm_positions=("pre", "post"),
              dtype=torch.float32),
       st.sampled_from([torch.bfloat16, torch.float16]), _STEP_CHOICES)
def test_half_precision_equals_float32_processing_rounded_once(model, dtype, keywords):
    """Without a float32 copy of the model (fused a tensor at a time, or a part at a time), half
    precision gets exactly the float32 processing of the same weights, rounded once; a refusal
    is the same refusal."""
    cfg, sd = model
    half = {k: v.to(dtype) for k, v in sd.items()}
    try:
        expected, expected_cfg = process_weights({k: v.float() for k, v in half.items()}, cfg, **keywords)
    except CircuitMathError as error:
        event(f"refused: {type(error).__name__}")
        with pytest.raises(type(error)) as raised:
            process_weights(half, cfg, **keywords)
        assert str(raised.value) == str(error) or isinstance(error, OverflowedError)
        return
    got, got_cfg = process_weights(half, cfg, **keywords)
    event(f"processed, fused={expected_cfg.applied[:1] == ('fold_layer_norm',) and not keywords}")
    assert got_cfg == expected_cfg
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, expected[name].to(dtype)), name


def test_half_precision_blocks_run_fused_in_their_dtype_when_nothing_follows():
    """Every step left to apply where it can, on a rotary pre-RMSNorm model: the refactor is
    refused (the ends say so), so each block runs the fused steps in bfloat16 itself (W_O, which
    they pass through, comes back as the very tensor given, not a float32 round trip), with the
    bits of float32 processing rounded once."""
    cfg = Config(n_layers=2, d_model=8, n_heads=4, d_head=2, d_vocab=11, n_ctx=5, d_mlp=16, normalization_type="RMS",
                 positional_embedding_type="rotary", gated_mlp=True, n_key_value_heads=2, act_fn="silu")
    half = random_state_dict(cfg, seed=1, dtype=torch.bfloat16)
    expected, expected_cfg = process_weights({k: v.float() for k, v in half.items()}, cfg, **dict.fromkeys(STEPS))
    got, got_cfg = process_weights(half, cfg, **dict.fromkeys(STEPS))
    assert got_cfg == expected_cfg and "refactor_factored_attn_matrices" not in got_cfg.applied
    assert all(torch.equal(got[k], expected[k].to(torch.bfloat16)) for k in expected)
    assert all(got[f"blocks.{layer}.attn.W_O"] is half[f"blocks.{layer}.attn.W_O"] for layer in range(2))


def test_half_precision_equality_is_able_to_fail():
    """Negative control: rounding twice (after each step) is caught by the comparison above."""
    cfg = Config(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=20, n_ctx=4, d_mlp=32)
    half = {k: v.to(torch.bfloat16) for k, v in random_state_dict(cfg, seed=3, dtype=torch.float32).items()}
    once, _ = process_weights({k: v.float() for k, v in half.items()}, cfg)
    folded, folded_cfg = fold_layer_norm(half, cfg, center_reading_weights=True)  # rounded after the fold...
    twice, _ = process_weights(folded, folded_cfg)  # ...and again after the rest
    assert any(not torch.equal(twice[k], once[k].to(torch.bfloat16)) for k in twice)


def _rms_chain(sd, cfg):
    """The public transforms that process_weights applies by default to a pre-RMSNorm model."""
    from circuitmath import center_unembed, fold_rms_norm, fold_value_biases

    for step in (fold_rms_norm, fold_value_biases, center_unembed):
        sd, cfg = step(sd, cfg)
    return sd, cfg


_PRE_RMS = dict(normalization_types=("RMS",), norm_positions=("pre",), positional_embedding_types=("standard", "rotary"))


@settings(max_examples=60, deadline=None)
@given(models(max_layers=2, min_layers=0, grouped_query=(False, True), dtype=torch.float32, **_PRE_RMS),
       st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]))
def test_the_fused_rms_steps_are_the_chains_bits(model, dtype):
    """Fused (``fused._fused_rms_steps``), a pre-RMSNorm model gets the chain's weights bit for
    bit: in its own dtype for float32 and float64, the chain in float32 rounded once for half
    precision; the input is left as it was."""
    cfg, sd = model
    sd = {k: v.to(dtype) for k, v in sd.items()}
    kept = {k: v.clone() for k, v in sd.items()}
    compute = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    try:
        expected, expected_cfg = _rms_chain({k: v.to(compute) for k, v in sd.items()}, cfg)
    except CircuitMathError as error:  # a half model whose float32 processing overflows when rounded
        event(f"refused: {type(error).__name__}")
        return
    try:
        got, got_cfg = process_weights(sd, cfg)
    except OverflowedError:
        assert any(not torch.isfinite(t.to(dtype)).all() for t in expected.values())
        return
    assert got_cfg == expected_cfg and set(got) == set(expected)
    for name, tensor in got.items():
        assert tensor.dtype == dtype and torch.equal(tensor, expected[name].to(dtype)), name
    assert all(torch.equal(sd[k], kept[k]) for k in kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_rms_unembed_keeps_the_chains_row_means_past_a_reduction_grain(dtype):
    """A vocabulary beyond torch's parallel grain (32768) and a d_model leaving a 1-row last
    block (merged into the previous one, see ``_row_blocks``), at 2 threads: the vocabulary mean
    of each row is the chain's, bit for bit. Negative control: leaving out the centering differs."""
    cfg = Config(n_layers=1, d_model=17, n_heads=2, d_head=4, d_vocab=40001, n_ctx=4, d_mlp=8, normalization_type="RMS",
                 gated_mlp=True, act_fn="silu", n_key_value_heads=1, positional_embedding_type="rotary")
    sd = {k: v.to(dtype) for k, v in random_state_dict(cfg, seed=2, dtype=torch.float32).items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, _ = process_weights(sd, cfg)
        expected, _ = _rms_chain({k: v.float() for k, v in sd.items()}, cfg)
    finally:
        torch.set_num_threads(threads)
    for name in got:
        assert torch.equal(got[name], expected[name].to(dtype)), name
    from circuitmath import fold_rms_norm

    uncentered, _ = fold_rms_norm({k: v.float() for k, v in sd.items()}, cfg)
    assert not torch.equal(got["unembed.W_U"], uncentered["unembed.W_U"].to(dtype))


@settings(max_examples=40, deadline=None)
@given(models(max_layers=2, grouped_query=(False, True), dtype=torch.float32, **_PRE_RMS), st.data())
def test_a_nan_or_inf_anywhere_in_the_input_is_named_when_the_rms_steps_run_fused(model, data):
    """The fused steps check only their output's entries (tensors passed through included):
    every input entry must reach one."""
    from circuitmath import StateDictError

    cfg, sd = model
    name = data.draw(st.sampled_from(sorted(sd)))
    broken = dict(sd)
    broken[name] = sd[name].clone()
    broken[name].view(-1)[data.draw(st.integers(0, sd[name].numel() - 1))] = data.draw(
        st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    with pytest.raises(StateDictError, match=re.escape(name) + " has 1 NaN or Inf entries"):
        process_weights(broken, cfg)


def grouped(groups):
    """The fused passes run with ``groups(n_layers)`` as their groups of layers."""
    from unittest import mock

    from circuitmath._processing import fused

    return mock.patch.object(fused, "layer_groups", lambda cfg, sd: groups(cfg.n_layers))


_ALL_AT_ONCE = lambda n: [range(n)] if n else []  # noqa: E731
_PAIRS = lambda n: [range(i, min(i + 2, n)) for i in range(0, n, 2)]  # noqa: E731


@settings(max_examples=60, deadline=None)
@given(models(max_layers=3, min_layers=0, grouped_query=(False, True), dtype=torch.float32,
              normalization_types=("LN", "RMS"), norm_positions=("pre",), positional_embedding_types=("standard", "rotary")),
       st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from([_ALL_AT_ONCE, _PAIRS]))
def test_the_fused_passes_give_the_same_bits_a_group_of_layers_at_a_time(model, dtype, groups):
    """What a GPU runs (several layers' tensors stacked, rewritten in place, each output a view
    of its layer's slice): on the CPU bit for bit the one-layer-at-a-time outputs, the same
    record, and the input left as it was. On a GPU (``--device cuda``) the matrix library picks
    its kernels by the batch's shape, so stacked products may add their terms in another order:
    there the outputs agree to the rounding of those sums (8 units in the last place per term of
    the longest, as ``tests/test_pipeline.py`` allows the fused pass against the chain)."""
    cfg, sd = model
    sd = {k: v.to(dtype) for k, v in sd.items()}
    kept = {k: v.clone() for k, v in sd.items()}
    try:
        expected, expected_cfg = process_weights(sd, cfg)
    except CircuitMathError as error:
        event(f"refused: {type(error).__name__}")
        return
    with grouped(groups):
        got, got_cfg = process_weights(sd, cfg)
    assert got_cfg == expected_cfg and list(got) == list(expected)
    on_cpu = next(iter(sd.values())).device.type == "cpu"
    allowance = 8 * torch.finfo(dtype).eps * max(cfg.d_model, cfg.d_vocab)
    for name, tensor in got.items():
        assert tensor.dtype == dtype and tensor.device == expected[name].device, name
        gap = (tensor.double() - expected[name].double()).abs().max() / max(1.0, expected[name].double().abs().max())
        assert torch.equal(tensor, expected[name]) if on_cpu else gap <= allowance, (name, float(gap))
    assert all(torch.equal(sd[k], kept[k]) for k in kept)


def _first_layers_gains(fused):
    per_layer = fused._per_layer
    return "_per_layer", lambda v, W: per_layer(v[:1].expand_as(v), W)


def _first_layers_W_O(fused):
    with_value_bias = fused._with_value_bias
    return "_with_value_bias", lambda b_O, b_V, W_O: with_value_bias(b_O, b_V, W_O[:1].expand_as(W_O))


@pytest.mark.parametrize("normalization_type, slip, slipped", [
    ("LN", _first_layers_gains, {"blocks.1.attn.W_Q", "blocks.2.mlp.W_in"}),
    ("RMS", _first_layers_W_O, {"blocks.1.attn.b_O", "blocks.2.attn.b_O"}),
])
def test_grouped_layers_that_read_the_first_layers_tensors_are_told_apart(normalization_type, slip, slipped, monkeypatch):
    """Negative control: stacked layers each folded with the first layer's norm (LayerNorm), or
    each value bias carried through the first layer's ``W_O`` (RMSNorm, whose readers are not
    stacked): slips the comparison above must catch."""
    from circuitmath._processing import fused

    cfg = Config(n_layers=3, d_model=16, n_heads=2, d_head=4, d_vocab=12, n_ctx=4, d_mlp=24,
                 normalization_type=normalization_type)
    sd = random_state_dict(cfg, seed=3)
    expected, _ = process_weights(sd, cfg)
    monkeypatch.setattr(fused, *slip(fused))
    with grouped(_ALL_AT_ONCE):
        got, _ = process_weights(sd, cfg)
    differ = {name for name in expected if not torch.equal(got[name], expected[name])}
    assert slipped <= differ and not any(name.startswith("blocks.0.") for name in differ), sorted(differ)


def test_a_step_after_the_fused_ones_gets_each_layers_outputs_in_tensors_of_their_own():
    """The refactor replaces the blocks one at a time after the fused steps, dropping each
    block's tensors as it goes: stacked layers (what a GPU runs, forced here) would keep every
    layer's memory until the last view goes, so then the fused steps run a layer at a time. The
    same call without the refactor shows the stacking is in force."""
    cfg = Config(n_layers=3, d_model=16, n_heads=2, d_head=4, d_vocab=12, n_ctx=4, d_mlp=24)
    sd = random_state_dict(cfg, seed=5)

    def storages(out):
        return {name: t.untyped_storage().data_ptr() for name, t in out.items() if name.startswith("blocks.")}

    with grouped(_ALL_AT_ONCE):
        stacked, _ = process_weights(sd, cfg)
        refactored, _ = process_weights(sd, cfg, refactor_factored_attn_matrices=True)
    assert len(set(storages(stacked).values())) < len(storages(stacked))
    fused_outputs = {n: p for n, p in storages(refactored).items() if not n.endswith(("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V"))}
    assert len(set(fused_outputs.values())) == len(fused_outputs)
