"""safetensors in and out, and the refusal of pickles."""

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

import circuitmath as cm
from circuitmath import io

CFG = cm.Config(n_layers=1, d_model=6, n_heads=2, d_head=3, d_vocab=7, n_ctx=4, d_mlp=8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_exact(tmp_path, dtype):
    sd = cm.random_state_dict(CFG, seed=3, dtype=dtype)
    cfg = CFG.replace(applied=("fold_layer_norm",), normalization_type="LNPre")
    sd = {k: v for k, v in sd.items() if not (".ln" in k or k.startswith("ln_final"))}
    io.save(tmp_path / "m.safetensors", sd, cfg, metadata={"note": "round trip"})
    back, back_cfg = io.load(tmp_path / "m.safetensors")
    assert back_cfg == cfg
    assert back.keys() == sd.keys()
    assert all(back[k].dtype == dtype and torch.equal(back[k], sd[k]) for k in sd)
    _tensors, metadata = io.load_tensors(tmp_path / "m.safetensors")
    assert metadata["note"] == "round trip"
    assert json.loads(metadata[io.CONFIG_KEY])["applied"] == ["fold_layer_norm"]


def test_save_validates_and_writes_safetensors_only(tmp_path):
    sd = cm.random_state_dict(CFG, seed=0)
    with pytest.raises(ValueError, match="safetensors only"):
        io.save(tmp_path / "m.pt", sd, CFG)
    with pytest.raises(cm.StateDictError, match="missing keys"):
        io.save(tmp_path / "m.safetensors", {k: v for k, v in sd.items() if k != "embed.W_E"}, CFG)
    with pytest.raises(ValueError, match="reserved"):
        io.save(tmp_path / "m.safetensors", sd, CFG, metadata={io.CONFIG_KEY: "{}"})
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".ckpt", ".pkl"])
def test_pickle_suffixes_are_refused_before_reading(tmp_path, suffix):
    path = tmp_path / f"weights{suffix}"
    path.write_bytes(b"never opened")
    for reader in (io.load, io.load_tensors):
        with pytest.raises(io.UnsafeFormatError, match="never unpickles"):
            reader(path)


class _Exploit:
    """Unpickling this would create a file: the test proves it never happens."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickle_content_is_refused_whatever_the_name(tmp_path):
    marker = tmp_path / "unpickled"
    disguised = tmp_path / "weights.safetensors"
    disguised.write_bytes(pickle.dumps(_Exploit(marker)))
    zipped = tmp_path / "zipped.safetensors"
    torch.save({"embed.W_E": torch.zeros(2, 2)}, zipped)  # torch's zip format holds a pickle
    for path in (disguised, zipped):
        with pytest.raises(io.UnsafeFormatError, match="never unpickles"):
            io.load_tensors(path)
    assert not marker.exists()


def test_garbage_and_foreign_safetensors_are_refused(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x01\x02")
    with pytest.raises(io.UnsafeFormatError, match="not a safetensors file"):
        io.load_tensors(garbage)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"wte.weight": torch.zeros(2, 2)}, str(foreign))
    with pytest.raises(cm.StateDictError, match="not written by circuitmath.io.save"):
        io.load(foreign)
    tensors, metadata = io.load_tensors(foreign)
    assert list(tensors) == ["wte.weight"] and metadata == {}


def test_load_checks_weights_against_the_stored_config(tmp_path):
    sd = cm.random_state_dict(CFG, seed=0)
    path = tmp_path / "m.safetensors"
    wrong = CFG.replace(d_vocab=8)
    save_file(dict(sd), str(path), metadata={io.CONFIG_KEY: wrong.to_json()})
    with pytest.raises(cm.StateDictError, match="embed.W_E has shape"):
        io.load(path)


def test_hf_directory_with_only_a_pickle_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(io.UnsafeFormatError, match="pickled weights"):
        io.load_hf_directory(tmp_path)


def test_unknown_architecture_is_refused():
    with pytest.raises(io.UnsupportedArchitectureError, match="model_type 't5'"):
        io.from_hf({}, {"model_type": "t5"})
