"""Misuse is bad input: a CircuitMathError (exit 2 from the CLI) that says what to do, with the
correct use beside each as a control."""

import json
import struct
import subprocess
import sys

import pytest
import torch
import transformers

import circuitmath as cm
from circuitmath import _files, io
from circuitmath._cli import main
from circuitmath.testing import assert_equivalent, check_fold_layer_norm, diagnose

CFG = cm.Config(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16)


def _tiny(model_class, config):
    torch.manual_seed(0)
    return model_class(config).eval()


def gpt2():
    return _tiny(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=20, n_positions=8))


def llama():
    return _tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=20,
        max_position_embeddings=8))


@pytest.fixture
def files(tmp_path):
    """A GPT-2 and a LLaMA, original and processed, as files written by io.save, and a GPT-2 in
    its own names (no metadata) with the config.json of a GPT-NeoX beside it."""
    paths = {}
    for name, model in (("gpt2", gpt2()), ("llama", llama())):
        sd, cfg = io.from_hf(model.state_dict(), model.config)
        processed, processed_cfg = cm.process_weights(sd, cfg)
        io.save(paths.setdefault(name, tmp_path / f"{name}.safetensors"), sd, cfg)
        io.save(paths.setdefault(f"{name}_processed", tmp_path / f"{name}_processed.safetensors"), processed, processed_cfg)
        if name == "gpt2":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
                      paths.setdefault("gpt2_hf", tmp_path / "gpt2_hf.safetensors"))
            (tmp_path / "gpt2.json").write_text(model.config.to_json_string())
            paths["gpt2_config"] = tmp_path / "gpt2.json"
    neox = transformers.GPTNeoXConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                      vocab_size=20, max_position_embeddings=8)
    (tmp_path / "neox.json").write_text(neox.to_json_string())
    paths["neox_config"] = tmp_path / "neox.json"
    return {k: str(v) for k, v in paths.items()}


def _cli(capsys, *argv):
    status = main(["check", *argv, "--batch", "1", "--seq-len", "4"])
    return status, capsys.readouterr().err


def test_swapped_files_are_bad_input(files, capsys):
    status, err = _cli(capsys, files["gpt2_processed"], "--processed", files["gpt2"])
    assert status == 2
    assert f"{files['gpt2_processed']} looks processed and {files['gpt2']} does not: swapped?" in err
    assert "check ORIGINAL --processed PROCESSED" in err
    assert _cli(capsys, files["gpt2"], "--processed", files["gpt2_processed"])[0] == 0  # control


def test_swapped_folders_are_bad_input(tmp_path, capsys):
    model = gpt2()
    model.save_pretrained(tmp_path / "in")
    assert main(["process", str(tmp_path / "in"), str(tmp_path / "out")]) == 0
    status, err = _cli(capsys, str(tmp_path / "out"), "--processed", str(tmp_path / "in"))
    assert status == 2 and "looks processed and" in err and "swapped?" in err
    assert _cli(capsys, str(tmp_path / "in"), "--processed", str(tmp_path / "out"))[0] == 0  # control
    with pytest.raises(cm.CircuitMathError, match="swapped"):
        assert_equivalent(tmp_path / "out", tmp_path / "in")


def test_swapped_in_memory_is_bad_input():
    sd = cm.random_state_dict(CFG, seed=0)
    processed, processed_cfg = cm.process_weights(sd, CFG)
    with pytest.raises(cm.InputError, match="before looks processed and after does not: swapped"):
        assert_equivalent(processed, sd, processed_cfg, after_cfg=CFG)
    with pytest.raises(cm.InputError, match="swapped"):  # folded norms first, gains second, nothing recorded
        diagnose(processed, sd, processed_cfg.replace(applied=()), after_cfg=CFG)
    assert_equivalent(sd, processed, CFG, after_cfg=processed_cfg)  # control


def test_two_architectures_are_bad_input(files, capsys):
    status, err = _cli(capsys, files["gpt2"], "--processed", files["llama_processed"])
    assert status == 2
    assert "are two different architectures" in err
    assert "LayerNorm, learned positions, gelu_new MLP" in err and "RMSNorm, rotary positions, gated silu MLP" in err
    assert "give the processed model with the model it was processed from" in err


