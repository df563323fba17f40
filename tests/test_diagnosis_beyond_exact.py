"""Wrong rewrites that touch tensors their exact rewrite leaves alone are named.

The search for wrong rewrites looks only at stages that can explain the tensors the exact replay
left unexplained. A tensor no exact rewrite touched (``W_pos`` scaled with ``W_E``, a tied ``W_U``
scaled with it, ``b_Q`` dropped with ``b_K``) is explained by a stage whose wrong rewrites touch it,
learnt on the model cut to one layer: each planted mistake below is named, with that tensor, whether
the processed config records the replay or not, alone and under the rest of the processing. The
controls: the exact rewrites pass with nothing named, and a change of the same tensor that no
wrong rewrite makes is refused and named by its tensor only.
"""

import pytest
import torch

import circuitmath as cm
from circuitmath.testing import diagnose

BASE = cm.Config(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=40, n_ctx=8, d_mlp=32)
SCALED = BASE.replace(embedding_scale=4.0)
SHORTFORMER = BASE.replace(positional_embedding_type="shortformer")

#: (identity, wrong rewrite, model, the tensor only the wrong rewrite touches)
CASES = [
    ("fold_embedding_scale", "position_scaled_too", SCALED, "pos_embed.W_pos"),
    ("fold_embedding_scale", "unembedding_scaled_too", SCALED, "unembed.W_U"),
    ("center_writing_weights", "shortformer_W_pos", SHORTFORMER, "pos_embed.W_pos"),
    ("remove_key_biases", "drop_query_biases", BASE, "blocks.1.attn.b_Q"),
]
DTYPES = (torch.float64, torch.float32, torch.bfloat16)


def _planted(identity_name, wrong_name, cfg, dtype, then_process=False):
    """``(before, after, after_cfg, prepared, exact)``: the wrong rewrite of the prepared model
    (then the rest of :func:`~circuitmath.process_weights`), half precision computed in float32 and
    rounded once (as the replay computes it), and the prepared model and its exact rewrite."""
    before = cm.random_state_dict(cfg, seed=2, dtype=dtype)
    identity = cm.get_identity(identity_name)
    wide = {name: t.float() for name, t in before.items()} if dtype == torch.bfloat16 else before
    prepared, prepared_cfg = identity.prepared(wide, cfg)
    exact = identity.transform(prepared, prepared_cfg)[0]
    after, after_cfg = identity.wrong_rewrites[wrong_name](prepared, prepared_cfg)
    if then_process:
        after, after_cfg = cm.process_weights(after, after_cfg)
    return before, {name: t.to(dtype) for name, t in after.items()}, after_cfg, prepared, exact


def _named(found) -> dict[str, list[str]]:
    """Each wrong rewrite a violated row names, with the row's tensors."""
    return {f.rewrite: [p.name for p in f.parameters] for f in found.violations
            if f.kind == "identity" and f.rewrite not in (None, "exact", "unknown")}


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "inferred"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("identity_name, wrong_name, cfg, tensor", CASES, ids=[c[1] for c in CASES])
def test_the_wrong_rewrite_is_named_with_the_tensor_its_exact_rewrite_leaves_alone(
        identity_name, wrong_name, cfg, tensor, dtype, recorded):
    before, after, after_cfg, prepared, exact = _planted(identity_name, wrong_name, cfg, dtype)
    assert exact[tensor] is prepared[tensor] and not torch.equal(after[tensor], prepared[tensor].to(dtype))
    found = diagnose(before, after, cfg, after_cfg=after_cfg if recorded else after_cfg.replace(applied=cfg.applied))
    named = _named(found)
    rewrite = f"{identity_name}.{wrong_name}"
    assert not found.ok and rewrite in named and tensor in named[rewrite], str(found)


@pytest.mark.parametrize("wrong_name, tensor", [("position_scaled_too", "pos_embed.W_pos"),
                                                ("unembedding_scaled_too", "unembed.W_U")])
def test_the_wrong_rewrite_is_named_under_the_rest_of_the_processing(wrong_name, tensor):
    before, after, after_cfg, _prepared, _exact = _planted("fold_embedding_scale", wrong_name, SCALED,
                                                           torch.float32, then_process=True)
    for given in (after_cfg, after_cfg.replace(applied=())):
        named = _named(diagnose(before, after, SCALED, after_cfg=given))
        assert tensor in named.get(f"fold_embedding_scale.{wrong_name}", []), named


@pytest.mark.parametrize("identity_name, cfg", [("fold_embedding_scale", SCALED),
                                                ("center_writing_weights", SHORTFORMER),
                                                ("remove_key_biases", BASE)])
def test_control_the_exact_rewrites_pass_with_nothing_named(identity_name, cfg):
    before = cm.random_state_dict(cfg, seed=2, dtype=torch.float32)
    identity = cm.get_identity(identity_name)
    after, after_cfg = identity.transform(*identity.prepared(before, cfg))
    for given in (after_cfg, after_cfg.replace(applied=())):
        found = diagnose(before, after, cfg, after_cfg=given)
        assert found.ok and not _named(found), str(found)


@pytest.mark.parametrize("identity_name, cfg", [("fold_embedding_scale", SCALED),
                                                ("center_writing_weights", SHORTFORMER)])
def test_control_a_change_no_wrong_rewrite_makes_is_named_by_its_tensor_only(identity_name, cfg):
    """One row of ``W_pos`` changed by 1 % after the exact rewrite: refused, ``W_pos`` the culprit,
    and no wrong rewrite named for it (none reproduces it)."""
    before = cm.random_state_dict(cfg, seed=2, dtype=torch.float32)
    identity = cm.get_identity(identity_name)
    after, after_cfg = identity.transform(*identity.prepared(before, cfg))
    W_pos = after["pos_embed.W_pos"].clone()
    W_pos[3] *= 1.01
    after = dict(after, **{"pos_embed.W_pos": W_pos})
    found = diagnose(before, after, cfg, after_cfg=after_cfg.replace(applied=()))
    assert not found.ok and [p.name for p in found.culprits()] == ["pos_embed.W_pos"], str(found)
    assert not _named(found), str(found)
