"""Rotating the residual stream, permuting heads and neurons, and recognising each from the weights."""

import dataclasses

import pytest
import sympy
import torch
from hypothesis import given, reject, strategies as st

import circuitmath as cm
from circuitmath import zoo
from circuitmath._identities.rotation import check_rotation, slicegpt_route, to_rms_pre
from circuitmath._processing._orthogonal import block_orthogonal
from circuitmath._processing.rotation import (
    ORTHOGONALITY_SAFETY,
    rotated_tensors,
    hadamard,
    orthogonal_fixing_ones,
    orthogonality_error,
    random_orthogonal,
    residual_readers,
    residual_writers,
    rotation_mismatches,
)
from circuitmath.strategies import models, tokens
from circuitmath.testing import compare_log_probs
from support import VISIBLE, assume_above, on_meta_by_default, same, snapshot, wide

NAMES = ("rms_norm_rotation", "layer_norm_rotation", "rotate_residual_stream", "slicegpt_route", "permute_heads",
         "permute_neurons")
WITHOUT_GAINS = dict(normalization_types=("RMS", "RMSPre", None))


def _cfg(**changes):
    base = dict(n_layers=2, d_model=8, n_heads=4, d_head=2, d_vocab=11, n_ctx=5, d_mlp=6)
    return cm.Config(**(base | changes))


def _rms_model(dtype=torch.float64, seed=0, **changes):
    """A model with RMSPre norms: LayerNorm folded, centered and switched, or (gated MLPs, whose
    W_gate has no bias to absorb a LayerNorm's) RMSNorm folded."""
    if changes.get("gated_mlp"):
        changes.setdefault("normalization_type", "RMS")
    cfg = _cfg(**changes)
    return to_rms_pre(cm.random_state_dict(cfg, seed=seed, dtype=dtype), cfg)


def _prepared(model):
    """The model with RMSPre norms (or none), or a hypothesis rejection when it cannot get there."""
    cfg, sd = model
    try:
        return to_rms_pre(sd, cfg)
    except cm.PreconditionError:
        reject()


@pytest.mark.parametrize("name", NAMES)
def test_registered_with_symbolic_proofs_and_every_twin_rejected(name):
    identity = cm.get_identity(name)
    assert identity.proof.symbolic_dims
    report = identity.prove()
    assert report.ok, report.as_dict()
    # report.ok counts the twins the report holds: each of the proof's must be among them, rejected
    assert [t.name for t in report.twins] == [t.name for t in identity.proof.twins]
    assert all(t.rejected for t in report.twins)


# -- rms_norm_rotation: a computation, so tests/test_weight_identities.py does not run it -------
# Its computation takes the final residual stream x, the rotation and eps, not a model: the
# registry-driven controls of tests/test_circuit_identities.py cannot run it, so it is checked
# here (that module's guard names this test).

RMS_NORM_ROTATION = cm.get_identity("rms_norm_rotation")


def _norm_results(name, sd, cfg, toks):
    """``RMSPre(x)`` as the exact computation and as the wrong rewrite ``name`` compute it, on the
    final residual stream of ``sd`` on ``toks``."""
    record = {}
    cm.forward(sd, cfg, toks, record=record)
    x = record["final_residual"]
    Q = check_rotation(cfg).dense().to(x.dtype)
    return (RMS_NORM_ROTATION.transform(x, Q, cfg.eps),
            RMS_NORM_ROTATION.wrong_rewrites[name].function(x, Q, cfg.eps))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@given(data=st.data())
def test_rms_norm_rotation_check_passes(dtype, data):
    cfg, sd = data.draw(models(**wide(dtype=dtype)))
    result = RMS_NORM_ROTATION.check(sd, cfg, data.draw(tokens(cfg)))
    assert result.passed, result


@pytest.mark.parametrize("wrong_name", sorted(RMS_NORM_ROTATION.wrong_rewrites))
@given(data=st.data())
def test_rms_norm_rotation_rejects_each_wrong_rewrite(wrong_name, data):
    """Its own numeric check, run on each wrong rewrite, fails wherever the wrong result is
    measurably another (a stream of zeros is normed to zeros by every rewrite)."""
    cfg, sd = data.draw(models(**wide(dtype=torch.float64)))
    if wrong_name not in RMS_NORM_ROTATION.wrong_rewrites_for(cfg):
        reject()
    toks = data.draw(tokens(cfg))
    exact, wrong = _norm_results(wrong_name, sd, cfg, toks)
    scale = max(float(exact.abs().max()), float(wrong.abs().max()), torch.finfo(torch.float64).tiny)
    change = float((wrong - exact).abs().max()) / scale
    assume_above(f"{wrong_name}: relative change of RMSPre(x)", change, VISIBLE)
    result = RMS_NORM_ROTATION.check_wrong_rewrite(wrong_name, sd, cfg, toks)
    assert not result.passed, f"{wrong_name} went unnoticed: {result}"


