"""What validate_state_dict and expected_shapes promise, pinned case by case (for mutation testing
of circuitmath/_state.py: every raise, every shape rule, every count in a message)."""

import pytest
import torch

import circuitmath as cm
from circuitmath._errors import StateDictError
from circuitmath._state import attention_names, expected_shapes, validate_state_dict, validated

CFG = cm.Config(n_layers=2, d_model=8, n_heads=4, d_head=2, d_vocab=10, n_ctx=6, d_mlp=16)


def test_config_and_mapping_are_checked_first():
    sd = cm.random_state_dict(CFG, seed=0)
    with pytest.raises(StateDictError, match="expected a circuitmath Config, got dict"):
        validate_state_dict(sd, {})
    with pytest.raises(StateDictError, match="expected a mapping of names to tensors, got list"):
        validate_state_dict([], CFG)


def test_a_value_that_is_not_a_tensor_is_named():
    sd = dict(cm.random_state_dict(CFG, seed=0), **{"unembed.b_U": [0.0] * 10})
    with pytest.raises(StateDictError, match=r"unembed.b_U is a list, not a torch.Tensor"):
        validate_state_dict(sd, CFG)


def test_every_non_finite_entry_is_counted_unless_checked_elsewhere():
    sd = cm.random_state_dict(CFG, seed=0)
    sd["embed.W_E"] = sd["embed.W_E"].clone()
    sd["embed.W_E"][0, :3] = float("nan")
    with pytest.raises(StateDictError, match="embed.W_E has 3 NaN or Inf entries"):
        validate_state_dict(sd, CFG)
    unchecked = validated(sd, CFG, entries=False)
    assert unchecked.dtype == torch.float32 and not unchecked.entries
    with pytest.raises(StateDictError, match="embed.W_E has 3 NaN or Inf entries"):
        validated(unchecked, CFG)  # entries asked for: checked now


def test_the_common_dtype_is_returned():
    assert validate_state_dict(cm.random_state_dict(CFG, seed=0, dtype=torch.float64), CFG) == torch.float64


def test_every_problem_is_listed_at_once():
    sd = cm.random_state_dict(CFG, seed=0)
    del sd["embed.W_E"]
    sd["extra"] = torch.zeros(1)
    sd["unembed.W_U"] = torch.zeros(8, 9)
    with pytest.raises(StateDictError) as error:
        validate_state_dict(sd, CFG)
    message = str(error.value)
    assert "missing keys ['embed.W_E']" in message and "unexpected keys ['extra']" in message
    assert "unembed.W_U has shape (8, 9), the config implies (8, 10)" in message


@pytest.mark.parametrize(
    "changes, present, absent",
    [
        ({}, {"blocks.1.ln2.w": (8,), "blocks.1.ln2.b": (8,), "ln_final.b": (8,), "pos_embed.W_pos": (6, 8)},
         ["blocks.0.mlp.W_gate", "embed.ln.w"]),
        ({"normalization_type": "RMS", "gated_mlp": True, "act_fn": "relu"},
         {"blocks.0.ln1.w": (8,), "blocks.0.mlp.W_gate": (8, 16)}, ["blocks.0.ln1.b", "ln_final.b"]),
        ({"normalization_type": None}, {"blocks.0.mlp.W_in": (8, 16)}, ["blocks.0.ln1.w", "ln_final.w"]),
        ({"d_mlp": None}, {"blocks.0.attn.W_O": (4, 2, 8)}, ["blocks.0.mlp.W_in", "blocks.0.ln2.w"]),
        ({"n_key_value_heads": 2}, {"blocks.0.attn._W_K": (2, 8, 2), "blocks.0.attn._b_V": (2, 2),
                                    "blocks.0.attn.W_Q": (4, 8, 2)}, ["blocks.0.attn.W_K"]),
        ({"positional_embedding_type": "rotary"}, {"embed.W_E": (10, 8)}, ["pos_embed.W_pos"]),
        ({"positional_embedding_type": "shortformer_tables"},
         {"blocks.0.attn.pos_Q": (6, 4, 2), "blocks.0.attn.pos_K": (6, 4, 2)}, ["blocks.0.attn.pos_V", "pos_embed.W_pos"]),
    ],
)
def test_expected_shapes_follow_the_config(changes, present, absent):
    cfg = CFG.replace(**changes)  # every case is a valid config: a refusal is a failure, not a skip
    shapes = expected_shapes(cfg)
    for name, shape in present.items():
        assert shapes[name] == shape, name
    for name in absent:
        assert name not in shapes, name
    assert validate_state_dict(cm.random_state_dict(cfg, seed=0), cfg) == torch.float32


def test_attention_names_for_grouped_query_attention():
    gqa = CFG.replace(n_key_value_heads=2)
    assert attention_names(gqa, "Q") == ("W_Q", "b_Q", 4)
    assert attention_names(gqa, "K") == ("_W_K", "_b_K", 2)
    assert attention_names(CFG, "V") == ("W_V", "b_V", 4)


def test_a_validated_state_dict_is_not_read_again_until_it_is_changed():
    """A Validated state dict passes validate_state_dict for its config without being read (a
    NaN planted in place, which internal code never does, shows that), not for another config;
    setting a key takes its mark away, and a copy or a pickle of it is a plain dict."""
    import pickle

    from circuitmath._state import Validated, validated

    state_dict = validated(cm.random_state_dict(CFG, seed=0), CFG)
    assert isinstance(state_dict, Validated) and state_dict.dtype == torch.float32
    state_dict["unembed.b_U"][0] = float("nan")  # in place: unseen by the mark
    assert validate_state_dict(state_dict, CFG) == torch.float32
    assert validate_state_dict(state_dict, CFG.replace(applied=("fold_value_biases",))) == torch.float32
    with pytest.raises(StateDictError, match="unexpected keys"):
        validate_state_dict(state_dict, CFG.replace(n_layers=1, d_mlp=None))
    for plain in (dict(state_dict), state_dict.copy(), pickle.loads(pickle.dumps(state_dict))):
        assert type(plain) is dict
        with pytest.raises(StateDictError, match="unembed.b_U has 1 NaN"):
            validate_state_dict(plain, CFG)
    state_dict["unembed.b_U"] = state_dict["unembed.b_U"].clone()
    with pytest.raises(StateDictError, match="unembed.b_U has 1 NaN"):
        validate_state_dict(state_dict, CFG)
