"""The public checkers: per-identity checks, assert_equivalent on every accepted input form, and
the public API a separate project imports."""

import importlib
import inspect

import pytest
import torch
import transformers
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import circuitmath as cm
from circuitmath._diagnosis._replay import SYMMETRIES
from circuitmath import io, strategies, testing
from circuitmath.testing import (
    NotEquivalentError,
    assert_equivalent,
    check_center_reading_weights,
    check_center_unembed,
    check_center_writing_weights,
    check_fold_layer_norm,
    check_fold_rms_norm,
    check_fold_value_biases,
    check_identity,
    check_layer_norm_to_rms_norm,
    check_model,
    check_refactor_factored_attn_matrices,
    check_remove_key_biases,
    check_shortformer_to_tables,
)

F64 = torch.float64
BASE = dict(n_layers=2, d_model=6, n_heads=2, d_head=3, d_vocab=9, n_ctx=5, d_mlp=12)

#: The models a checker is tried on: changes to :data:`BASE`.
MODELS = (
    {},
    {"n_heads": 4, "n_key_value_heads": 2},
    {"normalization_type": "RMS", "gated_mlp": True},
    {"positional_embedding_type": "shortformer"},
    {"normalization_type": "RMSPre"},
    {"embedding_scale": 6**0.5},
    {"logit_scale": 0.0625},
    {"normalization_type": "RMS", "gated_mlp": True, "n_experts": 4, "experts_per_token": 2},
)


def _differing(identity, changes) -> int:
    """How many of ``identity``'s wrong rewrites differ from its exact rewrite on the model
    ``changes`` by more than float64 rounding (-1 where it does not apply)."""
    cfg, before = _model(**changes)
    try:
        prepared, prepared_cfg = _prepared(identity, before, cfg)
        exact, exact_cfg = identity.transform(prepared, prepared_cfg)
    except cm.PreconditionError:
        return -1
    count = 0
    for wrong in identity.wrong_rewrites_for(prepared_cfg).values():
        try:
            after, after_cfg = wrong(prepared, prepared_cfg)
        except ValueError:  # a mistake this model has no tensor for
            continue
        count += not (after_cfg == exact_cfg and after.keys() == exact.keys()
                      and all(torch.allclose(after[k], exact[k], rtol=1e-9, atol=1e-12) for k in after))
    return count


def _checkers() -> dict:
    """Each checker the registry derives (``testing.CHECKERS``), with the first model of
    :data:`MODELS` its identity applies to on which most of its wrong rewrites differ from the
    exact rewrite."""
    out = {}
    for name, checker in testing.CHECKERS.items():
        identity = cm.get_identity(name)
        counts = [_differing(identity, changes) for changes in MODELS]
        assert max(counts) >= 0, f"{name} applies to none of the checkers' models"
        out[name] = (checker, MODELS[counts.index(max(counts))])
    return out


def _model(seed=0, **changes):
    cfg = cm.Config(**BASE).replace(**changes)
    return cfg, cm.random_state_dict(cfg, seed=seed, dtype=F64)


def _prepared(identity, sd, cfg):
    return identity.prepare(sd, cfg) if identity.prepare else (sd, cfg)


CHECKERS = _checkers()


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_checker_recognises_the_exact_rewrite(name):
    checker, changes = CHECKERS[name]
    identity = cm.get_identity(name)
    cfg, before = _model(**changes)
    after, after_cfg = identity.transform(*_prepared(identity, before, cfg))
    report = checker(before, after, cfg, after_cfg=after_cfg)
    assert report.ok, report
    row = next(f for f in report.findings if f.name == name)
    assert row.rewrite == "exact" and row.status == "holds"
    assert checker is testing.CHECKERS[name] and checker.__name__ == f"check_{identity.function}"
    assert f":func:`circuitmath.{identity.function}`" in checker.__doc__


