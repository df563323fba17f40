"""A failing property test fails fast: while hypothesis shrinks, the comparison alone decides,
and the diagnosis runs once, on the final example, whose error carries it."""

import pytest
import torch
from hypothesis import given, settings

import circuitmath as cm
from circuitmath import _diagnosis
from circuitmath.strategies import models
from circuitmath.testing import NotEquivalentError, assert_equivalent


def _wrong_fold(state_dict, cfg):
    """Fold the LayerNorm but drop the bias b @ W (a wrong rewrite)."""
    folded, folded_cfg = cm.fold_layer_norm(state_dict, cfg)
    return dict(folded, **{"unembed.b_U": state_dict["unembed.b_U"]}), folded_cfg


def test_the_diagnosis_runs_once_on_the_final_example(monkeypatch):
    calls = []
    real = _diagnosis.replay_and_explain

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_diagnosis, "replay_and_explain", counted)
    runs = []

    @settings(max_examples=20, deadline=None, database=None)
    @given(models(normalization_types=("LN",), positional_embedding_types=("standard",), gated_mlp=(False,),
                  grouped_query=(False,), min_layers=1, max_layers=1))
    def property_test(model):
        cfg, sd = model
        runs.append(1)
        processed, processed_cfg = _wrong_fold(sd, cfg)
        assert_equivalent(sd, processed, cfg, after_cfg=processed_cfg)

    with pytest.raises(NotEquivalentError) as error:
        property_test()
    assert "diagnosis:" in str(error.value) and "fold_layer_norm" in str(error.value)
    assert len(calls) == 1 < len(runs), (len(calls), len(runs))


def test_outside_hypothesis_every_failure_is_diagnosed():
    """Negative control: the skip applies to hypothesis's intermediate runs only."""
    cfg = cm.Config(n_layers=1, d_model=6, n_heads=2, d_head=3, d_vocab=7, n_ctx=4)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    processed, processed_cfg = _wrong_fold(sd, cfg)
    with pytest.raises(NotEquivalentError, match="diagnosis:"):
        assert_equivalent(sd, processed, cfg, after_cfg=processed_cfg)


def test_a_failed_report_reads_well_under_pytest():
    """``assert report.ok, report`` shows the verdict within pytest's 240-character repr, and
    the assert_* form raises with the whole table."""
    from circuitmath.testing import assert_fold_layer_norm, check_fold_layer_norm

    cfg = cm.Config(n_layers=1, d_model=6, n_heads=2, d_head=3, d_vocab=7, n_ctx=4)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float64)
    processed, processed_cfg = _wrong_fold(sd, cfg)
    report = check_fold_layer_norm(sd, processed, cfg, after_cfg=processed_cfg)
    assert not report.ok
    text = repr(report)
    assert len(text) <= 240 and text.startswith("<Diagnosis FAILED") and "fold_layer_norm" in text, text
    assert "unembed.b_U" in text
    with pytest.raises(NotEquivalentError) as error:
        assert_fold_layer_norm(sd, processed, cfg, after_cfg=processed_cfg)
    assert str(report) in str(error.value) and "identity" in str(error.value)
    good, good_cfg = cm.fold_layer_norm(sd, cfg)
    assert repr(assert_fold_layer_norm(sd, good, cfg, after_cfg=good_cfg)).startswith("<Diagnosis ok")
