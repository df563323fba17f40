"""``check MODEL`` streamed (circuitmath._streaming_check_model) against the in-memory check, where the
two could part: the model-wide decision of layer_norm_to_rms_norm and its refusal's reason when
writers of several parts are off-center."""

import pytest
import torch

import circuitmath as cm
from circuitmath import _diagnosis as diagnosis_module
from circuitmath import _streaming_check_model as streaming_model
from circuitmath import io
from circuitmath._processing.norms import WRITES_CENTERED
from circuitmath._streaming_check_model import check_model_streaming
from support import Identity, same_rows, with_identities

CFG = cm.Config(n_layers=4, d_model=16, n_heads=2, d_head=8, d_vocab=13, n_ctx=6, d_mlp=32,
                normalization_type="LNPre")
TOKENS = torch.randint(0, CFG.d_vocab, (2, CFG.n_ctx), generator=torch.Generator().manual_seed(0))


def _folder(tmp_path, offsets: dict[str, float], dtype=torch.float32):
    """A circuitmath folder of an ``LNPre`` model (``dtype``), every write centered, then each
    writer named in ``offsets`` shifted by its value (its mean over d_model)."""
    state_dict, cfg = cm.center_writing_weights(cm.random_state_dict(CFG, seed=0), CFG)
    for name, offset in offsets.items():
        state_dict[name] = state_dict[name] + offset
    state_dict = {name: t.to(dtype) for name, t in state_dict.items()}
    io.save(tmp_path / "m.safetensors", state_dict, cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "lnpre", steps=[])
    return tmp_path / "lnpre", state_dict, cfg


def _checked(tmp_path, monkeypatch, offsets, dtype=torch.float32):
    """layer_norm_to_rms_norm without its preparation (so the writers stay as given), and
    fold_value_biases, which holds: both checks' rows."""
    folder, state_dict, cfg = _folder(tmp_path, offsets, dtype)
    with_identities(monkeypatch, Identity("layer_norm_to_rms_norm", cm.layer_norm_to_rms_norm),
                     Identity("fold_value_biases", cm.fold_value_biases))
    return (check_model_streaming(folder, tokens=TOKENS),
            diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS))


