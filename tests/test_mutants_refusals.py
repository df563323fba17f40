"""Refusals of bad input that mutation testing (``make mutate``) found no test reaching: each bad
input is refused with the error of its kind, naming what is wrong, and the same call with the
input fixed is accepted (the control)."""

import re

import pytest
import torch

import circuitmath as cm
from circuitmath import io, testing
from circuitmath._errors import ArgumentTypeError, InputError, StateDictError
from circuitmath._reference import check_tokens, pattern_from_scores
from circuitmath._state import validate_state_dict, validated
from circuitmath._streaming_check_processed import check_processed
from circuitmath._streaming_recovery import Recovery

CFG = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)
RELU = CFG.replace(act_fn="relu")
ALIBI = CFG.replace(positional_embedding_type="alibi")


def _model():
    return cm.random_state_dict(CFG, seed=0, dtype=torch.float32)


class _Elsewhere(torch.Tensor):
    """A tensor that reports another device (this machine may have one device only)."""

    @property
    def device(self):
        return torch.device("cuda", 1)


def _on_another_device(tensor):
    return torch.Tensor._make_subclass(_Elsewhere, tensor)


ROTATION = torch.eye(4)
SCALES = torch.full((16,), 2.0)

# name: (the bad call, the error, what its message says, the call with the input fixed)
REFUSED = {
    "hadamard of 6": (lambda sd: cm.hadamard(6), ValueError, "needs a power of 2, got 6", lambda sd: cm.hadamard(8)),
    "hadamard of 0": (lambda sd: cm.hadamard(0), ValueError, "needs a power of 2, got 0", lambda sd: cm.hadamard(1)),
    "ragged tokens": (lambda sd: check_tokens(CFG, [[1, 2], [3]]), InputError, "tokens must be an integer tensor",
                      lambda sd: check_tokens(CFG, [[1, 2], [3, 4]])),
    "ALiBi scores without a head axis": (
        lambda sd: pattern_from_scores(torch.zeros(4, 4), ALIBI), ValueError, r"head axis of 2 .* got \(4, 4\)",
        lambda sd: pattern_from_scores(torch.zeros(2, 4, 4), ALIBI)),
    "ALiBi scores of 3 heads": (
        lambda sd: pattern_from_scores(torch.zeros(3, 4, 4), ALIBI), ValueError, r"head axis of 2 .* got \(3, 4, 4\)",
        lambda sd: pattern_from_scores(torch.zeros(1, 2, 4, 4), ALIBI)),
    "a number for a model": (lambda sd: testing.diagnose(42, sd, CFG), StateDictError, "expected a state dict.*got int",
                             lambda sd: testing.diagnose(sd, sd, CFG)),
    "a number for after": (lambda sd: testing.diagnose(sd, 42, CFG), StateDictError, "expected a state dict.*got int",
                           lambda sd: testing.diagnose(sd, dict(sd), CFG)),
    "a state dict without its config": (lambda sd: testing.diagnose(sd, sd), StateDictError, "needs its config",
                                        lambda sd: testing.diagnose(sd, sd, CFG)),
    "a string for a config": (lambda sd: testing.diagnose(sd, sd, "gpt2"), StateDictError,
                              "expected a circuitmath Config or a Hugging Face config, got str",
                              lambda sd: testing.diagnose(sd, sd, CFG)),
    "a list for a state dict": (lambda sd: cm.fold_layer_norm(list(sd.values()), CFG), StateDictError,
                                "fold_layer_norm: expected a mapping of names to tensors, got list",
                                lambda sd: cm.fold_layer_norm(sd, CFG)),
    "a parameter named by a number": (lambda sd: cm.fold_layer_norm({**sd, 3: torch.zeros(1)}, CFG), StateDictError,
                                      "parameter names must be strings, got 3", lambda sd: cm.fold_layer_norm(sd, CFG)),
    "tensors on two devices": (
        lambda sd: cm.fold_layer_norm({**sd, "unembed.W_U": _on_another_device(sd["unembed.W_U"])}, CFG),
        StateDictError, r"tensors on several devices \(.* on cpu, unembed\.W_U on cuda:1\)",
        lambda sd: cm.fold_layer_norm(sd, CFG)),
    "a list for a head rotation": (lambda sd: cm.rotate_heads(sd, CFG, value=ROTATION.tolist()), cm.PreconditionError,
                                   "value is a list, not a floating tensor",
                                   lambda sd: cm.rotate_heads(sd, CFG, value=ROTATION)),
    "a NaN head rotation": (lambda sd: cm.rotate_heads(sd, CFG, query_key=ROTATION * float("nan")), cm.PreconditionError,
                            "query_key has NaN or infinite entries",
                            lambda sd: cm.rotate_heads(sd, CFG, query_key=ROTATION)),
    "a list of neuron scales": (lambda sd: cm.scale_neurons(sd, RELU, SCALES.tolist()), cm.PreconditionError,
                                "got list, not a floating tensor", lambda sd: cm.scale_neurons(sd, RELU, SCALES)),
    "neuron scales of the wrong shape": (lambda sd: cm.scale_neurons(sd, RELU, SCALES[1:]), cm.PreconditionError,
                                         r"shape \[15\], expected \[16\] or \[2, 16\]",
                                         lambda sd: cm.scale_neurons(sd, RELU, SCALES.expand(2, 16))),
    "a zero and a NaN neuron scale": (
        lambda sd: cm.scale_neurons(sd, RELU, torch.cat([SCALES[:2] * torch.tensor([0, float("nan")]), SCALES[2:]])),
        cm.PreconditionError, "4 zero, NaN or infinite scales", lambda sd: cm.scale_neurons(sd, RELU, SCALES)),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_input_is_refused_naming_what_is_wrong(case):
    bad, error, message, fixed = REFUSED[case]
    sd = cm.random_state_dict(RELU if "neuron" in case else CFG, seed=0, dtype=torch.float32)
    with pytest.raises(error, match=message):
        bad(sd)
    fixed(sd)


def test_process_checkpoint_refuses_a_dtype_circuitmath_does_not_compute_in(tmp_path):
    """Refused before anything is read or written: the source need not exist, and nothing is left."""
    with pytest.raises(InputError, match=re.escape("dtype torch.int32: circuitmath computes in torch.float16")):
        io.process_checkpoint(tmp_path / "absent.safetensors", tmp_path / "out", dtype=torch.int32)
    assert list(tmp_path.iterdir()) == []
    io.save(tmp_path / "m.safetensors", _model(), CFG)
    assert io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "out", dtype=torch.float64, steps=[]) == CFG