def test_the_checkers_come_from_the_registry():
    """One checker per weight identity whose transform is public, named after that function."""
    expected = {i.name for i in cm.identities() if i.compare is None and i.function}
    assert set(testing.CHECKERS) == set(CHECKERS) == expected - {"centering_projection"}  # it shares center_writing_weights'
    for name, checker in testing.CHECKERS.items():
        identity = cm.get_identity(name)
        # a symmetry's public transform takes its parameter (Q, the permutation); the registry's fixes one
        assert getattr(cm, identity.function) is identity.transform or identity.name in SYMMETRIES, name
        assert getattr(testing, checker.__name__) is checker and checker.__name__ in testing.__all__


def test_no_checker_is_written_by_hand():
    """Every public ``check_*`` but check_model and check_identity is derived from the registry:
    all of them run the one function body that ``testing`` makes per registered identity."""
    derived = {checker.__name__ for checker in testing.CHECKERS.values()}
    public = {name for name in testing.__all__ if name.startswith("check_")}
    assert public - derived == {"check_model", "check_identity"}
    assert len({checker.__code__ for checker in testing.CHECKERS.values()}) == 1
    assert testing.check_model.__code__ not in {checker.__code__ for checker in testing.CHECKERS.values()}


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_checker_rejects_every_registered_wrong_rewrite(name):
    checker, changes = CHECKERS[name]
    identity = cm.get_identity(name)
    cfg, before = _model(**changes)
    prepared, prepared_cfg = _prepared(identity, before, cfg)
    exact, exact_cfg = identity.transform(prepared, prepared_cfg)
    for wrong_name, wrong in identity.wrong_everywhere.items():
        after, after_cfg = wrong(prepared, prepared_cfg)
        if after_cfg == exact_cfg and after.keys() == exact.keys() and all(torch.equal(after[k], exact[k]) for k in after):
            continue  # not wrong on this model (e.g. centering a shortformer W_pos in a standard model)
        report = checker(before, after, cfg, after_cfg=after_cfg)
        assert not report.ok, f"{name}.{wrong_name} went unnoticed:\n{report}"
        changed_tensors = any(after.get(k) is not prepared.get(k) for k in set(after) | set(prepared))
        if changed_tensors and any(f.rewrite == f"{name}.{wrong_name}" for f in report.findings):
            continue
        # not named: then what differs is listed (tensors, or config fields)
        assert report.culprits() or "config differs" in str(report), f"{name}.{wrong_name}:\n{report}"


def test_the_wrong_rewrites_are_named_for_the_folds():
    cfg, before = _model()
    for wrong_name in ("drop_bias", "bias_through_gain"):
        after, after_cfg = cm.get_identity("fold_layer_norm").wrong_everywhere[wrong_name](before, cfg)
        report = check_fold_layer_norm(before, after, cfg, after_cfg=after_cfg)
        assert [f.rewrite for f in report.violations if f.kind == "identity"] == [f"fold_layer_norm.{wrong_name}"]


def test_an_unprocessed_model_is_not_recognised_as_processed():
    cfg, before = _model()
    report = check_fold_value_biases(before, dict(before), cfg)
    row = report.findings[0]
    assert row.status == "not recognised" and not report.ok
    assert "none of the tensors this identity rewrites matches" in row.explanation
    assert {p.name for p in row.parameters} == {"blocks.0.attn.b_O", "blocks.0.attn.b_V", "blocks.1.attn.b_O", "blocks.1.attn.b_V"}


def test_another_balanced_factorisation_keeps_the_function_but_is_not_the_rewrite():
    cfg, before = _model()
    after, after_cfg = cm.refactor_factored_attn_matrices(before, cfg)
    flipped = dict(after)
    flipped["blocks.0.attn.W_V"] = -after["blocks.0.attn.W_V"]  # W_V -> -W_V, W_O -> -W_O: same W_OV
    flipped["blocks.0.attn.b_V"] = -after["blocks.0.attn.b_V"]
    flipped["blocks.0.attn.W_O"] = -after["blocks.0.attn.W_O"]
    report = check_refactor_factored_attn_matrices(before, flipped, cfg, after_cfg=after_cfg)
    assert report.comparison.passed
    assert {p.name for p in report.findings[-2].parameters} == {"blocks.0.attn.W_V", "blocks.0.attn.b_V", "blocks.0.attn.W_O"}
    assert report.findings[-2].status == "holds"  # the residual: differences that do not change log-probs


