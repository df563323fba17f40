"""Diagnosis of wrongly processed state dicts: the violated identity and the parameters responsible.

Each wrong processing here is written out by hand, the way another project might get it wrong,
not produced by circuitmath's own catalogue of mistakes: the diagnosis has to recognise it.
"""

import pytest
import torch
from hypothesis import given, settings

import circuitmath as cm
from circuitmath.strategies import models

from support import wide
from circuitmath.testing import NotEquivalentError, assert_equivalent, diagnose

F64 = torch.float64


def _model(seed=1, dtype=F64, **changes):
    cfg = cm.Config(n_layers=2, d_model=6, n_heads=2, d_head=3, d_vocab=9, n_ctx=5, d_mlp=12).replace(**changes)
    return cfg, cm.random_state_dict(cfg, seed=seed, dtype=dtype)


def _only_violated_identity(report):
    """The one violated identity row (the ``before -> after`` row is violated too, by design)."""
    assert not report.ok
    rows = [f for f in report.violations if f.kind == "identity"]
    assert len(rows) == 1, report
    row = rows[0]
    assert row.max_abs_error > row.tolerance, row
    before_after = report.findings[-1]
    assert before_after.name == "before -> after" and before_after.status == "violated"
    return row


def test_layer_norm_gain_folded_along_the_wrong_axis():
    # d_head == d_model, so W_Q * w (scaling the output axis) broadcasts without an error.
    cfg, before = _model(d_head=6)
    after, after_cfg = cm.fold_layer_norm(before, cfg)
    after["blocks.0.attn.W_Q"] = before["blocks.0.attn.W_Q"] * before["blocks.0.ln1.w"]
    row = _only_violated_identity(diagnose(before, after, cfg, after_cfg=after_cfg))
    assert row.name == "fold_layer_norm" and row.rewrite == "fold_layer_norm.scale_columns"
    assert [(p.name, p.layer, p.heads) for p in row.parameters] == [("blocks.0.attn.W_Q", 0, (0, 1))]
    assert "columns, not its rows" in row.explanation
    assert row.parameters[0].relative_error > 0.1


def test_unembed_centered_over_d_model():
    cfg, before = _model()
    after = dict(before)
    after["unembed.W_U"] = before["unembed.W_U"] - before["unembed.W_U"].mean(dim=0, keepdim=True)
    after["unembed.b_U"] = before["unembed.b_U"] - before["unembed.b_U"].mean()
    row = _only_violated_identity(diagnose(before, after, cfg))
    assert row.name == "center_unembed" and row.rewrite == "center_unembed.over_d_model"
    assert [p.name for p in row.parameters] == ["unembed.W_U"]
    assert "instead of the vocabulary" in row.explanation


def test_value_biases_folded_without_the_sum_over_heads():
    cfg, before = _model()
    after = dict(before)
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        after[f"{p}.b_O"] = before[f"{p}.b_O"] + before[f"{p}.b_V"][0] @ before[f"{p}.W_O"][0]  # head 0 only
        after[f"{p}.b_V"] = torch.zeros_like(before[f"{p}.b_V"])
    row = _only_violated_identity(diagnose(before, after, cfg))
    assert row.name == "fold_value_biases" and row.rewrite == "fold_value_biases.no_sum_over_heads"
    assert [(p.name, p.layer) for p in row.parameters] == [("blocks.0.attn.b_O", 0), ("blocks.1.attn.b_O", 1)]


def test_shortformer_model_folded_naively():
    cfg, before = _model(positional_embedding_type="shortformer")
    # Fold as if W_pos entered the residual stream: ln1's gain then scales the positions too.
    after, _ = cm.fold_layer_norm(before, cfg.replace(positional_embedding_type="standard"))
    report = diagnose(before, after, cfg)
    row = _only_violated_identity(report)
    assert row.name == "fold_layer_norm" and row.rewrite == "shortformer_to_tables.naive_fold"
    assert "positions get scaled by w" in row.explanation
    named = {p.name for p in row.parameters}
    assert "pos_embed.W_pos" in named and {"blocks.0.attn.pos_Q", "blocks.1.attn.pos_K"} <= named
    assert "note: every" not in str(report)  # the folded norms were dropped, not kept as unit gains


