"""``cfg.applied`` says what is true of the weights (issue 34): each recorded identity's
postcondition holds on the output, whatever else ran before or after it, and a transform keeps
the records of the steps before it."""

import itertools

import pytest
import torch

import circuitmath as cm
from circuitmath._registry import COMPOSES
from circuitmath._processing.steps import STEPS

LN = cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)


def _model(cfg=LN, seed=0):
    return cm.random_state_dict(cfg, seed=seed, dtype=torch.float64), cfg


# -- a transform appends its record to those of the steps before it ---------------------------


def test_rescale_residual_stream_keeps_the_records_before_it():
    sd, cfg = _model(LN.replace(eps=0.0))
    centered, centered_cfg = cm.center_unembed(sd, cfg)
    scaled, scaled_cfg = cm.rescale_residual_stream(centered, centered_cfg, scale=2.0)
    assert scaled_cfg.applied == ("center_unembed", "rescale_residual_stream")
    with pytest.raises(cm.AlreadyAppliedError, match="center_unembed"):  # the record still refuses a second one
        cm.center_unembed(scaled, scaled_cfg)


def test_shortformer_to_tables_keeps_the_records_before_it():
    sd, cfg = _model(LN.replace(positional_embedding_type="shortformer"))
    centered, centered_cfg = cm.center_unembed(sd, cfg)
    tables, tables_cfg = cm.shortformer_to_tables(centered, centered_cfg)
    assert tables_cfg.applied == ("center_unembed", "shortformer_to_tables")
    with pytest.raises(cm.AlreadyAppliedError, match="center_unembed"):
        cm.center_unembed(tables, tables_cfg)


# -- every recorded identity's postcondition holds on the output ------------------------------

#: Every registered weight identity's rewrite (``slicegpt_route`` and ``process_weights`` record
#: their steps, not themselves).
TRANSFORMS = {identity.name: identity.transform for identity in cm.identities() if identity.compare is None}

#: What each identity makes true of the weights it returns (``Identity.postcondition``), where
#: the weights show it.
POSTCONDITIONS = {identity.name: identity.postcondition for identity in cm.identities()
                  if callable(identity.postcondition)}

#: The records each identity moves the weights off by design (``Identity.moves_off``).
MOVES_OFF = {identity.name: {t.identity for t in identity.moves_off} for identity in cm.identities()}

MODELS = {
    "pre-ln": LN,
    "pre-ln, eps 0": LN.replace(eps=0.0),
    "rms": LN.replace(normalization_type="RMS"),
    "shortformer": LN.replace(positional_embedding_type="shortformer"),
}


def test_every_weight_identity_states_its_postcondition():
    """Each identity whose rewrite records itself states what it makes true of the weights (or
    that they show nothing); those that compose others' rewrites record those, not themselves."""
    missing = [identity.name for identity in cm.identities() if identity.compare is None
               and identity.half_precision != COMPOSES and identity.postcondition is None]
    assert not missing, f"state what each identity makes true of the weights: {missing}"


def test_every_record_has_a_postcondition_stated():
    recorded = set()
    for cfg in MODELS.values():
        sd, cfg = _model(cfg)
        for transform in TRANSFORMS.values():
            recorded |= set(_applied_where_it_can(transform, sd, cfg)[1].applied)
    stated = {identity.name for identity in cm.identities() if identity.postcondition is not None}
    assert recorded <= stated, f"state what each identity makes true of the weights: {recorded - stated}"


def _violations(sd, cfg):
    moved = set().union(*(MOVES_OFF.get(name, set()) for name in cfg.applied))
    return [f"{name} ({message})" for name in cfg.applied if name in POSTCONDITIONS and name not in moved
            and (message := POSTCONDITIONS[name](sd, cfg)) is not None]


def _applied_where_it_can(transform, sd, cfg):
    try:
        return transform(sd, cfg)
    except cm.PreconditionError:
        return sd, cfg


def test_the_postconditions_can_fail():
    """Negative controls: each postcondition is false of the model before its identity runs, and
    says what is not true."""
    for model, cfg in MODELS.items():
        sd, cfg = _model(cfg)
        for name, postcondition in POSTCONDITIONS.items():
            if name == "layer_norm_to_rms_norm" and model == "rms" or name == "shortformer_to_tables" and model != "shortformer":
                continue  # an RMSNorm model is one already; only a shortformer model has W_pos to move
            assert isinstance(postcondition(sd, cfg), str), (model, name)


@pytest.mark.parametrize("name", sorted(POSTCONDITIONS))
def test_each_postcondition_fails_on_a_slightly_wrong_output(name):
    """Negative controls on the identity's own output: its postcondition holds of it, and fails
    once an entry it reads is moved (:func:`_one_entry_moved`), or, where the config says it, once
    the config says otherwise."""
    identity = cm.get_identity(name)
    for cfg in MODELS.values():
        sd, cfg = _model(cfg)
        try:
            out, out_cfg = identity.transform(*identity.prepared(sd, cfg))
        except cm.PreconditionError:
            continue
        assert identity.postcondition(out, out_cfg) is None, name
        moved = _one_entry_moved(out, out_cfg)
        if name in ("layer_norm_to_rms_norm", "shortformer_to_tables"):  # the config says it, not the weights
            moved_cfg = out_cfg.replace(normalization_type="LNPre") if name == "layer_norm_to_rms_norm" \
                else out_cfg.replace(positional_embedding_type="shortformer")
            assert isinstance(identity.postcondition(out, moved_cfg), str), name
            return
        assert isinstance(identity.postcondition(moved, out_cfg), str), name
        return
    pytest.fail(f"{name} applies to none of the models")


def _one_entry_moved(sd, cfg):
    """``sd`` with one entry of the first tensor that each postcondition reads changed by 0.1 (a
    reader's, a writer's, a bias's, the unembedding's), and ``blocks.0.ln1.w`` back in."""
    out = dict(sd)
    for name in ("blocks.0.attn.W_Q", "blocks.0.attn.b_V", "blocks.0.attn.b_K", "blocks.0.attn.W_O", "unembed.W_U"):
        if name in out:
            out[name] = out[name].clone()
            out[name].view(-1)[0] += 0.1
    out["blocks.0.ln1.w"] = torch.ones(cfg.d_model, dtype=torch.float64)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_every_pair_of_transforms_records_only_what_holds(model):
    sd, cfg = _model(MODELS[model])
    problems = []
    for first, second in itertools.product(TRANSFORMS, repeat=2):
        out, out_cfg = _applied_where_it_can(TRANSFORMS[second], *_applied_where_it_can(TRANSFORMS[first], sd, cfg))
        if bad := _violations(out, out_cfg):
            problems.append(f"{first} then {second}: {out_cfg.applied} but not {bad}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("model", MODELS)
def test_every_transform_then_every_pipeline_records_only_what_holds(model):
    """Each transform (or none), then ``process_weights`` with each combination of its steps
    (each asked for where it applies, or left out), then each transform again."""
    sd, cfg = _model(MODELS[model])
    problems = []
    for before in (None, *TRANSFORMS):
        start, start_cfg = (sd, cfg) if before is None else _applied_where_it_can(TRANSFORMS[before], sd, cfg)
        for chosen in itertools.product((None, False), repeat=len(STEPS)):
            try:
                out, out_cfg = cm.process_weights(start, start_cfg, **dict(zip(STEPS, chosen)))
            except cm.PreconditionError:
                continue
            if bad := _violations(out, out_cfg):
                problems.append(f"{before} then process_weights{chosen}: {out_cfg.applied} but not {bad}")
    assert not problems, "\n".join(problems[:30]) + f"\n({len(problems)} in all)"
