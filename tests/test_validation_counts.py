"""Each input is validated once, at the public function that takes it.

The one full validation (``circuitmath._state._validate``: names, shapes, dtypes, devices and
entries) is wrapped and every call counted by the input whose tensors it read: a check of two
models validates each once, passing or failing, with ``after_cfg`` given or inferred, and
``process_weights`` validates its input once. What internal code makes of a validated model (a
replayed transform, a copy in another dtype, a forward pass) is not read again. Controls: two
validations of one input are counted as two, and without the mark a validated state dict carries
(``Validated``) the same check counts many.
"""

from collections import Counter

import pytest
import torch

import circuitmath as cm
from circuitmath import _state
from circuitmath.testing import NotEquivalentError, assert_equivalent

LN = cm.Config(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=23, n_ctx=8, d_mlp=32)
RMS_GQA = LN.replace(normalization_type="RMS", n_heads=4, d_head=4, n_key_value_heads=2,
                     positional_embedding_type="rotary", gated_mlp=True, act_fn="silu")


@pytest.fixture
def counted(monkeypatch):
    """``count(*models)``: a fresh tally of full validations, each call named by the model (of
    ``models``, ``name -> state dict``) whose tensors it read, else ``"other"``."""
    real, tally, models = _state._validate, Counter(), {}

    def validate(state_dict, cfg, **kwargs):
        found = [name for name, model in models.items()
                 if len(model) == len(state_dict) and all(state_dict.get(k) is t for k, t in model.items())]
        tally[found[0] if found else "other"] += 1
        return real(state_dict, cfg, **kwargs)

    monkeypatch.setattr(_state, "_validate", validate)

    def count(**named):
        tally.clear()
        models.clear()
        models.update(named)
        return tally

    return count


def _pair(cfg, wrong: str | None):
    before = cm.random_state_dict(cfg, seed=0)
    after, after_cfg = cm.process_weights(before, cfg)
    if wrong == "forgotten":  # the value biases folded into b_O, and b_O left as it was
        after["blocks.0.attn.b_O"] = before["blocks.0.attn.b_O"]
    elif wrong == "unexplained":  # one row changed by 1 %
        after["blocks.0.mlp.W_out"] = after["blocks.0.mlp.W_out"].clone()
        after["blocks.0.mlp.W_out"][3] *= 1.01
    return before, after, after_cfg


@pytest.mark.parametrize("cfg", [LN, RMS_GQA], ids=["layer_norm", "rms_norm_gqa"])
@pytest.mark.parametrize("wrong", [None, "forgotten", "unexplained"])
@pytest.mark.parametrize("given", [True, False], ids=["after_cfg", "inferred"])
def test_assert_equivalent_validates_each_input_once(counted, cfg, wrong, given):
    before, after, after_cfg = _pair(cfg, wrong)
    tally = counted(before=before, after=after)
    if wrong is None:
        assert_equivalent(before, after, cfg, after_cfg=after_cfg if given else None)
    else:
        with pytest.raises(NotEquivalentError) as failure:
            assert_equivalent(before, after, cfg, after_cfg=after_cfg if given else None)
        assert failure.value.diagnosis is not None and not failure.value.diagnosis.ok  # diagnosed, too
    assert tally == {"before": 1, "after": 1}