# -- rotate_residual_stream -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@given(data=st.data())
def test_rotation_preserves_log_probs(dtype, data):
    sd, cfg = _prepared(data.draw(models(**wide(dtype=dtype, **WITHOUT_GAINS))))
    Q = random_orthogonal(cfg.d_model, seed=data.draw(st.integers(0, 2**16)))
    rotated, rotated_cfg = cm.rotate_residual_stream(sd, cfg, Q)
    result = compare_log_probs(sd, cfg, rotated, rotated_cfg, data.draw(tokens(cfg)))
    assert result.passed, result


@given(models(**wide(dtype=torch.float32, **WITHOUT_GAINS)))
def test_rotation_is_pure_keeps_dtypes_and_may_be_applied_twice(model):
    sd, cfg = _prepared(model)
    before = snapshot(sd)
    Q1, Q2 = random_orthogonal(cfg.d_model, seed=1), random_orthogonal(cfg.d_model, seed=2)
    once, once_cfg = cm.rotate_residual_stream(sd, cfg, Q1)
    assert same(sd, before)
    assert once_cfg.applied == cfg.applied + ("rotate_residual_stream",)
    assert {t.dtype for t in once.values()} <= {torch.float32}
    cm.validate_state_dict(once, once_cfg)
    moved = set(residual_writers(cfg)) | set(residual_readers(cfg))
    assert all(once[k] is sd[k] for k in sd if k not in moved), "unrotated tensors are shared"
    twice, twice_cfg = cm.rotate_residual_stream(once, once_cfg, Q2)
    assert twice_cfg.applied.count("rotate_residual_stream") == 2
    product, _ = cm.rotate_residual_stream(sd, cfg, Q1 @ Q2)
    for name in sd:
        assert torch.allclose(twice[name].double(), product[name].double(), rtol=1e-4, atol=1e-4), name


