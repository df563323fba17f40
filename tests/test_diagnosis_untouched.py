"""A tensor a rewrite leaves as it was explains nothing of how ``after`` came about.

``W_U`` centered over the vocabulary with ``b_U`` kept is exact (every position's logits shift by
one number) although no identity names it: it is accepted in float32 and bfloat16, and never
named after ``center_unembed.over_d_model``, whose mistake is in ``W_U`` and which keeps ``b_U``
too. The control is that mistake itself, ``W_U`` centered over ``d_model`` with ``b_U`` kept: refused
and named, in both dtypes. GPT-J has an unembedding bias; LLaMA has none (zeros).
"""

from functools import lru_cache

import pytest
import torch

import circuitmath as cm
from circuitmath import io
from circuitmath._conformance import family_model
from circuitmath.testing import NotEquivalentError, assert_equivalent, diagnose

CASES = [(family, dtype) for family in ("GPT-J", "LLaMA") for dtype in (torch.float32, torch.bfloat16)]


@lru_cache(maxsize=None)
def _model(family, dtype):
    model, config = family_model(family, dtype=dtype)
    return io.from_hf(model.state_dict(), config)


def _centered(W: torch.Tensor, dim: int) -> torch.Tensor:
    """``W`` minus its mean over ``dim``, computed in float32 and rounded once to its dtype."""
    wide = W.float()
    return (wide - wide.mean(dim=dim, keepdim=True)).to(W.dtype)


def _with_W_U(before, W_U):
    after = dict(before, **{"unembed.W_U": W_U})
    assert after["unembed.b_U"] is before["unembed.b_U"]
    return after


def _wrong_rewrites(found):
    return {f.rewrite for f in found.findings if f.rewrite not in (None, "exact", "unknown")}


@pytest.mark.parametrize("family, dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_W_U_centered_over_the_vocabulary_with_b_U_kept_is_accepted(family, dtype):
    before, cfg = _model(family, dtype)
    after = _with_W_U(before, _centered(before["unembed.W_U"], -1))
    assert not torch.equal(after["unembed.W_U"], before["unembed.W_U"])
    assert_equivalent(before, after, cfg)
    found = diagnose(before, after, cfg)
    assert found.ok and not _wrong_rewrites(found), str(found)


@pytest.mark.parametrize("family, dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_W_U_centered_over_d_model_with_b_U_kept_is_refused_and_named(family, dtype):
    before, cfg = _model(family, dtype)
    after = _with_W_U(before, _centered(before["unembed.W_U"], 0))
    with pytest.raises(NotEquivalentError, match="center_unembed.over_d_model"):
        assert_equivalent(before, after, cfg)
    found = diagnose(before, after, cfg)
    rows = {f.name: f for f in found.violations if f.kind == "identity"}
    assert rows["center_unembed"].rewrite == "center_unembed.over_d_model", str(found)
    assert "unembed.W_U" in [p.name for p in rows["center_unembed"].parameters]


def test_b_U_kept_from_random_weights_in_bfloat16_is_accepted():
    """The same without ``transformers``. The bias's mean is under bfloat16's recognition threshold
    (4 units of its precision, relative to its largest entry), so that ``b_U`` centered and ``b_U``
    kept look alike at that level: the case where the wrong rewrite could claim it."""
    cfg = cm.Config(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=48, n_ctx=8, d_mlp=32)
    before = cm.random_state_dict(cfg, seed=1, dtype=torch.bfloat16)
    b_U = before["unembed.b_U"].float()
    assert 0 < b_U.mean().abs() / b_U.abs().max() < 4 * torch.finfo(torch.bfloat16).eps
    after = _with_W_U(before, _centered(before["unembed.W_U"], -1))
    assert_equivalent(before, after, cfg)
    assert not _wrong_rewrites(diagnose(before, after, cfg))
    wrong = _with_W_U(before, _centered(before["unembed.W_U"], 0))
    with pytest.raises(NotEquivalentError, match="center_unembed.over_d_model"):
        assert_equivalent(before, wrong, cfg)


def test_control_under_a_logit_softcap_the_same_centering_is_refused():
    """Gemma 2 caps the logits before the softmax: a shift of them is no longer free, and the
    centering accepted above is refused there."""
    before, cfg = _model("Gemma2", torch.float32)
    assert cfg.logit_softcap is not None
    after = _with_W_U(before, _centered(before["unembed.W_U"], -1))
    with pytest.raises(NotEquivalentError):
        assert_equivalent(before, after, cfg)
