"""``check MODEL`` below float64 (circuitmath._diagnosis._exact): each identity is checked in
float64 on the model's weights as well as in the model's dtype, and the tensors its transform
wrote in the model's dtype are certified against the float64 rewrite. In memory always, and
streamed with ``exact=True`` (``check FOLDER --exact``), the same rows."""

import dataclasses

import pytest
import torch

import circuitmath as cm
from circuitmath import _diagnosis as diagnosis_module
from circuitmath import _streaming_check_model as streaming_model
from circuitmath import io
from circuitmath._diagnosis import weight_identities
from circuitmath._streaming_check_model import check_model_streaming
from support import Identity, same_rows, with_identities

MODELS = {
    "LN": cm.Config(n_layers=2, d_model=6, n_heads=2, d_head=3, d_vocab=13, n_ctx=16, d_mlp=24),
    "RMS, grouped-query": cm.Config(n_layers=2, d_model=8, n_heads=4, d_head=2, d_vocab=13, n_ctx=16, d_mlp=16,
                                    normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
                                    n_key_value_heads=2, act_fn="silu"),
}
TOKENS = torch.randint(0, 13, (2, 16), generator=torch.Generator().manual_seed(0))


def _row(state_dict, cfg, identity) -> "cm.Finding":
    chosen = (identity,)
    original = diagnosis_module.weight_identities
    diagnosis_module.weight_identities = lambda symmetries: chosen
    try:
        return diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS).findings[0]
    finally:
        diagnosis_module.weight_identities = original


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_wrong_rewrite_caught_in_float64_is_caught_in_half_precision(model):
    """Each registered wrong rewrite put in place of its identity's transform: where the check of
    the float64 model reports it violated, the checks of the same weights in bfloat16 and float16
    do too. In the model's dtype alone, 9 of 282 such cases held on these and a 64-wide model
    (bfloat16's tolerance was 0.125 nats on the LN model, the wrong rewrites' 0.01 to 0.03)."""
    cfg = MODELS[model]
    weights = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    weights = {k: v.to(torch.bfloat16).double() for k, v in weights.items()}  # exact in every dtype below
    caught = 0
    for identity in weight_identities(symmetries=True):
        for name, wrong in identity.wrong_rewrites_for(cfg).items():
            fake = dataclasses.replace(identity, transform=wrong.function)
            try:
                if _row(weights, cfg, fake).status != "violated":
                    continue  # the same as the exact rewrite on this model, or not applicable
            except (cm.CircuitMathError, ValueError):
                continue  # a wrong rewrite of a tensor this architecture has not (W_pos of a rotary model)
            caught += 1
            for dtype in (torch.bfloat16, torch.float16):
                row = _row({k: v.to(dtype) for k, v in weights.items()}, cfg, fake)
                assert row.status == "violated", f"{identity.name}.{name} in {dtype}:\n{row}"
    assert caught >= 10


def _center_unembed_rounding_the_mean(state_dict, cfg):
    """center_unembed as it was: the mean rounded to the model's dtype, then subtracted."""
    out, out_cfg = cm.center_unembed(state_dict, cfg)
    W_U = state_dict["unembed.W_U"]
    return dict(out, **{"unembed.W_U": W_U - W_U.mean(dim=-1, keepdim=True)}), out_cfg


def test_a_rewrite_rounded_twice_is_named_by_its_certificate(tmp_path, monkeypatch):
    """In bfloat16 the twice-rounded centering moves the log-probs by less than rounding may
    (holds in the model's dtype) and is exact in float64 (holds there): the certificate names
    ``unembed.W_U``, in memory and streamed. The exact one holds."""
    cfg = MODELS["LN"].replace(d_vocab=300)
    state_dict = cm.random_state_dict(cfg, seed=0, dtype=torch.bfloat16)
    io.save(tmp_path / "m.safetensors", state_dict, cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "folder", steps=[])
    with_identities(monkeypatch, Identity("center_unembed", cm.center_unembed),
                    Identity("center_unembed.twice", _center_unembed_rounding_the_mean))
    tokens = TOKENS % cfg.d_vocab
    in_memory = diagnosis_module.check_model(state_dict, cfg, tokens=tokens)
    streamed = check_model_streaming(tmp_path / "folder", tokens=tokens, exact=True)
    same_rows(streamed, in_memory, tolerances=0.5)
    exact, twice = in_memory.findings
    assert exact.status == "holds" and not exact.parameters
    assert twice.status == "violated" and twice.max_abs_error <= twice.tolerance
    assert [p.name for p in twice.parameters] == ["unembed.W_U"] == [p.name for p in streamed.findings[1].parameters]
    assert "not the float64 rewrite rounded once" in twice.explanation