def test_check_identity_covers_every_weight_identity_and_refuses_computations():
    cfg, before = _model()
    for identity in cm.identities():
        if identity.compare is not None:
            with pytest.raises(ValueError, match="licenses a computation"):
                check_identity(identity.name, before, before, cfg)
            continue
        try:
            after, after_cfg = identity.transform(*_prepared(identity, before, cfg))
        except cm.PreconditionError:
            continue  # refuses this model (e.g. RMSNorm folding on a LayerNorm model)
        report = check_identity(identity.name, before, after, cfg, after_cfg=after_cfg)
        assert report.ok, f"{identity.name}:\n{report}"


def test_check_model_rows_and_reasons():
    cfg, before = _model(normalization_type="RMS")
    report = check_model(before, cfg)
    rows = {f.name: f for f in report.findings}
    assert report.ok
    assert rows["fold_rms_norm"].status == "holds" and rows["fold_rms_norm"].max_abs_error <= rows["fold_rms_norm"].tolerance
    assert rows["fold_layer_norm"].status == "not applicable" and rows["fold_layer_norm"].precondition == "normalization_type is LN"
    assert "centering_projection" not in rows  # the same transform as center_writing_weights, checked once


# -- input forms ---------------------------------------------------------------------------------


def test_safetensors_files_carry_their_configs(tmp_path):
    cfg, before = _model()
    after, after_cfg = cm.process_weights(before, cfg)
    io.save(tmp_path / "before.safetensors", before, cfg)
    io.save(tmp_path / "after.safetensors", after, after_cfg)
    assert assert_equivalent(tmp_path / "before.safetensors", str(tmp_path / "after.safetensors")).passed
    wrong = dict(after, **{"unembed.W_U": after["unembed.W_U"].flip(0)})
    io.save(tmp_path / "wrong.safetensors", wrong, after_cfg)
    with pytest.raises(NotEquivalentError, match="unembed.W_U"):
        assert_equivalent(tmp_path / "before.safetensors", tmp_path / "wrong.safetensors")


def test_a_plain_safetensors_file_needs_its_config(tmp_path):
    from safetensors.torch import save_file

    cfg, before = _model()
    save_file(before, str(tmp_path / "plain.safetensors"))
    with pytest.raises(cm.StateDictError, match="pass its config"):
        assert_equivalent(tmp_path / "plain.safetensors", before)
    assert assert_equivalent(tmp_path / "plain.safetensors", before, cfg).passed


def test_hugging_face_state_dicts_are_converted():
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=12, n_layer=2, n_head=3,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_(torch.randn_like(param) * 0.5 + (1.0 if name.endswith("ln_1.weight") else 0.0))
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    converted, cfg = io.from_hf(hf, config)
    processed, processed_cfg = cm.process_weights(converted, cfg)
    # before in Hugging Face format, after in TransformerLens format
    assert assert_equivalent(hf, processed, config, after_cfg=processed_cfg).passed
    # both in Hugging Face format, with the HF config as a dict (config.json)
    broken = dict(hf)
    broken["transformer.h.1.attn.c_proj.bias"] = hf["transformer.h.1.attn.c_proj.bias"].flip(0)
    with pytest.raises(NotEquivalentError) as caught:
        assert_equivalent(hf, broken, config.to_dict())
    # named as the input names it (issue 35), circuitmath's name kept beside it
    assert [p.name for p in caught.value.diagnosis.culprits()] == ["transformer.h.1.attn.c_proj.bias"]
    assert [p.as_dict()["circuitmath_name"] for p in caught.value.diagnosis.culprits()] == ["blocks.1.attn.b_O"]