def test_a_folder_carries_its_config_and_a_folder_to_compare_its_model(tmp_path):
    """A folder given with a config, a processed folder with an ``after_cfg``, and a folder of
    another model's shape as the processing of one, are each refused naming the folder or the
    argument; the folder alone, and the pair of the same model, are accepted."""
    sd = _model()
    other = CFG.replace(d_vocab=13)
    for name, state, cfg in (("m", sd, CFG), ("o", cm.random_state_dict(other, seed=0), other)):
        io.save(tmp_path / f"{name}.safetensors", state, cfg)
        io.process_checkpoint(tmp_path / f"{name}.safetensors", tmp_path / name, steps=[])
    with pytest.raises(StateDictError, match=f"{re.escape(str(tmp_path / 'm'))} is a Hugging Face folder with its own"
                                             " config.json; pass no config"):
        testing.diagnose(tmp_path / "m", sd, CFG)
    assert testing.diagnose(tmp_path / "m", sd).ok
    with pytest.raises(ArgumentTypeError, match="after_cfg: a processed checkpoint carries its config; pass none"):
        testing.assert_equivalent(tmp_path / "m", tmp_path / "m", after_cfg=CFG)
    tokens = torch.tensor([[1, 2, 3]])
    with pytest.raises(InputError, match=f"{re.escape(str(tmp_path / 'o'))} is not a processing of .*: d_vocab 11 vs 13"):
        check_processed(tmp_path / "m", tmp_path / "o", tokens=tokens)
    assert check_processed(tmp_path / "m", tmp_path / "m", tokens=tokens).ok


def test_an_embedding_of_another_shape_or_none_shows_no_rotation():
    """The streamed recovery looks for a rotation only between embeddings of one shape with
    entries; a rotated embedding of the same shape is one (the control)."""
    W = _model()["embed.W_E"]
    recovery = Recovery({}, CFG, torch.float32)
    assert not recovery.shows_rotation(W, W[:5])
    assert not recovery.shows_rotation(W[:0], W[:0])
    assert recovery.shows_rotation(W, (W.double() @ cm.random_orthogonal(CFG.d_model, seed=3)).float())


MUTATIONS = {
    "set": lambda v, t: v.__setitem__("embed.W_E", t),
    "update": lambda v, t: v.update({"embed.W_E": t}),
    "update by keywords": lambda v, t: v.update(**{"embed.W_E": t}),
    "in-place or": lambda v, t: v.__ior__({"embed.W_E": t}),
    "setdefault after pop": lambda v, t: (v.pop("embed.W_E"), v.setdefault("embed.W_E", t)),
    "delete": lambda v, t: v.__delitem__("embed.W_E"),
    "popitem": lambda v, t: v.popitem(),
    "clear": lambda v, t: v.clear(),
}


@pytest.mark.parametrize("change", sorted(MUTATIONS))
def test_a_validated_state_dict_changed_in_place_is_validated_again(change):
    """A state dict validated once and then changed by any of dict's methods (a NaN put in, a
    tensor taken out) is read again when next checked, and refused; unchanged, it passes."""
    v = validated(_model(), CFG)
    validate_state_dict(v, CFG)
    assert v.holds_for(CFG)
    MUTATIONS[change](v, torch.full((CFG.d_vocab, CFG.d_model), float("nan")))
    with pytest.raises(StateDictError):
        validate_state_dict(v, CFG)


def test_a_config_claiming_a_billion_layers_is_refused_before_its_shapes_are_listed(monkeypatch):
    """A state dict of 2 layers with a config of 10**9: refused naming the mismatch, before the
    config's expected shapes (a billion blocks' worth) are listed; listing them is made to fail
    here, so a refusal that came after listing would show as that failure. Control: its own
    config resolves, listing its shapes."""
    from circuitmath._diagnosis import _inputs

    listed, expected_shapes = [], _inputs.expected_shapes

    def listing(cfg):
        assert cfg.n_layers < 1000, f"the shapes of {cfg.n_layers} layers listed"
        listed.append(cfg.n_layers)
        return expected_shapes(cfg)

    monkeypatch.setattr(_inputs, "expected_shapes", listing)
    sd = _model()
    with pytest.raises(StateDictError, match="n_layers=1000000000"):
        _inputs.resolve(sd, CFG.replace(n_layers=10**9))
    assert _inputs.resolve(sd, CFG).cfg == CFG and listed