def test_a_wrong_rewrite_is_caught_in_float64_streamed_as_in_memory(tmp_path, monkeypatch):
    """layer_norm_to_rms_norm with another eps, on a bfloat16 LayerNorm model: within bfloat16's
    tolerance, beyond float64's; violated in both checks, with float64's numbers."""
    cfg = MODELS["LN"]
    state_dict = cm.random_state_dict(cfg, seed=0, dtype=torch.bfloat16)
    io.save(tmp_path / "m.safetensors", state_dict, cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "folder", steps=[])
    identity = next(i for i in weight_identities(symmetries=True) if i.name == "layer_norm_to_rms_norm")
    wrong = dataclasses.replace(identity, name="layer_norm_to_rms_norm.other_eps",
                                transform=identity.wrong_rewrites["other_eps"].function)
    with_identities(monkeypatch, identity, wrong)
    in_memory = diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS)
    streamed = check_model_streaming(tmp_path / "folder", tokens=TOKENS, exact=True)
    same_rows(streamed, in_memory, tolerances=0.5)
    assert [f.status for f in in_memory.findings] == ["holds", "violated"]
    row = in_memory.findings[1]
    assert row.tolerance < 1e-9 < row.max_abs_error and "in float64" in row.explanation
    # without exact, a folder is checked in its dtype alone: the wrong rewrite holds there
    assert [f.status for f in check_model_streaming(tmp_path / "folder", tokens=TOKENS).findings] == ["holds", "holds"]


def test_float64_models_are_checked_once(monkeypatch):
    """A float64 model's own comparison is float64's: no second one, no certificate."""
    calls = []
    original = diagnosis_module.float64_chain
    monkeypatch.setattr(diagnosis_module, "float64_chain", lambda *a: calls.append(a) or original(*a))
    cfg = MODELS["LN"]
    assert diagnosis_module.check_model(cm.random_state_dict(cfg, seed=0, dtype=torch.float64), cfg, tokens=TOKENS).ok
    assert not calls
    assert diagnosis_module.check_model(cm.random_state_dict(cfg, seed=0, dtype=torch.float32), cfg, tokens=TOKENS).ok
    assert calls


def test_each_identitys_models_are_freed_before_the_one_after_the_next_runs(monkeypatch):
    """The log-prob caches and the validation keep no identity's prepared or transformed model
    once the next identity's row is made (in float32 and in float64): memory holds two
    identities' at a time (the next one's preparation may be one of the last one's models)."""
    import gc
    import weakref

    written = []  # (identity, weak reference to a tensor it wrote)

    def shift(i):
        def shifted_unembed_bias(state_dict, cfg):  # exact: every logit shifted by 1
            gc.collect()
            alive = [j for j, ref in written if j < i - 1 and ref() is not None]
            assert not alive, f"identity {i} runs while the outputs of {alive} are alive"
            out = dict(state_dict, **{"unembed.b_U": state_dict["unembed.b_U"] + 1.0})
            written.append((i, weakref.ref(out["unembed.b_U"])))
            return out, cfg
        return shifted_unembed_bias

    with_identities(monkeypatch, *[Identity(f"shift_{i}", shift(i)) for i in range(4)])
    cfg = MODELS["LN"]
    report = diagnosis_module.check_model(cm.random_state_dict(cfg, seed=0, dtype=torch.float32), cfg, tokens=TOKENS)
    assert report.ok and len(written) == 8  # each identity in float32 and in float64