def test_rotation_keeps_bfloat16():
    sd, cfg = _rms_model(torch.bfloat16, gated_mlp=True, n_key_value_heads=2)
    out, _ = cm.rotate_residual_stream(sd, cfg, hadamard(cfg.d_model))
    assert {t.dtype for t in out.values()} == {torch.bfloat16}
    assert {t.device for t in out.values()} == {torch.device("cpu")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rotation_and_permutations_keep_the_device():
    sd, cfg = _rms_model(torch.float32)
    sd = {k: v.cuda() for k, v in sd.items()}
    Q = random_orthogonal(cfg.d_model, seed=0)  # on the CPU: moved to the weights' device
    out, _ = cm.rotate_residual_stream(sd, cfg, Q)
    assert {t.device.type for t in out.values()} == {"cuda"}
    assert cm.recover_rotation(sd, out, cfg) is not None
    heads, _ = cm.permute_heads(sd, cfg, _reversed_heads(cfg))
    neurons, _ = cm.permute_neurons(sd, cfg, torch.arange(cfg.d_mlp).flip(0))
    assert {t.device.type for t in (*heads.values(), *neurons.values())} == {"cuda"}
    assert cm.recover_head_permutation(sd, heads, cfg) is not None


def test_rotation_and_permutations_make_no_tensor_on_the_default_device():
    """The CPU stand-in for the CUDA test above: with the default device set to ``meta``, a
    tensor made without ``device=`` would not meet the weights' (see tests/test_devices.py)."""
    sd, cfg = _rms_model(torch.float32)
    Q, heads_order, neurons_order = random_orthogonal(cfg.d_model, seed=5), _reversed_heads(cfg), torch.arange(cfg.d_mlp).flip(0)

    def everything():
        rotated, _ = cm.rotate_residual_stream(sd, cfg, Q)
        heads, _ = cm.permute_heads(sd, cfg, heads_order)
        neurons, _ = cm.permute_neurons(sd, cfg, neurons_order)
        return (rotated, heads, neurons), (cm.recover_rotation(sd, rotated, cfg), cm.recover_head_permutation(sd, heads, cfg),
                                           cm.recover_neuron_permutation(sd, neurons, cfg))

    outputs, recovered = on_meta_by_default(everything)
    assert {t.device.type for out in outputs for t in out.values()} == {"cpu"}
    assert all(r is not None for r in recovered)


def _reversed_heads(cfg):
    return torch.arange(cfg.n_heads).flip(0)


@pytest.mark.parametrize("changes", [
    dict(gated_mlp=True, normalization_type="RMS", act_fn="silu"),
    dict(n_key_value_heads=2),
    dict(parallel_attn_mlp=True),
    dict(positional_embedding_type="rotary"),
    dict(d_mlp=None),
    dict(normalization_type=None),
], ids=["gated", "grouped_query", "parallel", "rotary", "attn_only", "no_norm"])
def test_every_architecture_option_rotates_exactly(changes):
    sd, cfg = _rms_model(**changes)
    for Q in (random_orthogonal(cfg.d_model, seed=3), hadamard(cfg.d_model)):
        out, out_cfg = cm.rotate_residual_stream(sd, cfg, Q)
        result = compare_log_probs(sd, cfg, out, out_cfg)
        assert result.passed, (changes, result)
        # and the rotation was not a no-op
        assert not torch.allclose(out["embed.W_E"], sd["embed.W_E"])


def test_shortformer_W_pos_is_rotated_with_the_normed_stream():
    """W_pos is added to ln1's output, which the rotation rotates: W_pos Q keeps the queries and keys."""
    cfg = _cfg(positional_embedding_type="shortformer", normalization_type="RMSPre")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    Q = random_orthogonal(cfg.d_model, seed=0)
    out, out_cfg = cm.rotate_residual_stream(sd, cfg, Q)
    assert compare_log_probs(sd, cfg, out, out_cfg).passed
    forgot = dict(out, **{"pos_embed.W_pos": sd["pos_embed.W_pos"]})
    wrong = compare_log_probs(sd, cfg, forgot, out_cfg)
    assert wrong.max_abs_error > 1e6 * wrong.tolerance, wrong


@pytest.mark.parametrize("kind, fix", [("LN", "fold_layer_norm"), ("RMS", "fold_rms_norm")])
def test_norms_with_gains_are_refused_naming_the_fix(kind, fix):
    cfg = _cfg(normalization_type=kind)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    before = snapshot(sd)
    with pytest.raises(cm.PreconditionError, match=fix) as info:
        cm.rotate_residual_stream(sd, cfg, random_orthogonal(cfg.d_model, seed=0))
    assert info.value.identity == "rotate_residual_stream"
    assert info.value.precondition == "no norm gain or bias between the stream and its readers"
    assert same(sd, before)


def test_refusing_a_gain_is_not_a_formality():
    """Rotating an RMS model with its gains in place changes it by O(1)."""
    cfg = _cfg(normalization_type="RMS")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    wrong = dict(sd) | rotated_tensors(sd, cfg, random_orthogonal(cfg.d_model, seed=0))
    result = compare_log_probs(sd, cfg, wrong, cfg)
    assert result.max_abs_error > 1e6 * result.tolerance, result


def test_post_norm_is_refused():
    cfg = _cfg(norm_position="post", normalization_type="RMSPre")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    with pytest.raises(cm.PreconditionError, match="pre-norm"):
        cm.rotate_residual_stream(sd, cfg, random_orthogonal(cfg.d_model, seed=0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_orthogonality_tolerance_is_pinned(dtype):
    """A QR-orthogonal Q passes; the same Q off by a few times the tolerance is refused."""
    sd, cfg = _rms_model(dtype)
    Q = torch.linalg.qr(torch.randn(cfg.d_model, cfg.d_model, dtype=dtype, generator=torch.Generator().manual_seed(0)))[0]
    cm.rotate_residual_stream(sd, cfg, Q)
    tolerance = ORTHOGONALITY_SAFETY * cfg.d_model * torch.finfo(dtype).eps
    stretched = Q.double() * (1 + 2 * tolerance)
    assert orthogonality_error(stretched) > tolerance
    with pytest.raises(cm.PreconditionError, match="Q is orthogonal") as info:
        cm.rotate_residual_stream(sd, cfg, stretched)
    assert info.value.identity == "rotate_residual_stream"


#: The most ``max |Q^T Q - I| / (d eps)`` an honest orthogonal matrix was measured to have:
#: ``torch.linalg.qr`` of Gaussian matrices, 10 seeds, 1.25 in float64 at d = 2 (0.90 in float32;
#: 0.38 and 0.77 at d = 8, under 0.1 from 64 on); random_orthogonal and hadamard rounded to
#: float32 at most 0.25.
HONEST_ORTHOGONALITY = 1.25


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_orthogonality_tolerance_is_bounded_from_above(dtype):
    """The tolerance admits what orthogonalising in the model's precision leaves, and not much
    more: a Q whose defect is 16 d eps, more than ten times the worst an honest QR was measured to
    leave (HONEST_ORTHOGONALITY), was not computed as an orthogonal matrix and is refused. So
    ORTHOGONALITY_SAFETY stays below 16 (it is 4: 3.2 times the measured worst); a factor of 17,
    or 1000 times the current one, lets this Q through."""
    sd, cfg = _rms_model(dtype)
    Q = torch.linalg.qr(torch.randn(cfg.d_model, cfg.d_model, dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(0)))[0]
    unit = cfg.d_model * torch.finfo(dtype).eps
    stretched = Q * (1 + 8 * unit)  # Q^T Q = (1 + 8 d eps)^2 I: a defect of 16 d eps
    assert 10 * HONEST_ORTHOGONALITY * unit < orthogonality_error(stretched) < 17 * unit
    with pytest.raises(cm.PreconditionError, match="Q is orthogonal") as info:
        cm.rotate_residual_stream(sd, cfg, stretched)
    assert info.value.identity == "rotate_residual_stream"


def test_a_precise_q_is_held_to_its_own_precision_on_a_half_precision_model():
    """On a bfloat16 model d_model eps of bfloat16 is about 1 at d_model 32: held to the model's
    precision alone, Q = 1.2 I (|x Q| = 1.2 |x|) would pass, be recorded as applied and change the
    model. A float64 Q is held to float64's precision; a Q rounded to bfloat16 to bfloat16's."""
    sd, cfg = _rms_model(torch.bfloat16, d_model=32)
    assert ORTHOGONALITY_SAFETY * cfg.d_model * torch.finfo(torch.bfloat16).eps > 0.44
    with pytest.raises(cm.PreconditionError, match="Q is orthogonal") as info:
        cm.rotate_residual_stream(sd, cfg, 1.2 * torch.eye(cfg.d_model, dtype=torch.float64))
    assert "float64 Q" in str(info.value)
    Q = torch.linalg.qr(torch.randn(cfg.d_model, cfg.d_model, dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(0)))[0]
    for given in (Q, Q.to(torch.bfloat16)):
        out, out_cfg = cm.rotate_residual_stream(sd, cfg, given)
        assert "rotate_residual_stream" in out_cfg.applied


def test_measured_orthogonality_of_qr_is_within_the_safety_factor():
    """The measurement behind ORTHOGONALITY_SAFETY: QR leaves at most 1.25 d eps, a factor 3 below it."""
    worst = 0.0
    for dtype in (torch.float32, torch.float64):
        for d in (2, 3, 8, 64, 256):
            for seed in range(3):
                gaussian = torch.randn(d, d, dtype=dtype, generator=torch.Generator().manual_seed(seed))
                worst = max(worst, orthogonality_error(torch.linalg.qr(gaussian)[0]) / (d * torch.finfo(dtype).eps))
    assert worst <= ORTHOGONALITY_SAFETY / 3, worst
    assert worst <= HONEST_ORTHOGONALITY, worst  # the figure the upper bound above is justified by


def test_a_float32_rotation_of_a_float64_model_is_refused():
    sd, cfg = _rms_model(torch.float64)
    Q = random_orthogonal(cfg.d_model, seed=0, dtype=torch.float32)
    with pytest.raises(cm.PreconditionError, match="float64"):
        cm.rotate_residual_stream(sd, cfg, Q)


@pytest.mark.parametrize("Q", [torch.eye(7, dtype=torch.float64), torch.eye(8, dtype=torch.int64), "eye",
                               torch.full((8, 8), float("nan"), dtype=torch.float64)])
def test_bad_Q_is_refused(Q):
    sd, cfg = _rms_model()
    with pytest.raises(cm.PreconditionError, match="Q is a floating"):
        cm.rotate_residual_stream(sd, cfg, Q)


def _lnpre_model():
    cfg = _cfg()
    return cm.fold_layer_norm(cm.random_state_dict(cfg, seed=0, dtype=torch.float64), cfg)


@pytest.mark.parametrize("sign", [1, -1])
def test_layer_norm_model_rotates_by_a_Q_mapping_the_ones_to_plus_or_minus_the_ones(sign):
    sd, folded_cfg = _lnpre_model()
    Q = sign * orthogonal_fixing_ones(folded_cfg.d_model, seed=0)
    ones = torch.ones(folded_cfg.d_model, dtype=torch.float64)
    assert torch.allclose(Q @ ones, sign * ones)
    out, out_cfg = cm.rotate_residual_stream(sd, folded_cfg, Q)
    assert out_cfg.applied[-1] == "layer_norm_rotation"
    assert compare_log_probs(sd, folded_cfg, out, out_cfg).passed


def test_layer_norm_model_rotated_by_minus_the_identity_is_exact_to_the_bit():
    """LNPre(-x) = -LNPre(x) exactly in floating point (negation is exact, and so is every sum of
    negated terms), and each reader reads (-W) of (-x): the log-probs are the same bits."""
    sd, folded_cfg = _lnpre_model()
    out, out_cfg = cm.rotate_residual_stream(sd, folded_cfg, -torch.eye(folded_cfg.d_model, dtype=torch.float64))
    assert out_cfg.applied[-1] == "layer_norm_rotation"
    assert torch.equal(out["embed.W_E"], -sd["embed.W_E"])
    tokens = torch.arange(folded_cfg.n_ctx).remainder(folded_cfg.d_vocab)[None]
    assert torch.equal(cm.forward(out, out_cfg, tokens), cm.forward(sd, folded_cfg, tokens))


def _signs(d_model):
    """``diag(1, -1, 1, ...)``: orthogonal, ``Q 1`` neither ``1`` nor ``-1``."""
    return torch.diag(torch.tensor([(-1.0) ** i for i in range(d_model)], dtype=torch.float64))


@pytest.mark.parametrize("make", [lambda d: random_orthogonal(d, seed=0), _signs], ids=["random", "signs"])
def test_layer_norm_model_refuses_a_Q_moving_the_ones_and_says_why_truly(make):
    sd, folded_cfg = _lnpre_model()
    Q = make(folded_cfg.d_model)
    with pytest.raises(cm.PreconditionError, match=r"neither 1 nor -1.*exactly when Q 1 = 1 or Q 1 = -1") as info:
        cm.rotate_residual_stream(sd, folded_cfg, Q)
    assert info.value.identity == "layer_norm_rotation"
    assert "Q 1 = 1 or Q 1 = -1" in info.value.precondition
    # what the refusal says is true: the rotation it refuses changes the model
    rotated = dict(sd) | rotated_tensors(sd, folded_cfg, Q)
    assert not compare_log_probs(sd, folded_cfg, rotated, folded_cfg).passed


def test_the_proof_samples_both_signs():
    """The proof's instances draw ``Q 1 = 1`` and ``Q 1 = -1``, so its fact is checked for both."""
    import random

    from circuitmath._identities.rotation import _fixing_ones

    rng = random.Random(0)
    signs = set()
    for _ in range(20):
        Q_ = _fixing_ones(rng, (4, 4))
        image = Q_ * sympy.ones(4, 1)
        assert Q_.T * Q_ == sympy.eye(4) and image in (sympy.ones(4, 1), -sympy.ones(4, 1))
        signs.add(image[0])
    assert signs == {1, -1}


def test_slicegpt_route_on_a_zoo_model():
    sd, cfg = zoo.load("gelu_2l", dtype=torch.float64)
    out, out_cfg = slicegpt_route(sd, cfg, hadamard(cfg.d_model))
    assert out_cfg.normalization_type == "RMSPre"
    assert out_cfg.applied == ("fold_layer_norm", "center_writing_weights", "layer_norm_to_rms_norm", "rotate_residual_stream")
    assert compare_log_probs(sd, cfg, out, out_cfg).passed


# -- permutations -----------------------------------------------------------------------------


@given(models(**wide(max_heads=4)), st.randoms(use_true_random=False))
def test_head_permutations_preserve_log_probs(model, rng):
    cfg, sd = model
    kv = cfg.n_key_value_heads or cfg.n_heads
    size = cfg.n_heads // kv
    groups = list(range(kv))
    rng.shuffle(groups)
    perm = []
    for g in groups:  # whole groups move, and heads are reordered inside each
        inside = list(range(g * size, (g + 1) * size))
        rng.shuffle(inside)
        perm += inside
    out, out_cfg = cm.permute_heads(sd, cfg, perm)
    assert out_cfg.applied == ("permute_heads",)
    assert compare_log_probs(sd, cfg, out, out_cfg).passed
    recovered = cm.recover_head_permutation(sd, out, cfg)
    assert recovered is not None
    again, _ = cm.permute_heads(sd, cfg, recovered)
    assert same(again, out)


@given(models(**wide(attn_only=False, max_d_mlp=8)), st.randoms(use_true_random=False))
def test_neuron_permutations_preserve_log_probs(model, rng):
    cfg, sd = model
    perms = []
    for _ in range(cfg.n_layers):
        order = list(range(cfg.d_mlp))
        rng.shuffle(order)
        perms.append(order)
    perms = torch.tensor(perms, dtype=torch.long).reshape(cfg.n_layers, cfg.d_mlp)
    before = snapshot(sd)
    out, out_cfg = cm.permute_neurons(sd, cfg, perms)
    assert same(sd, before)
    assert compare_log_probs(sd, cfg, out, out_cfg).passed
    recovered = cm.recover_neuron_permutation(sd, out, cfg)
    assert recovered is not None
    again, _ = cm.permute_neurons(sd, cfg, recovered)
    assert same(again, out)


def test_grouped_query_permutation_that_splits_a_group_is_refused():
    cfg = _cfg(n_key_value_heads=2)
    sd = cm.random_state_dict(cfg, seed=0)
    with pytest.raises(cm.PreconditionError, match="mixes query heads of different groups") as info:
        cm.permute_heads(sd, cfg, [0, 2, 1, 3])
    assert info.value.identity == "permute_heads"
    cm.permute_heads(sd, cfg, [3, 2, 0, 1])  # whole groups: fine


def test_splitting_a_group_would_change_the_model():
    """The refusal is not a formality: moving query heads to another group's keys changes log-probs."""
    cfg = _cfg(n_key_value_heads=2)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    wrong = dict(sd)
    for layer in range(cfg.n_layers):
        for name in ("W_Q", "b_Q", "W_O"):
            key = f"blocks.{layer}.attn.{name}"
            wrong[key] = sd[key][[0, 2, 1, 3]]
    result = compare_log_probs(sd, cfg, wrong, cfg)
    assert result.max_abs_error > 1e6 * result.tolerance


@pytest.mark.parametrize("perm", [[0, 0, 1, 2], [0, 1, 2], [[0, 1, 2, 3]] * 3, [0.0, 1.0, 2.0, 3.0], "abcd"])
def test_bad_permutations_are_refused(perm):
    sd, cfg = _rms_model()
    with pytest.raises(cm.PreconditionError, match="a permutation of the heads"):
        cm.permute_heads(sd, cfg, perm)


def test_attention_only_models_have_no_neurons_to_permute():
    cfg = _cfg(d_mlp=None)
    with pytest.raises(cm.PreconditionError, match="attention-only"):
        cm.permute_neurons(cm.random_state_dict(cfg, seed=0), cfg, [0])


# -- recognition ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["float64", "float32", "bfloat16"])
def test_recover_rotation_finds_Q(dtype):
    sd, cfg = _rms_model(dtype, gated_mlp=True, n_key_value_heads=2)
    Q = random_orthogonal(cfg.d_model, seed=5)
    out, _ = cm.rotate_residual_stream(sd, cfg, Q)
    found = cm.recover_rotation(sd, out, cfg)
    assert found is not None
    assert float((found - Q).abs().max()) < 1e3 * torch.finfo(dtype).eps


def test_recover_rotation_with_fewer_tokens_than_dimensions():
    """d_vocab < d_model: W_E alone does not fix Q; the other writers and the readers do."""
    sd, cfg = _rms_model(d_vocab=3)
    Q = random_orthogonal(cfg.d_model, seed=6)
    out, _ = cm.rotate_residual_stream(sd, cfg, Q)
    found = cm.recover_rotation(sd, out, cfg)
    assert found is not None and torch.allclose(found, Q, atol=1e-10)


@pytest.mark.parametrize("wrong_name", ["non_orthogonal", "forget_W_pos", "forget_writer_bias", "readers_not_transposed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_wrong_rotations_are_not_recognised_and_the_tensors_are_named(wrong_name, dtype):
    identity = cm.get_identity("rotate_residual_stream")
    sd, cfg = _rms_model(dtype)
    wrong, _ = identity.wrong_everywhere[wrong_name](sd, cfg)
    assert cm.recover_rotation(sd, wrong, cfg) is None
    mismatches = rotation_mismatches(sd, wrong, cfg, check_rotation(cfg))
    expected = {
        "forget_W_pos": {"pos_embed.W_pos"},
        "forget_writer_bias": {"blocks.0.attn.b_O", "blocks.1.attn.b_O"},
    }.get(wrong_name)
    if expected is not None:
        assert set(mismatches) == expected
    else:
        assert mismatches
    # and the exact rotation leaves nothing
    right, _ = identity.transform(sd, cfg)
    assert rotation_mismatches(sd, right, cfg, check_rotation(cfg)) == {}


def test_a_slightly_wrong_rotation_is_not_recognised():
    """Pins the recognition tolerance: one writer off by 100 rounding errors is caught."""
    sd, cfg = _rms_model(torch.float32)
    out, _ = cm.rotate_residual_stream(sd, cfg, random_orthogonal(cfg.d_model, seed=0))
    off = dict(out)
    W = out["blocks.1.mlp.b_out"]
    off["blocks.1.mlp.b_out"] = W + 100 * cfg.d_model * torch.finfo(torch.float32).eps * W.abs().max()
    assert cm.recover_rotation(sd, off, cfg) is None


def test_unrelated_models_are_not_recognised():
    sd, cfg = _rms_model(seed=0)
    other, _ = _rms_model(seed=1)
    assert cm.recover_rotation(sd, other, cfg) is None
    assert cm.recover_head_permutation(sd, other, cfg) is None
    assert cm.recover_neuron_permutation(sd, other, cfg) is None


def test_wrong_permutations_are_not_recognised():
    sd, cfg = _rms_model()
    for name, identity in (("permute_heads", cm.get_identity("permute_heads")),
                           ("permute_neurons", cm.get_identity("permute_neurons"))):
        recover = cm.recover_head_permutation if name == "permute_heads" else cm.recover_neuron_permutation
        right, _ = identity.transform(sd, cfg)
        assert recover(sd, right, cfg) is not None
        for wrong_name, function in identity.wrong_everywhere.items():
            wrong, _ = function(sd, cfg)
            assert recover(sd, wrong, cfg) is None, (name, wrong_name)


# -- recognition in the diagnosis, and the verdicts ---------------------------------------------


def _zoo_rotated(name="attn_only_1l"):
    """A zoo model, the default processing, LayerNorm switched to RMSNorm, a random rotation."""
    sd, cfg = zoo.load(name, dtype=torch.float64)
    processed, processed_cfg = cm.layer_norm_to_rms_norm(*cm.process_weights(sd, cfg))
    return sd, cfg, cm.rotate_residual_stream(processed, processed_cfg, random_orthogonal(cfg.d_model, seed=3))


def test_a_rotated_zoo_model_passes_check_processed_and_is_reported_as_rotated(tmp_path, capsys):
    from circuitmath import _cli, io

    sd, cfg, (rotated, rotated_cfg) = _zoo_rotated()
    io.save(tmp_path / "model.safetensors", sd, cfg)
    io.save(tmp_path / "rotated.safetensors", rotated, rotated_cfg)  # cfg.applied records the rotation
    status = _cli.main(["check", str(tmp_path / "model.safetensors"), "--processed", str(tmp_path / "rotated.safetensors")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "rotate_residual_stream" in out and "violated" not in out
    # inferred: no config given, the tensors alone; RMSPre is inferred, the rotation recovered
    found = cm.testing.diagnose(sd, rotated, cfg)
    assert found.ok, str(found)
    assert found.replayed[-2:] == ("layer_norm_to_rms_norm", "rotate_residual_stream"), found.replayed


@pytest.mark.parametrize("twin", ["non_orthogonal", "forget_W_pos", "forget_writer_bias", "readers_not_transposed"])
def test_each_rotation_twin_on_a_zoo_model_fails_naming_the_identity_and_tensors(twin, tmp_path, capsys):
    from circuitmath import _cli, io

    sd, cfg = zoo.load("attn_only_1l", dtype=torch.float64)
    wrong, wrong_cfg = cm.get_identity("rotate_residual_stream").wrong_rewrites[twin](*to_rms_pre(sd, cfg))
    io.save(tmp_path / "model.safetensors", sd, cfg)
    io.save(tmp_path / "wrong.safetensors", wrong, wrong_cfg)
    status = _cli.main(["check", str(tmp_path / "model.safetensors"), "--processed", str(tmp_path / "wrong.safetensors")])
    out = capsys.readouterr().out
    assert status == 1, out
    assert f"rotate_residual_stream.{twin}" in out, out
    expected = {"forget_W_pos": ["pos_embed.W_pos"], "forget_writer_bias": ["blocks.0.attn.b_O"],
                "readers_not_transposed": ["blocks.0.attn.W_Q", "unembed.W_U"]}.get(twin, ["embed.W_E"])
    assert all(name in out for name in expected), out
    if twin in ("forget_W_pos", "forget_writer_bias"):  # only the tensors responsible are named
        assert "embed.W_E" not in out.split(f"rotate_residual_stream.{twin} explains", 1)[1].split("\n")[0]


@pytest.mark.parametrize("sign", [1, -1])
def test_the_diagnosis_recognises_an_lnpre_rotation_with_q_one_plus_or_minus_one(sign):
    """An ``LNPre`` model rotated by ``Q`` with ``Q 1 = ±1`` is read back as ``layer_norm_rotation``
    (not switched to RMSNorm first, which a ``Q 1 = -1`` would otherwise look like it needs)."""
    sd, folded_cfg = _lnpre_model()
    rotated, rotated_cfg = cm.rotate_residual_stream(sd, folded_cfg, sign * orthogonal_fixing_ones(folded_cfg.d_model, seed=2))
    found = cm.testing.diagnose(sd, rotated, folded_cfg)
    assert found.ok, str(found)
    assert found.replayed[-1:] == ("layer_norm_rotation",), found.replayed
    # negative control: the rotation with W_E forgotten is not explained
    broken = dict(rotated, **{"embed.W_E": sd["embed.W_E"]})
    assert not cm.testing.diagnose(sd, broken, folded_cfg).ok


def test_head_and_neuron_permutations_are_recognised():
    cfg = _cfg(normalization_type="RMSPre")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    heads, heads_cfg = cm.permute_heads(sd, cfg, [2, 0, 3, 1])
    both, both_cfg = cm.permute_neurons(heads, heads_cfg, [5, 4, 3, 2, 1, 0])
    found = cm.testing.diagnose(sd, both, cfg)  # inferred: nothing recorded
    assert found.ok and found.replayed == ("permute_heads", "permute_neurons"), str(found)
    recorded = cm.testing.check_permute_neurons(heads, both, heads_cfg, after_cfg=both_cfg)
    assert recorded.ok, str(recorded)
    # negative control: a permutation that forgets W_out is no permutation
    broken = dict(both, **{f"blocks.{l}.mlp.W_out": heads[f"blocks.{l}.mlp.W_out"] for l in range(cfg.n_layers)})
    assert not cm.testing.diagnose(sd, broken, cfg).ok


def test_a_named_wrong_rewrite_fails_even_where_the_tokens_do_not_show_it():
    cfg = _cfg(normalization_type="LN")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    for name in sd:  # small LayerNorm biases: dropping them moves the log-probs by less than the tolerance
        if name.endswith(".b") and ("ln" in name):
            sd[name] = sd[name] * 1e-14
    wrong, wrong_cfg = cm.get_identity("fold_layer_norm").wrong_rewrites["drop_bias"](sd, cfg)
    assert compare_log_probs(sd, cfg, wrong, wrong_cfg).passed  # the tokens do not show it
    found = cm.testing.diagnose(sd, wrong, cfg, after_cfg=wrong_cfg)
    assert not found.ok and any(f.rewrite == "fold_layer_norm.drop_bias" for f in found.violations), str(found)
    with pytest.raises(cm.testing.NotEquivalentError, match="named wrong rewrite"):
        cm.testing.assert_equivalent(sd, wrong, cfg, after_cfg=wrong_cfg)
    # negative control: the exact fold passes
    folded, folded_cfg = cm.fold_layer_norm(sd, cfg)
    assert cm.testing.diagnose(sd, folded, cfg, after_cfg=folded_cfg).ok


def test_an_unrecognised_exact_processing_passes():
    cfg = _cfg(normalization_type="RMSPre")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    # a rescaling of one head's OV factors: exact, registered as no rewrite
    scaled = dict(sd)
    scaled["blocks.0.attn.W_V"] = sd["blocks.0.attn.W_V"] * 2
    scaled["blocks.0.attn.b_V"] = sd["blocks.0.attn.b_V"] * 2
    scaled["blocks.0.attn.W_O"] = sd["blocks.0.attn.W_O"] / 2
    found = cm.testing.diagnose(sd, scaled, cfg)
    assert found.ok, str(found)
    assert any(f.name == "residual" and f.parameters for f in found.findings)  # reported, not hidden


@pytest.mark.parametrize("size", [1, 2, 6, 16, 47, 768])
@pytest.mark.parametrize("fixing_ones", [False, True])
def test_block_orthogonal_is_the_dense_q_it_stands_for(size, fixing_ones):
    """The check rotation's ``W Q``, ``Q^T W``, ``Q 1`` and orthogonality error are those of its
    dense form, which is orthogonal, maps 1 to 1 with ``fixing_ones`` and to neither 1 nor -1
    without; from 16 coordinates on it mixes each coordinate with at least 15 others, through a
    permutation that is not the identity."""
    Q = block_orthogonal(size, seed=0, fixing_ones=fixing_ones)
    dense = Q.dense()
    W, R = torch.randn(3, 2, size, dtype=torch.float64), torch.randn(2, size, 5)
    assert torch.allclose(Q.times(W), W @ dense, atol=1e-13) and Q.times(W).is_contiguous()
    assert torch.allclose(Q.transposed_times(R), dense.T @ R.double(), atol=1e-13)
    ones = torch.ones(size, dtype=torch.float64)
    assert torch.allclose(Q.image_of_ones(), dense @ ones, atol=1e-14)
    assert abs(orthogonality_error(Q) - orthogonality_error(dense)) < 1e-14 and orthogonality_error(Q) < 1e-13
    moves_ones = float((dense @ ones - ones).abs().max()) > 1e-3 and float((dense @ ones + ones).abs().max()) > 1e-3
    assert moves_ones != fixing_ones or size == 1
    if size >= 16:
        assert int((dense != 0).sum(1).min()) >= 16 and not torch.equal(Q.perm, torch.arange(size))
        assert len(Q.block) == {16: 16, 47: 47, 768: 16}[size]


def test_a_block_orthogonal_q_that_is_not_orthogonal_or_square_is_refused():
    """rotate_residual_stream holds a structured Q to the preconditions a dense one meets: a
    scaled block is not orthogonal, a Q of another size is not [d_model, d_model]."""
    cfg = cm.Config(n_layers=1, d_model=32, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16, normalization_type="RMSPre")
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    Q = block_orthogonal(32, seed=0)
    scaled = dataclasses.replace(Q, block=Q.block * 1.001)
    with pytest.raises(cm.PreconditionError, match="Q is orthogonal"):
        cm.rotate_residual_stream(sd, cfg, scaled)
    with pytest.raises(cm.PreconditionError, match="Q has shape .16, 16., d_model is 32"):
        cm.rotate_residual_stream(sd, cfg, block_orthogonal(16, seed=0))
    rotated, _cfg = cm.rotate_residual_stream(sd, cfg, Q)
    assert rotation_mismatches(sd, rotated, cfg, Q.dense()) == {}