def test_writing_weights_centered_in_an_rms_norm_model():
    cfg, before = _model(normalization_type="RMS")
    after = dict(before)
    for name in ["embed.W_E", "pos_embed.W_pos"] + [
        f"blocks.{l}.{n}" for l in range(cfg.n_layers) for n in ("attn.W_O", "attn.b_O", "mlp.W_out", "mlp.b_out")
    ]:
        after[name] = before[name] - before[name].mean(dim=-1, keepdim=True)
    row = _only_violated_identity(diagnose(before, after, cfg))
    assert row.name == "center_writing_weights" and not row.applicable
    assert row.precondition == "every reader sits behind a centering norm"
    assert "RMSNorm does not center" in row.reason
    assert {p.name for p in row.parameters} == {n for n in after if after[n] is not before[n]}
    heads = {p.name: p.heads for p in row.parameters}
    assert heads["blocks.1.attn.W_O"] == (0, 1)


def test_assert_equivalent_prints_the_diagnosis():
    cfg, before = _model()
    after, after_cfg = cm.process_weights(before, cfg)
    after["blocks.1.attn.b_O"] = after["blocks.1.attn.b_O"] + torch.linspace(-1, 1, cfg.d_model, dtype=F64)
    with pytest.raises(NotEquivalentError) as caught:
        assert_equivalent(before, after, cfg, after_cfg=after_cfg)
    message = str(caught.value)
    assert "models differ" in message and "residual" in message and "blocks.1.attn.b_O (layer 1)" in message
    found = caught.value.diagnosis
    assert [p.name for p in found.culprits()] == ["blocks.1.attn.b_O"]
    assert found.culprits()[0].written_by == "center_writing_weights"
    assert isinstance(caught.value, AssertionError) and not caught.value.comparison.passed


def test_a_change_no_identity_makes_is_named_with_the_identity_that_last_wrote_it():
    cfg, before = _model()
    after, after_cfg = cm.process_weights(before, cfg)
    # the rows of W_in (its input dimensions) reversed: its neurons reversed alone would be a
    # partial neuron permutation, named as such (tests/test_verdict_blame.py)
    after["blocks.0.mlp.W_in"] = after["blocks.0.mlp.W_in"].flip(0)
    report = diagnose(before, after, cfg, after_cfg=after_cfg)
    residual = [f for f in report.violations if f.name == "residual"]
    assert residual and [(p.name, p.written_by) for p in residual[0].parameters] == [
        ("blocks.0.mlp.W_in", "center_reading_weights")
    ]
    # the identity that wrote it last does not claim it exact (issue 16): its row names it; the others hold
    rows = {f.name: f for f in report.findings if f.kind == "identity"}
    writer = rows.pop("center_reading_weights")
    assert writer.status == "violated" and writer.rewrite == "unknown"
    assert [p.name for p in writer.parameters] == ["blocks.0.mlp.W_in"]
    assert "no known rewrite" in writer.explanation
    assert all(f.status == "holds" and f.rewrite == "exact" for f in rows.values())


def test_a_correct_processing_is_recognised_step_by_step_without_extra_forward_passes():
    cfg, before = _model()
    after, after_cfg = cm.process_weights(before, cfg)
    for recorded in (after_cfg, None):  # the recorded cfg.applied, or inferred from the tensors
        report = diagnose(before, after, cfg, after_cfg=recorded)
        assert report.ok, report
        rows = [f for f in report.findings if f.kind == "identity"]
        assert {f.name for f in rows} == set(after_cfg.applied)
        assert all(f.rewrite == "exact" and f.max_abs_error is None for f in rows)
        assert [f.kind for f in report.findings].count("residual") == 0
    assert report.replayed  # inferred: in registry order
    assert "exact rewrite" in report.table()


def test_norms_kept_with_unit_gain_are_read_as_folded():
    cfg, before = _model()
    after, after_cfg = cm.fold_layer_norm(before, cfg)
    for name in before:
        if name.endswith(".w") and "ln" in name:
            after[name] = torch.ones_like(before[name])
        elif name.endswith(".b") and "ln" in name:
            after[name] = torch.zeros_like(before[name])
    report = diagnose(before, after, cfg)  # after read against cfg itself: LN with unit gains
    assert report.ok, report
    assert any("read as LNPre" in note for note in report.notes)


