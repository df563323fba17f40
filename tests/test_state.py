"""Bad state dicts and configs get clear errors that name the problem."""

import pytest
import torch

import circuitmath as cm

CFG = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=6, d_mlp=16)


def _sd():
    return cm.random_state_dict(CFG, seed=0, dtype=torch.float64)


def _broken(kind):
    sd = _sd()
    if kind == "missing":
        del sd["blocks.0.attn.W_Q"]
    elif kind == "shape":
        sd["blocks.0.mlp.W_in"] = torch.zeros(8, 15, dtype=torch.float64)
    elif kind == "nan":
        sd["unembed.W_U"] = sd["unembed.W_U"].clone()
        sd["unembed.W_U"][0, 0] = float("nan")
    elif kind == "inf":
        sd["blocks.0.ln1.w"] = sd["blocks.0.ln1.w"].clone()
        sd["blocks.0.ln1.w"][3] = float("inf")
    elif kind == "mixed":
        sd["embed.W_E"] = sd["embed.W_E"].float()
    elif kind == "integer":
        sd["unembed.b_U"] = torch.zeros(10, dtype=torch.int64)
    elif kind == "extra":
        sd["blocks.1.attn.W_Q"] = sd["blocks.0.attn.W_Q"]
    return sd


@pytest.mark.parametrize("kind, message", [
    ("missing", r"missing keys \['blocks.0.attn.W_Q'\]"),
    ("shape", r"blocks.0.mlp.W_in has shape \(8, 15\), the config implies \(8, 16\)"),
    ("nan", "unembed.W_U has 1 NaN or Inf"),
    ("inf", "blocks.0.ln1.w has 1 NaN or Inf"),
    ("mixed", "mixed dtypes"),
    ("integer", "unembed.b_U has dtype torch.int64"),
    ("extra", r"unexpected keys \['blocks.1.attn.W_Q'\] \(does the config match"),
])
def test_bad_state_dicts_are_refused_by_every_entry_point(kind, message):
    sd = _broken(kind)
    for call in (
        lambda: cm.validate_state_dict(sd, CFG),
        lambda: cm.forward(sd, CFG, torch.tensor([[1, 2]])),
        lambda: cm.fold_layer_norm(sd, CFG),
    ):
        with pytest.raises(cm.StateDictError, match=message):
            call()


def test_a_config_that_does_not_match_the_weights_is_refused():
    with pytest.raises(cm.StateDictError, match="missing keys"):
        cm.validate_state_dict(_sd(), CFG.replace(n_layers=2))
    with pytest.raises(cm.StateDictError, match="shape"):
        cm.validate_state_dict(_sd(), CFG.replace(d_mlp=32))


@pytest.mark.parametrize("changes, message", [
    (dict(d_model=0), "d_model must be an int >= 1"),
    (dict(normalization_type="BatchNorm"), "normalization_type must be one of"),
    (dict(positional_embedding_type="sinusoidal"), "positional_embedding_type"),
    (dict(positional_embedding_type="rotary", d_head=3), "rotary_dim must be even"),
    (dict(norm_position="post", normalization_type=None), "post"),
    (dict(act_fn="swish"), "act_fn"),
])
def test_invalid_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        CFG.replace(**changes)


def test_config_round_trips_through_json():
    cfg = CFG.replace(applied=("fold_layer_norm",))
    assert cm.Config.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="unknown keys"):
        cm.Config.from_dict({**cfg.to_dict(), "fold_ln": True})