def test_an_identity_refused_in_float64_is_checked_in_its_dtype_and_says_so(tmp_path, monkeypatch):
    """layer_norm_to_rms_norm without its preparation on a bfloat16 LNPre model whose writes were
    centered in float32 and rounded: centered to bfloat16's rounding, not to float64's. The row
    holds on the model's dtype's comparison and says that float64 refused, in memory and
    streamed with exact=True."""
    cfg = MODELS["LN"].replace(normalization_type="LNPre")
    centered, cfg = cm.center_writing_weights(cm.random_state_dict(cfg, seed=0), cfg)
    state_dict = {k: v.to(torch.bfloat16) for k, v in centered.items()}
    io.save(tmp_path / "m.safetensors", state_dict, cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "folder", steps=[])
    with_identities(monkeypatch, Identity("layer_norm_to_rms_norm", cm.layer_norm_to_rms_norm))
    in_memory = diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS)
    streamed = check_model_streaming(tmp_path / "folder", tokens=TOKENS, exact=True)
    same_rows(streamed, in_memory, tolerances=0.5)
    for row in (in_memory.findings[0], streamed.findings[0]):
        assert row.status == "holds" and "in float64 the identity refuses these weights" in row.explanation


def test_a_preparation_equal_to_the_last_identitys_model_is_not_run_again(monkeypatch):
    """center_reading_weights prepares by folding the LayerNorm: its preparation is the model
    fold_layer_norm's row wrote, computed again, and its log-probs are taken from that row (one
    float32 pass fewer), with the same rows as when each is checked alone."""
    from circuitmath._diagnosis import _logprobs

    passes = []
    original = _logprobs.log_probs
    monkeypatch.setattr(_logprobs, "log_probs",
                        lambda sd, cfg, tokens: passes.append(next(iter(sd.values())).dtype) or original(sd, cfg, tokens))
    cfg = MODELS["LN"]
    state_dict = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    chosen = [i for i in weight_identities(symmetries=True) if i.name in ("fold_layer_norm", "center_reading_weights")]
    with_identities(monkeypatch, *chosen)
    together = diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS)
    in_float32 = [dtype for dtype in passes if dtype == torch.float32]
    assert together.ok and len(in_float32) == 3  # the model, and each identity's transform
    alone = []
    for identity in chosen:
        with_identities(monkeypatch, identity)
        alone += diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS).findings
    same_rows(together, diagnosis_module.Diagnosis(tuple(alone)), tolerances=1e-9)


def test_models_are_one_when_their_configs_and_every_entry_are_equal():
    """same_model: equal copies are one model; one entry changed, another config, an unknown
    config or a missing tensor are not."""
    from circuitmath._diagnosis._logprobs import same_model

    cfg = MODELS["LN"]
    a = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    b = {k: v.clone() for k, v in a.items()}
    assert same_model(a, cfg, b, cfg)
    b["blocks.1.mlp.W_out"][3, 2] += 1e-3
    assert not same_model(a, cfg, b, cfg)
    assert not same_model(a, cfg, a, cfg.replace(applied=("fold_layer_norm",)))
    assert not same_model(a, None, a, cfg)
    assert not same_model(a, cfg, {k: v for k, v in a.items() if k != "unembed.b_U"}, cfg)


def test_a_preparation_in_float64_takes_the_models_own_tensors_from_its_float64_copy():
    """in_float64 of a preparation given the model and its float64 copy: the tensors the
    preparation left alone are the copy's, the others converted; entry by entry what converting
    it all gives, and validated as that is."""
    from circuitmath._diagnosis._exact import in_float64
    from circuitmath._state import Validated, validated

    cfg = MODELS["LN"]
    model = validated(cm.random_state_dict(cfg, seed=0, dtype=torch.float32), cfg)
    model64 = in_float64(model)
    prepared, prepared_cfg = cm.fold_layer_norm(model, cfg)
    known = in_float64(prepared, (model, model64))
    whole = in_float64(prepared)
    assert isinstance(known, Validated) and known.dtype == torch.float64 and known.cfg == prepared_cfg
    assert all(torch.equal(known[k], whole[k]) and known[k].dtype == torch.float64 for k in whole)
    kept = [k for k in prepared if prepared[k] is model[k]]
    assert kept and all(known[k] is model64[k] for k in kept)
    assert all(known[k] is not model64[k] for k in prepared if k not in kept)
