"""circuitmath._config on its own: strict fields, JSON round trip, errors naming every field."""

import pytest

from circuitmath import Config
from circuitmath._errors import ConfigError

BASE = dict(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=9, n_ctx=5, d_mlp=12)


def test_json_round_trip_keeps_every_field():
    cfg = Config(**BASE).replace(normalization_type="RMS", applied=("fold_rms_norm",))
    assert Config.from_json(cfg.to_json()) == cfg
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_attn_only_follows_d_mlp():
    assert Config(**{**BASE, "d_mlp": None}).attn_only and not Config(**BASE).attn_only


@pytest.mark.parametrize("changes, field", [
    ({"n_layers": -1}, "n_layers"),
    ({"d_model": 2.5}, "d_model"),
    ({"normalization_type": "BatchNorm"}, "normalization_type"),
    ({"positional_embedding_type": "learned"}, "positional_embedding_type"),
])
def test_an_ill_typed_field_is_named(changes, field):
    with pytest.raises(ConfigError, match=field):
        Config(**{**BASE, **changes})


def test_unknown_and_missing_fields_are_named_together():
    data = {**Config(**BASE).to_dict(), "n_laters": 3}
    del data["d_vocab"]
    with pytest.raises(ConfigError) as caught:
        Config.from_dict(data)
    assert "n_laters" in str(caught.value) and "d_vocab" in str(caught.value)


def test_not_json_is_a_config_error():
    with pytest.raises(ConfigError):
        Config.from_json("{not json")