def test_layer_norm_to_rms_norm_is_no_change_of_architecture():
    """Control: RMSNorm after a LayerNorm is a processing (layer_norm_to_rms_norm), so it is compared."""
    sd = cm.random_state_dict(CFG, seed=0, dtype=torch.float64)
    processed, processed_cfg = cm.process_weights(sd, CFG)
    rms, rms_cfg = cm.layer_norm_to_rms_norm(processed, processed_cfg)
    assert rms_cfg.normalization_type == "RMSPre"
    assert_equivalent(sd, rms, CFG, after_cfg=rms_cfg)


def test_a_config_of_another_architecture_names_both(files, capsys):
    status, err = _cli(capsys, files["gpt2_hf"], "--config", files["neox_config"])
    assert status == 2
    assert "the config is a Hugging Face 'gpt_neox' config but the tensors are in GPT-2's" in err
    assert "'transformer.wte.weight'" in err and "pass the config of these weights" in err
    assert _cli(capsys, files["gpt2_hf"], "--config", files["gpt2_config"])[0] == 0  # control


def test_a_circuitmath_config_for_hugging_face_names_says_which():
    model = gpt2()
    cfg = io.from_hf(model.state_dict(), model.config)[1]
    with pytest.raises(cm.StateDictError, match="a circuitmath Config but the tensors are in GPT-2's"):
        diagnose(model.state_dict(), model.state_dict(), cfg)
    sd = cm.random_state_dict(CFG, seed=0)
    with pytest.raises(cm.StateDictError, match="Hugging Face 'gpt2' config but the tensors are in circuitmath's"):
        diagnose(sd, sd, model.config)


@pytest.mark.parametrize("call, right", [
    (lambda sd: cm.process_weights(CFG, sd), "process_weights(state_dict, cfg)"),
    (lambda sd: cm.fold_layer_norm(CFG, sd), "fold_layer_norm(state_dict, cfg)"),
    (lambda sd: cm.validate_state_dict(CFG, sd), "validate_state_dict(state_dict, cfg)"),
])
def test_arguments_in_the_wrong_order_name_the_right_call(call, right):
    sd = cm.random_state_dict(CFG, seed=0)
    with pytest.raises(cm.StateDictError, match=r"the arguments are in the wrong order") as raised:
        call(sd)
    assert f"call {right}" in str(raised.value) and "Config.from_dict" not in str(raised.value)


def test_a_config_given_first_to_a_checker_names_the_right_call():
    sd = cm.random_state_dict(CFG, seed=0)
    for check in (lambda: assert_equivalent(CFG, sd, sd), lambda: check_fold_layer_norm(sd, CFG, sd)):
        with pytest.raises(cm.CircuitMathError, match=r"assert_equivalent\(before, after, cfg\)"):
            check()


def test_a_config_given_as_the_model_of_check_model_names_the_right_call():
    sd = cm.random_state_dict(CFG, seed=0)
    with pytest.raises(cm.CircuitMathError, match=r"check_model\(model, cfg\)"):
        cm.testing.check_model(CFG, sd)


def test_hugging_face_names_of_one_architecture_with_the_config_of_another_name_both():
    """GPT-2's tensors with a LLaMA config.json: bad input naming the config's type and the
    tensors' naming, not a missing tensor."""
    weights = gpt2().state_dict()
    with pytest.raises(cm.StateDictError, match=r"Hugging Face 'llama' config but the tensors are in GPT-2's"):
        diagnose(weights, weights, llama().config)
    # control: their own config reads them
    assert diagnose(weights, weights, gpt2().config).ok


def test_a_mapping_of_fields_still_suggests_building_a_config():
    """Control: a dict of config fields is no wrong order; it is told how to build a Config."""
    with pytest.raises(cm.StateDictError, match=r"Config.from_dict"):
        cm.fold_layer_norm(cm.random_state_dict(CFG, seed=0), CFG.to_dict())


