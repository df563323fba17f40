"""Folding the embedding scale (Gemma) and the logit scale (Cohere): exact, refused where there is
nothing to fold or it was folded already, bit for bit in half precision where the forward pass
rounds its multiplier, and a planted mistake named by the checker."""

import pytest
import torch

import circuitmath as cm
from circuitmath import testing
from circuitmath._identities.scales import EMBEDDING_UNROUNDED
from circuitmath._reference import embed

BASE = dict(n_layers=2, d_model=6, n_heads=2, d_head=3, d_vocab=9, n_ctx=5, d_mlp=12)
SCALED = cm.Config(**BASE, embedding_scale=6**0.5, logit_scale=0.0625)
TOKENS = torch.tensor([[1, 4, 2, 7, 0], [3, 3, 8, 5, 6]])


def _model(cfg=SCALED, dtype=torch.float64, seed=0):
    return cm.random_state_dict(cfg, seed=seed, dtype=dtype)


@pytest.mark.parametrize("name", ["fold_embedding_scale", "fold_logit_scale"])
def test_the_fold_drops_the_multiplier_records_itself_and_keeps_the_log_probs(name):
    sd = _model()
    copies = {k: v.clone() for k, v in sd.items()}
    out, out_cfg = getattr(cm, name)(sd, SCALED)
    assert out_cfg.applied == (name,)
    field = {"fold_embedding_scale": "embedding_scale", "fold_logit_scale": "logit_scale"}[name]
    assert getattr(out_cfg, field) is None and out_cfg.replace(**{field: getattr(SCALED, field)}, applied=()) == SCALED
    assert all(torch.equal(sd[k], copies[k]) for k in sd)  # pure
    gap = float((cm.log_probs(sd, SCALED, TOKENS) - cm.log_probs(out, out_cfg, TOKENS)).abs().max())
    assert gap < 1e-12, gap
    # negative control: the weights without the multiplier (the fold forgotten) are another model
    forgot = float((cm.log_probs(sd, SCALED, TOKENS) - cm.log_probs(sd, out_cfg, TOKENS)).abs().max())
    assert forgot > 1e-2, forgot


@pytest.mark.parametrize("name", ["fold_embedding_scale", "fold_logit_scale"])
def test_a_second_application_and_a_model_without_the_scale_are_refused_by_name(name):
    sd = _model()
    out, out_cfg = getattr(cm, name)(sd, SCALED)
    with pytest.raises(cm.AlreadyAppliedError, match=name):
        getattr(cm, name)(out, out_cfg)
    plain = cm.Config(**BASE)
    with pytest.raises(cm.PreconditionError, match=f"{name}: precondition 'the (token embeddings|logits) are scaled'"):
        getattr(cm, name)(_model(plain), plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_embedding_fold_is_exact_bit_for_bit_with_the_multiplier_rounded_as_the_forward_pass_rounds_it(dtype):
    """sqrt(6) = 2.449... is 2.453125 in bfloat16: the forward pass multiplies by that, and so
    does the fold, so every embedded token and every log-prob is the same bits."""
    sd = _model(dtype=dtype)
    out, out_cfg = cm.fold_embedding_scale(sd, SCALED)
    assert out["embed.W_E"].dtype == dtype
    assert torch.equal(embed(sd, SCALED, TOKENS)[0], embed(out, out_cfg, TOKENS)[0])
    assert torch.equal(cm.log_probs(sd, SCALED, TOKENS), cm.log_probs(out, out_cfg, TOKENS))
    # negative control: the unrounded sqrt(6), rounded once, is another model in bfloat16 and
    # float16 (and off by an ulp at most in float32)
    wrong, wrong_cfg = EMBEDDING_UNROUNDED(sd, SCALED)
    differs = int((wrong["embed.W_E"] != out["embed.W_E"]).sum())
    if dtype == torch.float32:
        ulps = (wrong["embed.W_E"].double() - out["embed.W_E"].double()).abs() / out["embed.W_E"].abs().double()
        assert float(ulps.max()) <= 2**-23
    else:
        assert differs > sd["embed.W_E"].numel() // 10, differs
        assert not torch.equal(embed(sd, SCALED, TOKENS)[0], embed(wrong, wrong_cfg, TOKENS)[0])


def test_a_tied_unembedding_comes_back_untied_and_unscaled():
    sd = _model()
    sd["unembed.W_U"] = sd["embed.W_E"].T  # tied: one matrix, as Gemma stores it
    out, out_cfg = cm.fold_embedding_scale(sd, SCALED)
    assert out["unembed.W_U"] is sd["unembed.W_U"]
    assert not torch.equal(out["unembed.W_U"], out["embed.W_E"].T)
    assert cm.get_identity("fold_embedding_scale").check(sd, SCALED).passed
    # negative control: keeping the two tied scales the logits as well
    assert not cm.get_identity("fold_embedding_scale").check_wrong_rewrite("unembedding_scaled_too", sd, SCALED).passed


def test_the_logit_fold_holds_under_a_softcap_and_in_bfloat16_within_rounding():
    cfg = SCALED.replace(logit_softcap=3.0)
    sd = _model(cfg)
    sd["unembed.W_U"] = sd["unembed.W_U"] * 40  # logits that reach the cap
    capped = cm.forward(sd, cfg, TOKENS)
    assert float(capped.abs().max()) > 0.9 * 3.0
    out, out_cfg = cm.fold_logit_scale(sd, cfg)
    assert float((cm.log_probs(sd, cfg, TOKENS) - cm.log_probs(out, out_cfg, TOKENS)).abs().max()) < 1e-12
    half = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    out, out_cfg = cm.fold_logit_scale(half, cfg)
    # the products rounded once: within half an ulp of bfloat16 of the float64 products
    exact = half["unembed.W_U"].double() * cfg.logit_scale
    assert torch.equal(out["unembed.W_U"], exact.to(torch.bfloat16))
    report = testing.check_fold_logit_scale(half, out, cfg, after_cfg=out_cfg)
    assert report.ok, report


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["fold_embedding_scale", "fold_logit_scale"])
def test_the_checker_accepts_the_fold_and_names_each_planted_mistake(name, dtype):
    """In half precision with a multiplier bfloat16 holds exactly (4): the checker replays a
    half-precision model in float32, where sqrt(6) is rounded otherwise (see the next test)."""
    identity = cm.get_identity(name)
    cfg = SCALED.replace(embedding_scale=4.0) if dtype == torch.bfloat16 else SCALED
    sd = _model(cfg, dtype=dtype)
    out, out_cfg = identity.transform(sd, cfg)
    assert testing.CHECKERS[name](sd, out, cfg, after_cfg=out_cfg).ok
    for wrong in identity.wrong_rewrites:
        after, after_cfg = identity.wrong_rewrites[wrong](sd, cfg)
        report = testing.CHECKERS[name](sd, after, cfg, after_cfg=after_cfg)
        assert not report.ok
        beyond = {k for k in after if after[k] is not sd[k] and out[k] is sd[k]}
        if beyond:
            # a tensor the fold leaves alone (W_pos, W_U): the diagnosis searches no wrong rewrite
            # of the fold there, and names the tensor
            assert beyond <= {c.name for c in report.culprits()}, (wrong, report)
            continue
        assert any(f.rewrite == f"{name}.{wrong}" for f in report.findings), (wrong, report)


