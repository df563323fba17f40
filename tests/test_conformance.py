"""circuitmath.testing.conformance: another project's processing run on every family and judged.

A correct processing passes every family in float32 and bfloat16 (the identity, circuitmath's
own ``process_weights``); each planted mistake fails exactly the families where it changes the
function, computed from the families' features (a logit softcap, a LayerNorm bias), with the
diagnosis naming the tensor; what a processing returns outside its form is refused by name.
"""

import re

import pytest
import torch

import circuitmath as cm
from circuitmath import io
from circuitmath._conformance import family_model
from circuitmath.testing import conformance

NAMES = [f.name for f in io.FAMILIES]
DTYPES = ("float32", "bfloat16")


def _failed(table) -> set[str]:
    """The families that fail in some dtype."""
    return {v.family for v in table.failures()}


def _culprits(verdict) -> set[str]:
    return {p.name for p in verdict.diagnosis.culprits()}


def _in_float32(tensor: torch.Tensor, change) -> torch.Tensor:
    """``change`` computed in float32 and rounded once to ``tensor``'s dtype (as a careful
    processing does in half precision)."""
    return change(tensor.float()).to(tensor.dtype)


def center_unembed_everywhere(state, cfg):
    """Centers W_U and b_U over the vocabulary in every family: exact, except under a logit softcap."""
    def centered(tensor):
        return _in_float32(tensor, lambda t: t - t.mean(-1, keepdim=True))

    return dict(state, **{name: centered(state[name]) for name in ("unembed.W_U", "unembed.b_U")}), cfg


NORM_BIAS = re.compile(r"(blocks\.\d+\.ln[12](_post)?|ln_final|embed\.ln)\.b")


def drop_norm_biases(state, cfg):
    """Sets every norm bias to zero: wrong wherever a norm has a bias that is not zero."""
    return {k: torch.zeros_like(v) if NORM_BIAS.fullmatch(k) else v for k, v in state.items()}, cfg


def scale_one_row(state, cfg):
    """Scales row 3 of head 0's W_O in the last layer by 1.01: wrong everywhere."""
    name = f"blocks.{cfg.n_layers - 1}.attn.W_O"
    scaled = state[name].clone()
    scaled[0, 3] = _in_float32(scaled[0, 3], lambda row: row * 1.01)
    return dict(state, **{name: scaled}), cfg


def test_the_identity_passes_everywhere_in_both_forms():
    for process in (lambda state, cfg: (state, cfg), lambda model: model):
        table = conformance(process)
        assert table.ok, str(table)
        assert [(v.family, v.dtype) for v in table] == [(n, d) for n in NAMES for d in DTYPES]


def test_process_weights_passes_everywhere():
    table = conformance(cm.process_weights)
    assert table.ok, str(table)
    assert all(v.max_abs_error <= v.tolerance for v in table)


def test_centering_the_unembedding_fails_exactly_under_a_softcap():
    capped = {f.name for f in io.FAMILIES if f.cfg.logit_softcap is not None}
    assert capped  # a family with a logit softcap, or the test says nothing
    table = conformance(center_unembed_everywhere)
    assert _failed(table) == capped, str(table)
    for verdict in table.failures():
        assert "unembed.W_U" in _culprits(verdict)
        assert [f.rewrite for f in verdict.diagnosis.violations if f.kind == "identity"] == ["center_unembed.regardless"]
    # in float32 the log-probs show it; in bfloat16 the rounding tolerance of Gemma 2's capped
    # logits can be above the change, and the tensors show it: they are the refused rewrite's
    gemma = table.verdict("Gemma2", torch.float32)
    assert gemma.max_abs_error > 10 * gemma.tolerance


def test_dropping_a_norm_bias_fails_exactly_where_a_norm_has_one():
    with_bias = set()
    for fam in io.FAMILIES:
        model, config = family_model(fam)
        state, _ = io.from_hf(model.state_dict(), config)
        if any(bool(v.ne(0).any()) for k, v in state.items() if NORM_BIAS.fullmatch(k)):
            with_bias.add(fam.name)
    assert with_bias and with_bias != set(NAMES)  # both kinds, or the test says nothing
    table = conformance(drop_norm_biases)
    assert _failed(table) == with_bias, str(table)
    for verdict in table.failures():
        named = _culprits(verdict)
        assert named and all(NORM_BIAS.fullmatch(name) for name in named), named


