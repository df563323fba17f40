"""``cfg.applied`` says what is true of the weights (issue 34): each recorded identity's
postcondition holds on the output, whatever else ran before or after it, and a transform keeps
the records of the steps before it."""

import itertools

import pytest
import torch

import circuitmath as cm
from circuitmath._processing import readers, writers
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


def _close_to_zero(tensor, scale):
    return float(tensor.abs().max()) <= 1e-12 * max(scale, 1e-300)


def _largest(sd, names):
    return max(float(sd[n].abs().max()) for n in names)


def _readers(cfg):
    return [w for _norm, pairs in readers(cfg) for w, _b in pairs]


def _no_norm_parameters(sd, cfg):
    return not any(".ln" in n or n.startswith("ln_final") for n in sd) and cfg.normalization_type in ("LNPre", "RMSPre")


def _readers_centered(sd, cfg):
    names = _readers(cfg)
    return all(_close_to_zero(sd[n].mean(-2), _largest(sd, names)) for n in names)


def _writers_centered(sd, cfg):
    names = writers(cfg)
    return all(_close_to_zero(sd[n].mean(-1), _largest(sd, names)) for n in names)


def _unembed_centered(sd, cfg):
    scale = _largest(sd, ["unembed.W_U", "unembed.b_U"])
    return all(_close_to_zero(sd[n].mean(-1), scale) for n in ("unembed.W_U", "unembed.b_U"))


def _all_zero(kind):
    def holds(sd, cfg):
        bias = "b_V" if kind == "V" else "b_K"
        return all(not bool(t.any()) for n, t in sd.items() if n.endswith(f"attn.{bias}") or n.endswith(f"attn._{bias}"))
    return holds


def _rows(sd, p, name):
    """``[W; b]`` (and the positional table of a shortformer_tables model) per head: ``[heads, rows, d_head]``."""
    parts = [sd[f"{p}.W_{name}"], sd[f"{p}.b_{name}"][:, None]]
    if f"{p}.pos_{name}" in sd:
        parts.append(sd[f"{p}.pos_{name}"].transpose(0, 1))
    return torch.cat(parts, 1)


def _diagonal(gram, scale):
    return _close_to_zero(gram - torch.diag_embed(gram.diagonal(dim1=-2, dim2=-1)), scale)


def _balanced(sd, cfg):
    """The refactor's factors, per head: ``[W_Q; b_Q]`` and ``[W_K; b_K]`` with the same diagonal
    Gram matrix, ``[W_V; b_V]`` with orthogonal columns, ``W_O`` with orthonormal rows."""
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}.attn"
        left, right = _rows(sd, p, "Q"), _rows(sd, p, "K")
        gram_q, gram_k = left.mT @ left, right.mT @ right
        scale = 1e3 * float(gram_q.abs().max())
        values = sd[f"{p}.W_V"] if not sd[f"{p}.b_V"].any() else _rows(sd, p, "V")
        gram_v = values.mT @ values
        W_O = sd[f"{p}.W_O"]
        if not (_close_to_zero(gram_q - gram_k, scale) and _diagonal(gram_q, scale)
                and _diagonal(gram_v, 1e3 * float(gram_v.abs().max()))
                and _close_to_zero(W_O @ W_O.mT - torch.eye(cfg.d_head, dtype=W_O.dtype), 1e3)):
            return False
    return True


#: What each recorded identity makes true of the weights it returns; ``None``: nothing the
#: weights show (a scale, a basis, an order, per-channel scales moved between tensors).
POSTCONDITIONS = {
    "fold_layer_norm": _no_norm_parameters,
    "fold_rms_norm": _no_norm_parameters,
    "center_reading_weights": _readers_centered,
    "center_writing_weights": _writers_centered,
    "center_unembed": _unembed_centered,
    "fold_value_biases": _all_zero("V"),
    "remove_key_biases": _all_zero("K"),
    "refactor_factored_attn_matrices": _balanced,
    "shortformer_to_tables": lambda sd, cfg: "pos_embed.W_pos" not in sd and cfg.positional_embedding_type == "shortformer_tables",
    "layer_norm_to_rms_norm": lambda sd, cfg: cfg.normalization_type in ("RMSPre", "RMS"),
    "rescale_residual_stream": None,
    "rotate_residual_stream": None,
    "layer_norm_rotation": None,
    "permute_heads": None,
    "permute_neurons": None,
    "migrate_norm_scales": None,
    "rotate_heads": None,
    "scale_neurons": None,
    "fold_embedding_scale": None,
    "fold_logit_scale": None,
}

#: Identities that move the weights off an earlier record's normal form by design, so that the
#: record describes the model before them: a rotation of the residual basis (centering is about
#: the all-ones direction of the basis it was made in; ``Q^T 1`` after the rotation), a scale
#: migrated into a folded norm's gain (the gain the fold removed comes back, as ``1 / s``), a
#: rotation inside the heads (the refactored factors' balanced basis).
MOVES_OFF = {
    "rotate_residual_stream": {"center_writing_weights", "center_reading_weights"},
    "migrate_norm_scales": {"fold_layer_norm", "fold_rms_norm", "center_reading_weights"},
    "rotate_heads": {"refactor_factored_attn_matrices"},  # a rotation of a balanced head's basis: no longer diagonal
}

#: Every registered weight identity's rewrite (``slicegpt_route`` and ``process_weights`` record
#: their steps, not themselves).
TRANSFORMS = {identity.name: identity.transform for identity in cm.identities() if identity.compare is None}

MODELS = {
    "pre-ln": LN,
    "pre-ln, eps 0": LN.replace(eps=0.0),
    "rms": LN.replace(normalization_type="RMS"),
    "shortformer": LN.replace(positional_embedding_type="shortformer"),
}


def test_every_record_has_a_postcondition_stated():
    recorded = set()
    for cfg in MODELS.values():
        sd, cfg = _model(cfg)
        for transform in TRANSFORMS.values():
            recorded |= set(_applied_where_it_can(transform, sd, cfg)[1].applied)
    assert recorded <= set(POSTCONDITIONS), "state what each identity makes true of the weights"
    assert set(POSTCONDITIONS) <= {identity.name for identity in cm.identities()}


def _violations(sd, cfg):
    moved = set().union(*(MOVES_OFF.get(name, set()) for name in cfg.applied))
    return [name for name in cfg.applied
            if POSTCONDITIONS[name] is not None and name not in moved and not POSTCONDITIONS[name](sd, cfg)]


def _applied_where_it_can(transform, sd, cfg):
    try:
        return transform(sd, cfg)
    except cm.PreconditionError:
        return sd, cfg


def test_the_postconditions_can_fail():
    """Negative controls: each postcondition is false of the model before its identity runs."""
    for model, cfg in MODELS.items():
        sd, cfg = _model(cfg)
        for name, holds in POSTCONDITIONS.items():
            if holds is None or name == "layer_norm_to_rms_norm" or name == "shortformer_to_tables" and model != "shortformer":
                continue
            assert not holds(sd, cfg), (model, name)


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