def test_in_bfloat16_a_multiplier_it_rounds_is_folded_as_rounded_and_a_second_fold_is_refused_by_tensor():
    """sqrt(6) is 2.453125 in bfloat16: the fold is recognised, a second multiplication is
    refused and W_E named, but not as applied_twice: the checker replays a bfloat16 model in
    float32, whose forward pass multiplies by sqrt(6) rounded to float32 (a model 0.15 % apart),
    and s^2 = 6.0178 in bfloat16 against 6.0000 there is more than the rounding it forgives."""
    sd = _model(dtype=torch.bfloat16)
    out, out_cfg = cm.fold_embedding_scale(sd, SCALED)
    assert testing.check_fold_embedding_scale(sd, out, SCALED, after_cfg=out_cfg).ok
    after, after_cfg = cm.get_identity("fold_embedding_scale").wrong_rewrites["applied_twice"](sd, SCALED)
    report = testing.check_fold_embedding_scale(sd, after, SCALED, after_cfg=after_cfg)
    assert not report.ok and "embed.W_E" in {c.name for c in report.culprits()}


@pytest.mark.parametrize("scale", [dict(embedding_scale=6**0.5), dict(logit_scale=0.0625)])
def test_the_path_identities_refuse_a_scaled_model_and_hold_once_the_scale_is_folded(scale):
    """The path expansion and the notation identities are statements about W_E and W_U as stored:
    a model whose embeddings or logits are scaled is refused naming the scale; folded first, each
    holds (on every number of layers it takes)."""
    from circuitmath._identities import identities
    from circuitmath.circuits._paths import PATH_MODEL

    path_identities = [i for i in identities() if PATH_MODEL[-1] in i.preconditions]
    held_somewhere = set()
    for layers in (0, 1, 2):
        cfg = cm.Config(**dict(BASE, d_mlp=None, n_layers=layers), normalization_type="LNPre", **scale)
        sd = cm.random_state_dict(cfg, seed=0)
        folded, folded_cfg = (cm.fold_embedding_scale if "embedding_scale" in scale else cm.fold_logit_scale)(sd, cfg)
        for identity in path_identities:
            try:
                held = identity.check(folded, folded_cfg, TOKENS)
            except cm.PreconditionError:  # another of its preconditions (its number of layers)
                continue
            assert held.max_abs_error <= held.tolerance, (identity.name, layers, held)
            held_somewhere.add(identity.name)
            with pytest.raises(cm.PreconditionError, match=rf"no embedding or logit scale.*{next(iter(scale))}"):
                identity.check(sd, cfg, TOKENS)
    assert held_somewhere == {i.name for i in path_identities} and len(held_somewhere) >= 8, held_somewhere