def _sparse_file(path, entries: int, dtype: str = "F32", size: int = 4) -> None:
    """A safetensors file declaring one tensor of ``entries`` entries, its data a hole."""
    header = json.dumps({"embed.W_E": {"dtype": dtype, "shape": [entries], "data_offsets": [0, size * entries]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + size * entries)


@pytest.mark.parametrize("form", ["file", "folder"])
def test_tensors_beyond_the_address_space_are_named(tmp_path, form):
    """Under ``ulimit -v 8000000`` (as the issue measured it), a 40 GiB tensor declared in a
    sparse file: refused before reading (a file), or when its map fails (a folder), naming it."""
    if form == "file":
        path = tmp_path / "big.safetensors"
        (tmp_path / "cfg.json").write_text(CFG.replace(n_layers=0).to_json())
        argv = [str(path), "--config", str(tmp_path / "cfg.json")]
    else:
        path = tmp_path / "folder" / "model.safetensors"
        path.parent.mkdir()
        (path.parent / "config.json").write_text(CFG.replace(n_layers=0).to_json())
        argv = [str(path.parent)]
    _sparse_file(path, 10 * 2**30)  # 40 GiB of float32, a hole on disk
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (8_000_000_000, resource.RLIM_INFINITY));"
              " from circuitmath._cli import main; sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", script, "check", *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "'embed.W_E' (torch.float32, shape [10737418240]" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_a_tensor_that_cannot_be_read_is_named(tmp_path, monkeypatch):
    sd = cm.random_state_dict(CFG, seed=0)
    io.save(tmp_path / "m.safetensors", sd, CFG)
    io.load_tensors(tmp_path / "m.safetensors")  # control

    class NoMemory:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def get_tensor(self, name):
            if name == "blocks.0.mlp.W_in":
                raise MemoryError("Cannot allocate memory (os error 12)")
            return sd[name]

    monkeypatch.setattr(_files, "safe_open", NoMemory)
    with pytest.raises(cm.StateDictError, match=r"tensor 'blocks.0.mlp.W_in' \(torch.float32, shape \[8, 16\], 512"
                                                r" bytes\) cannot be read into memory: Cannot allocate memory"):
        io.load_tensors(tmp_path / "m.safetensors")
    monkeypatch.setattr(_files, "_memory_limit", lambda: (100, "a test's limit"))
    with pytest.raises(cm.StateDictError, match=r"more than a test's limit \(100 bytes\), the largest 'blocks.0.mlp.W_in'"):
        io.load_tensors(tmp_path / "m.safetensors")


def test_dtypes_are_named_as_torch_names_them(tmp_path):
    header = json.dumps({"embed.W_E": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "c.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(cm.StateDictError) as raised:
        io.load_tensors(tmp_path / "c.safetensors")
    assert "has dtype torch.complex64 ('C64'), not one circuitmath reads" in str(raised.value)
    assert "float32" in str(raised.value) and "'F32'" not in str(raised.value)


def test_overflow_refusals_say_overflow():
    cfg = cm.Config(n_layers=1, d_model=4, n_heads=1, d_head=2, d_vocab=5, n_ctx=3)
    sd = cm.random_state_dict(cfg, seed=0, dtype=torch.float16)
    sd["blocks.0.ln1.w"] = torch.full((4,), 300.0, dtype=torch.float16)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float16)[:, None]
    sd["blocks.0.attn.W_Q"] = (300 * signs).expand_as(sd["blocks.0.attn.W_Q"]).clone()
    for transform in (cm.process_weights, cm.fold_layer_norm):
        with pytest.raises(cm.OverflowedError, match="overflow"):
            transform(sd, cfg)


@pytest.mark.parametrize("call", ["assert_equivalent", "diagnose", "check_fold_layer_norm"])
def test_a_state_dict_without_its_config_is_bad_input_saying_what_to_pass(call):
    """A state dict carries no config: each checker given one without it is refused, saying what
    to pass; the same call with the config is the control."""
    from circuitmath import testing

    state_dict = cm.random_state_dict(CFG, seed=0)
    check = getattr(testing, call)
    with pytest.raises(cm.CircuitMathError, match="a state dict needs its config: a circuitmath Config or a Hugging Face"):
        check(state_dict, state_dict)
    if call == "check_fold_layer_norm":
        after, after_cfg = cm.fold_layer_norm(state_dict, CFG)
        assert check(state_dict, after, CFG, after_cfg=after_cfg).ok
    else:
        check(state_dict, state_dict, CFG)