def test_transformer_lens_buffers_are_ignored():
    cfg, before = _model()
    with_buffers = dict(before)
    for layer in range(cfg.n_layers):
        with_buffers[f"blocks.{layer}.attn.mask"] = torch.ones(cfg.n_ctx, cfg.n_ctx, dtype=torch.bool).tril()
        with_buffers[f"blocks.{layer}.attn.IGNORE"] = torch.tensor(-1e5)
    assert assert_equivalent(with_buffers, before, cfg).passed


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda sd: sd.pop("blocks.1.attn.W_Q"), "missing keys"),
        (lambda sd: sd.update({"blocks.0.mlp.W_in": torch.zeros(6, 13, dtype=F64)}), "has shape"),
        (lambda sd: sd["unembed.b_U"].__setitem__(0, float("nan")), "NaN or Inf"),
        (lambda sd: sd["embed.W_E"].__setitem__((1, 1), float("inf")), "NaN or Inf"),
        (lambda sd: sd.update({"blocks.2.attn.W_Q": torch.zeros(2, 6, 3, dtype=F64)}), "unexpected keys"),
    ],
    ids=["missing", "shape", "nan", "inf", "config mismatch"],
)
def test_bad_state_dicts_are_clear_errors(break_it, message):
    cfg, before = _model()
    broken = {k: v.clone() for k, v in before.items()}
    break_it(broken)
    for args in ((broken, before), (before, broken)):
        with pytest.raises(cm.StateDictError, match=message):
            assert_equivalent(*args, cfg)


def test_a_pickle_is_refused_without_being_read(tmp_path):
    cfg, before = _model()
    torch.save(before, tmp_path / "model.pt")
    with pytest.raises(io.UnsafeFormatError, match="never unpickles"):
        assert_equivalent(tmp_path / "model.pt", before, cfg)


# -- the public API a separate project uses ------------------------------------------------------


@pytest.mark.parametrize("module", ["circuitmath", "circuitmath.testing", "circuitmath.strategies", "circuitmath.io"])
def test_every_documented_name_imports_and_is_documented(module):
    mod = importlib.import_module(module)
    for name in mod.__all__:
        obj = getattr(mod, name)
        assert obj is not None, f"{module}.{name}"
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"{module}.{name} has no docstring"


def test_checkers_take_before_after_cfg_and_keywords_only_beyond():
    for name in testing.__all__:
        if name.startswith("check_") and name not in ("check_model", "check_identity"):
            parameters = list(inspect.signature(getattr(testing, name)).parameters.values())
            assert [p.name for p in parameters[:3]] == ["before", "after", "cfg"], name
            assert all(p.kind is p.KEYWORD_ONLY for p in parameters[3:]), name


def test_strategies_follow_hypothesis_api_style():
    cfg = cm.Config(**BASE)
    built = [strategies.configs(), strategies.state_dicts(cfg), strategies.models(), strategies.tokens(cfg)]
    assert all(isinstance(s, st.SearchStrategy) for s in built)  # strategies, not values
    for function in (strategies.configs, strategies.state_dicts, strategies.models, strategies.tokens):
        parameters = list(inspect.signature(function).parameters.values())
        options = [p for p in parameters if p.name != "cfg" and p.kind is not p.VAR_KEYWORD]
        assert all(p.kind is p.KEYWORD_ONLY for p in options), function.__name__  # keyword-only options
        assert ">>>" in function.__doc__, f"{function.__name__} has no example"
    for call in (
        lambda: strategies.configs(max_layers=-1),
        lambda: strategies.configs(normalization_types=("BatchNorm",)),
        lambda: strategies.state_dicts(cfg, dtype=torch.int64),
        lambda: strategies.models(weights={"max_outlier_scale": 0.5}),
        lambda: strategies.tokens(cfg, max_batch=0),
    ):
        with pytest.raises(InvalidArgument):  # validated when built, before anything is drawn
            call()