def test_float64_weights_processed_in_float32_are_explained_as_precision_loss():
    cfg, before = _model()
    processed, processed_cfg = cm.process_weights({k: v.float() for k, v in before.items()}, cfg)
    after = {k: v.double() for k, v in processed.items()}
    report = diagnose(before, after, cfg, after_cfg=processed_cfg)
    assert not report.ok
    residual = next(f for f in report.findings if f.name == "residual")
    assert residual.status == "violated" and "float32 rounding" in residual.explanation
    assert all(f.status == "holds" for f in report.findings if f.kind == "identity")


def test_a_mistake_beside_float32_precision_loss_is_named_alone():
    """float64 weights processed in float32, and one tensor scaled: only that tensor is blamed; the
    tensors that differ within float32 rounding are counted in the explanation, not named."""
    cfg, before = _model()
    processed, processed_cfg = cm.process_weights({k: v.float() for k, v in before.items()}, cfg)
    after = {k: v.double() for k, v in processed.items()}
    after["blocks.1.mlp.W_out"] = after["blocks.1.mlp.W_out"] * 1.1
    report = diagnose(before, after, cfg, after_cfg=processed_cfg)
    assert [p.name for p in report.culprits()] == ["blocks.1.mlp.W_out"]
    residual = next(f for f in report.findings if f.name == "residual")
    assert "more tensors differ within float32 rounding" in residual.explanation


def test_diagnosis_as_json_rows():
    cfg, before = _model()
    after = dict(before, **{"unembed.W_U": before["unembed.W_U"] - before["unembed.W_U"].mean(0)})
    rows = diagnose(before, after, cfg).as_dicts()
    assert [r["kind"] for r in rows] == ["identity", "residual", "equivalence"]
    for row in rows:
        assert {"name", "applicable", "max_abs_error", "tolerance", "status"} <= row.keys()
    assert rows[0]["parameters"][0]["name"] == "unembed.W_U"


@settings(max_examples=10, deadline=None)
@given(models(**wide(normalization_types=("LN", "RMS"), positional_embedding_types=("standard", "shortformer", "rotary"),
              min_layers=1)))
def test_process_weights_output_is_recognised_exactly(model):
    cfg, before = model
    after, after_cfg = cm.process_weights(before, cfg, **dict.fromkeys(
        ["fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases"]))
    report = diagnose(before, after, cfg, after_cfg=after_cfg)
    assert report.ok, report
    assert all(f.rewrite == "exact" for f in report.findings if f.kind == "identity")


def test_an_exact_unknown_processing_split_across_identities_passes_without_claiming_exact():
    """One head's OV factors rescaled (``W_V * 2``, ``W_O / 2``) after process_weights: ``W_V`` is
    last rewritten by one identity and ``W_O`` by another, so each alone changes the function but
    together they do not. The report passes; the two rows say their rewrite is unknown, not exact."""
    cfg, before = _model()
    after, after_cfg = cm.process_weights(before, cfg)
    for name, factor in (("blocks.0.attn.W_V", 2.0), ("blocks.0.attn.W_O", 0.5)):
        after[name] = after[name].clone()
        after[name][0] *= factor
    report = diagnose(before, after, cfg, after_cfg=after_cfg)
    assert report.ok, report
    unknown = {f.name: [p.name for p in f.parameters] for f in report.findings if f.rewrite == "unknown"}
    assert unknown == {"center_reading_weights": ["blocks.0.attn.W_V"],
                       "center_writing_weights": ["blocks.0.attn.W_O"]}
    assert all(f.status == "holds" for f in report.findings)


def test_folded_gemma_norms_kept_as_their_identity_are_read_as_rms_pre():
    """Gemma applies its RMSNorm gains as 1 + w: a fold that keeps the norms stores w = 0, the
    norm without a gain (a gain of 1 would double every normalised vector)."""
    cfg = cm.Config(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=20, n_ctx=6, d_mlp=24,
                    normalization_type="RMS", gated_mlp=True, act_fn="silu", norm_gain_offset=1.0)
    before = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    after, _after_cfg = cm.fold_rms_norm(before, cfg)
    for name in before:
        if name.endswith(".w") and "ln" in name:
            after[name] = torch.zeros_like(before[name])
    report = diagnose(before, after, cfg)
    assert report.ok, report
    assert any("read as RMSPre" in note for note in report.notes)
    for name in after:  # control: the gains stored as 1 are another function
        if name.endswith(".w") and "ln" in name:
            after[name] = torch.ones_like(before[name])
    assert not diagnose(before, after, cfg).ok