def test_scaling_one_row_fails_everywhere_naming_it():
    table = conformance(scale_one_row, dtypes=(torch.float32, torch.bfloat16))
    assert len(table.failures()) == len(NAMES) * len(DTYPES)
    for verdict in table:
        assert _culprits(verdict) == {f"blocks.{io.family(verdict.family).cfg.n_layers - 1}.attn.W_O"}


def test_a_model_processing_is_judged_in_the_models_own_names():
    """The model form: an lm_head row scaled in a transformers model is named as the model names it."""
    def scale_lm_head_row(model):
        with torch.no_grad():
            model.lm_head.weight[5] *= 1.01
        return model

    table = conformance(scale_lm_head_row, families=["LLaMA", "GPT-J"], dtypes=(torch.float32,))
    assert not table.ok
    assert {name for v in table for name in _culprits(v)} == {"lm_head.weight"}


def test_the_table_reads_as_a_table_with_each_failures_diagnosis():
    table = conformance(scale_one_row, families=["LLaMA", "Gemma2"], dtypes=(torch.float32,))
    text = str(table)
    assert text.startswith("| family | float32 |")
    assert "| LLaMA | FAIL (blocks.1.attn.W_O) |" in text and "0 of 2 passed" in text
    assert text.count("blocks.1.attn.W_O (layer 1") >= 2  # each failure's diagnosis below the table
    assert table.verdict("Gemma2", torch.float32).diagnosis is not None
    passing = conformance(lambda state, cfg: (state, cfg), families="LLaMA", dtypes=torch.float32)
    assert passing.markdown() == "| family | float32 |\n|---|---|\n| LLaMA | pass |"


def test_a_processing_that_raises_fails_its_cell_with_the_error():
    def refuse(state, cfg):
        if cfg.logit_softcap:
            raise cm.PreconditionError("center_unembed", "no logit softcap", "refused on purpose")
        return state, cfg

    table = conformance(refuse, families=["LLaMA", "Gemma2"], dtypes=(torch.float32,))
    assert _failed(table) == {"Gemma2"}
    verdict = table.verdict("Gemma2", "float32")
    assert verdict.diagnosis is None and verdict.stage == "process" and "PreconditionError" in verdict.error
    assert "raised PreconditionError" in str(table)


def test_a_result_that_is_not_the_familys_model_fails_its_cell_naming_what_is_missing():
    def drop_w_u(state, cfg):
        return {k: v for k, v in state.items() if k != "unembed.W_U"}, cfg

    table = conformance(drop_w_u, families=["LLaMA"], dtypes=(torch.float32,))
    verdict = table.verdict("LLaMA", torch.float32)
    assert not verdict.passed and verdict.stage == "read" and "unembed.W_U" in verdict.error
    assert "FAIL: not read (StateDictError)" in table.markdown() and "its result is not read" in str(table)


@pytest.mark.parametrize("process,form,returned", [
    (lambda state, cfg: [state, cfg], None, "returned an object of type list for LLaMA in float32"),
    (lambda state, cfg: (state, "config"), None, r"returned a tuple of \(dict, str\)"),
    (lambda model: model.state_dict(), None, "returned an object of type OrderedDict for LLaMA in float32"),
    (lambda state, cfg: None, "state_dict", "returned an object of type NoneType"),
])
def test_what_a_processing_returns_outside_its_form_is_named(process, form, returned):
    with pytest.raises(cm.CircuitMathError, match=returned):
        conformance(process, families=["LLaMA"], dtypes=(torch.float32,), form=form)


@pytest.mark.parametrize("call,message", [
    (lambda: conformance(lambda *models: None), "cannot tell from its signature"),
    (lambda: conformance(cm.process_weights, form="folder"), "form must be one of"),
    (lambda: conformance(cm.process_weights, families=["GPT-5"]), "no family 'GPT-5'; the families are LLaMA"),
    (lambda: conformance(cm.process_weights, dtypes=("float32",)), "expected floating torch dtypes"),
    (lambda: conformance("process_weights"), "expected a function, got a str"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(cm.CircuitMathError, match=message):
        call()