# Writers off-center in several parts. The ends and two blocks, the worst in the last part read
# (block 3): the first part read (the ends) has one uncentered writer, not the worst. Two blocks,
# the ends centered: the first block's is not the worst. The offsets exceed what bfloat16 rounding
# may leave (16 eps(bfloat16) times the largest writer entry, 21.4: 2.7).
SEVERAL_PARTS = {"embed.W_E": 3.0, "blocks.1.mlp.W_out": 5.0, "blocks.3.attn.b_O": 8.0}
TWO_BLOCKS = {"blocks.0.mlp.W_out": 5.0, "blocks.2.attn.W_O": 8.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offsets", [SEVERAL_PARTS, TWO_BLOCKS], ids=["ends-and-blocks", "two-blocks"])
def test_a_refusal_names_the_uncentered_writers_of_every_part(tmp_path, monkeypatch, offsets, dtype):
    """Streamed, the refusal's reason is the in-memory one: the count of every part's uncentered
    writers and the worst of them all (the last one off-center here)."""
    streamed, in_memory = _checked(tmp_path, monkeypatch, offsets, dtype)
    same_rows(streamed, in_memory)
    refused, kept = streamed.findings
    assert refused.status == "not applicable" and refused.precondition == WRITES_CENTERED
    assert f"does not hold: {len(offsets)} writer(s)" in refused.reason
    assert refused.reason.endswith(f" in {list(offsets)[-1]}; center them first (center_writing_weights)")
    assert kept.status == "holds"


@pytest.mark.parametrize("offsets", [SEVERAL_PARTS, TWO_BLOCKS], ids=["ends-and-blocks", "two-blocks"])
def test_a_refusal_from_the_first_part_alone_is_caught(tmp_path, monkeypatch, offsets):
    """Negative twin: each part judged on its own writers (against the whole model's largest
    entry, as the streamed check did before its first pass recorded every writer's mean) refuses
    with the first uncentered part's writers alone, and the rows differ."""
    answer = streaming_model._ModelWriters.__call__

    def own_writers(self, means, scale):
        model_means, model_scale = answer(self, means, scale)
        return model_means if self.recording else means, model_scale

    monkeypatch.setattr(streaming_model._ModelWriters, "__call__", own_writers)
    streamed, in_memory = _checked(tmp_path, monkeypatch, offsets)
    first = list(offsets)[0]
    assert streamed.findings[0].precondition == WRITES_CENTERED
    assert streamed.findings[0].reason.endswith(f" in {first}; center them first (center_writing_weights)")
    assert "does not hold: 1 writer(s)" in streamed.findings[0].reason
    with pytest.raises(AssertionError, match="layer_norm_to_rms_norm"):
        same_rows(streamed, in_memory)


def _fold_then_switch(state_dict, cfg):
    """The LayerNorm fold, then layer_norm_to_rms_norm with no centering in between."""
    return cm.layer_norm_to_rms_norm(*cm.fold_layer_norm(state_dict, cfg))


def test_a_refusal_before_the_decision_comes_first_as_in_memory(tmp_path, monkeypatch):
    """An LN model with a gated MLP whose block 2 alone reads ln2's bias through W_gate (no bias
    of its own to fold it into), and uncentered writers everywhere: in memory the fold refuses,
    before layer_norm_to_rms_norm's decision is reached. Streamed, the recording pass meets that
    refusal on block 2 only, after the ends have reached the decision, and the ends decide on the
    whole model's writers: the fold's refusal still comes first."""
    cfg = CFG.replace(normalization_type="LN", gated_mlp=True, act_fn="silu")
    state_dict = cm.random_state_dict(cfg, seed=0)
    for layer in (0, 1, 3):
        state_dict[f"blocks.{layer}.ln2.b"] = torch.zeros_like(state_dict[f"blocks.{layer}.ln2.b"])
    io.save(tmp_path / "m.safetensors", state_dict, cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "ln", steps=[])
    with_identities(monkeypatch, Identity("fold_then_switch", _fold_then_switch),
                     Identity("switch", cm.layer_norm_to_rms_norm, prepare=cm.fold_layer_norm))
    streamed = check_model_streaming(tmp_path / "ln", tokens=TOKENS)
    in_memory = diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS)
    same_rows(streamed, in_memory)
    for refused in streamed.findings:
        assert refused.status == "not applicable" and "blocks.2.mlp.W_gate has no bias" in refused.reason
    # negative twin: the block's refusal forgotten, the ends refuse on the writers
    original = streaming_model._Run.__setattr__
    monkeypatch.setattr(streaming_model._Run, "__setattr__",
                        lambda self, name, value: original(self, name, None if name == "recorded" else value))
    forgot = check_model_streaming(tmp_path / "ln", tokens=TOKENS)
    assert all(f.precondition == WRITES_CENTERED for f in forgot.findings)
    with pytest.raises(AssertionError, match="fold_then_switch"):
        same_rows(forgot, in_memory)


@pytest.mark.parametrize("dtype, exact", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_process_weights_applies_the_whole_models_steps_in_every_part(tmp_path, monkeypatch, dtype, exact):
    """The process_weights row of an LN model with a gated MLP whose blocks 1 to 3 read ln2's
    bias through W_gate (block 0's is zero): the ends and block 0 could fold the LayerNorm, the
    whole model cannot, so in the end every part of the streamed check applies the steps that
    process_weights applies to the whole model (the steps left out go to the identity's
    with_parameters), with the in-memory row; with ``exact``, so does the float64 chain."""
    cfg = CFG.replace(normalization_type="LN", gated_mlp=True, act_fn="silu")
    state_dict = cm.random_state_dict(cfg, seed=0)
    state_dict["blocks.0.ln2.b"] = torch.zeros_like(state_dict["blocks.0.ln2.b"])
    state_dict = {name: t.to(dtype) for name, t in state_dict.items()}
    io.save(tmp_path / "m.safetensors", state_dict, cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "ln", steps=[])
    identity, = [i for i in diagnosis_module.weight_identities(symmetries=True) if i.name == "process_weights"]
    with_identities(monkeypatch, identity)
    applied, applied64, transformed = {}, {}, streaming_model._Run.transformed

    def spy(self, parts, layer):
        got = transformed(self, parts, layer)
        applied[layer] = got[3].applied
        if len(got) > 4:
            applied64[layer] = got[7].applied
        return got

    monkeypatch.setattr(streaming_model._Run, "transformed", spy)
    streamed = check_model_streaming(tmp_path / "ln", tokens=TOKENS, exact=exact)
    assert streamed.findings[0].status == "holds" and set(applied) == {None, *range(cfg.n_layers)}
    whole = identity.transform(state_dict, cfg)[1].applied
    assert "fold_layer_norm" not in whole
    assert all(part == whole for part in applied.values()), applied
    assert bool(applied64) == exact and all(part == whole for part in applied64.values()), applied64
    same_rows(streamed, diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS))