def test_diagnose_and_a_checker_validate_each_input_once(counted):
    before, after, after_cfg = _pair(LN, "forgotten")
    tally = counted(before=before, after=after)
    assert not cm.testing.diagnose(before, after, LN, after_cfg=after_cfg).ok
    assert tally == {"before": 1, "after": 1}
    folded, folded_cfg = cm.fold_layer_norm(before, LN)
    tally = counted(before=before, after=folded)
    assert cm.testing.check_fold_layer_norm(before, folded, LN, after_cfg=folded_cfg).ok
    assert tally == {"before": 1, "after": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_check_model_validates_its_model_once(counted, dtype):
    """Every identity applied to the model, in its dtype and (below float64) in float64 too."""
    model = cm.random_state_dict(LN, seed=0, dtype=dtype)
    tally = counted(model=model)
    assert cm.testing.check_model(model, LN).findings
    assert tally == {"model": 1}


@pytest.mark.parametrize("cfg", [LN, RMS_GQA], ids=["layer_norm", "rms_norm_gqa"])
@pytest.mark.parametrize("steps", [{}, {"fold_ln": False}, {"refactor_factored_attn_matrices": None}],
                         ids=["default", "unfused", "refactor"])
def test_process_weights_validates_its_input_once(counted, cfg, steps):
    before = cm.random_state_dict(cfg, seed=0)
    tally = counted(before=before)
    out, out_cfg = cm.process_weights(before, cfg, **steps)
    assert tally == {"before": 1}
    assert type(out) is dict  # the caller's to change: no mark leaves the package
    cm.validate_state_dict(out, out_cfg)
    assert tally == {"before": 1, "other": 1}


def test_two_validations_of_one_input_are_counted_as_two(counted):
    before = cm.random_state_dict(LN, seed=0)
    tally = counted(before=before)
    cm.validate_state_dict(before, LN)
    cm.validate_state_dict(before, LN)
    assert tally == {"before": 2}


def test_without_the_mark_a_check_validates_again(counted, monkeypatch):
    """The control of the counts: where a validated state dict is not trusted as one, the check
    reads its inputs and everything made from them again (the counts above are not met by a
    counter that misses calls)."""
    monkeypatch.setattr(_state.Validated, "holds_for", lambda self, cfg: False)
    before, after, after_cfg = _pair(LN, "forgotten")
    tally = counted(before=before, after=after)
    with pytest.raises(NotEquivalentError):
        assert_equivalent(before, after, LN, after_cfg=after_cfg)
    assert tally["before"] + tally["after"] > 2 and tally["other"] > 10, tally


def test_a_nan_planted_after_processing_is_still_refused():
    """Public functions hand back plain dicts: a NaN put into process_weights' output is refused
    by the next check, as any input's would be."""
    before = cm.random_state_dict(LN, seed=0)
    after, after_cfg = cm.process_weights(before, LN)
    after["unembed.b_U"][0] = float("nan")
    with pytest.raises(cm.StateDictError, match="unembed.b_U has 1 NaN"):
        assert_equivalent(before, after, LN, after_cfg=after_cfg)
    assert torch.isnan(after["unembed.b_U"][0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_after_s_norm_is_read_from_the_tensors_without_a_forward_pass(monkeypatch, dtype):
    """Without ``after_cfg``, a LayerNorm model processed into uncentered writes is read as
    ``LNPre`` or ``RMSPre`` from its embedding (the fold leaves it alone; the SliceGPT route centers
    it, switches to RMSNorm and rotates it): no forward pass; where the embedding does not decide
    (changed otherwise), the log-probs decide as the control."""
    from circuitmath._diagnosis import _inputs
    from circuitmath._identities.rotation import to_rms_pre
    from circuitmath._processing.rotation import random_orthogonal

    passes = []
    real = _inputs.compare_log_probs
    monkeypatch.setattr(_inputs, "compare_log_probs", lambda *args: passes.append(1) or real(*args))
    cfg = LN.replace(d_model=12, n_heads=3, d_head=4)
    before = cm.random_state_dict(cfg, seed=1, dtype=dtype)
    folded, folded_cfg = cm.fold_layer_norm(before, cfg)
    rms, rms_cfg = to_rms_pre(before, cfg)
    rotated, rotated_cfg = cm.rotate_residual_stream(rms, rms_cfg, random_orthogonal(cfg.d_model, seed=0))
    for after, read in ((folded, "LNPre"), (rotated, "RMSPre")):
        _first, second, _notes = _inputs.resolve_pair(before, after, cfg, None)
        assert second.cfg.normalization_type == read and not passes
    scaled = dict(rotated, **{"embed.W_E": rotated["embed.W_E"] * 1.5})  # neither: the log-probs decide
    _first, second, _notes = _inputs.resolve_pair(before, scaled, cfg, None)
    assert passes == [1, 1]


def test_a_failing_check_builds_no_proof(monkeypatch):
    """A failing check names wrong rewrites (their descriptions are the WrongRewrite's, which the
    twins of the proofs read too): no proof is built. Control: the description of every twin is
    its wrong rewrite's, and building one proof is counted."""
    from circuitmath import _identities
    from circuitmath._registry import Identity

    built = []
    real = Identity.proof.func
    monkeypatch.setattr(Identity, "proof", property(lambda self: built.append(self.name) or real(self)))
    before, after, after_cfg = _pair(LN, "forgotten")
    folded, folded_cfg = cm.fold_layer_norm(before, LN)
    folded["blocks.0.attn.b_V"] = before["blocks.0.attn.b_V"]  # fold_layer_norm.drop_bias, named
    for pair in ((before, after, after_cfg), (before, folded, folded_cfg)):
        with pytest.raises(NotEquivalentError) as failure:
            assert_equivalent(pair[0], pair[1], LN, after_cfg=pair[2])
        assert built == [], built
    assert "fold_layer_norm.drop_bias" in str(failure.value) and "forget the LayerNorm bias term" in str(failure.value)
    for identity in _identities.identities():  # the words of a twin are its wrong rewrite's (the proof's
        if identity.build_proof is not None:     # own: that rewrite's model in particular, after them)
            for twin in identity.proof.twins:
                wrong = identity.wrong_rewrites.get(twin.name)
                if wrong is not None and not wrong.regardless:  # regardless: the identity's rewrite, refused
                    assert twin.description.startswith(wrong.description), (identity.name, twin.name)
    assert built


def test_a_model_object_and_a_hugging_face_state_dict_are_validated_once(counted):
    """Inputs converted from a ``transformers`` model or a Hugging Face state dict are validated
    by their conversion, once; nothing made of them is validated again."""
    from circuitmath._conformance import family_model

    model, config = family_model("LLaMA")
    stored = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    before, cfg = cm.io.from_hf(stored, config)
    after, after_cfg = cm.process_weights(before, cfg)
    tally = counted(after=after)
    assert_equivalent(model, after, after_cfg=after_cfg)
    assert tally == {"other": 1, "after": 1}
    after["blocks.0.attn.b_O"] = after["blocks.0.attn.b_O"] + 0.5
    tally = counted(after=after)
    with pytest.raises(NotEquivalentError):
        assert_equivalent(stored, after, config, after_cfg=after_cfg)
    assert tally == {"other": 1, "after": 1}
