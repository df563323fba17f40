"""Hostile and malformed input: every bad file, config, tensor or argument gets a CircuitMathError
(exit 2 from the CLI) naming the file and the key or field; nothing is written, no input is
mutated, nothing hangs, and no valid file is refused.

The fixed cases are the ones found by hand; the hypothesis cases fuzz safetensors headers, config
JSON, tensor dtypes, shapes and values, and special files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import signal
import struct
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import circuitmath as cm
from circuitmath import _cli, io
from circuitmath.strategies import configs
from support import snapshot, wide

CFG = cm.Config(n_layers=1, d_model=6, n_heads=2, d_head=3, d_vocab=7, n_ctx=4, d_mlp=8)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
TRANSFORMS = (
    cm.fold_layer_norm, cm.center_reading_weights, cm.center_writing_weights, cm.center_unembed,
    cm.fold_value_biases, cm.remove_key_biases, cm.refactor_factored_attn_matrices, cm.process_weights,
    cm.layer_norm_to_rms_norm, cm.fold_rms_norm, cm.shortformer_to_tables,
)


@contextlib.contextmanager
def no_hang(seconds: int = 60):
    """Fail (rather than hang the suite) if the block runs longer than ``seconds``."""

    def alarm(*_):
        raise AssertionError(f"still running after {seconds} s: a blocking read or an unbounded loop")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def same(a, b) -> bool:
    """Same names, dtypes and bytes (so NaN entries compare equal, in any dtype)."""

    def raw(t):
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(raw(a[k]), raw(b[k])) for k in a)


def run_cli(capsys, *args):
    status = _cli.main([*map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


def refused(capsys, folder, *args, naming: tuple[str, ...] = (), command: str = "check"):
    """Run ``COMMAND ARGS`` (default ``check``): exit 2, one ``error:`` line naming each of
    ``naming``, nothing written."""
    before = sorted(folder.iterdir())
    capsys.readouterr()  # what building the inputs printed
    status, out, err = run_cli(capsys, command, *args)
    assert status == 2, (status, out, err)
    assert out == "" and err.startswith("error: ") and "Traceback" not in err, err
    for word in naming:
        assert str(word) in err, (word, err)
    assert sorted(folder.iterdir()) == before
    return err


def model_file(folder, cfg=CFG, *, metadata=None, name="m.safetensors", dtype=torch.float64):
    path = folder / name
    io.save(path, cm.random_state_dict(cfg, seed=0, dtype=dtype), cfg, metadata=metadata)
    return path


def raw_file(path, tensors: dict, metadata: dict | None):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


# ---------------------------------------------------------------------------------------------
# 1. a valid file is never taken for a pickle


def _with_header(path, change, out=None):
    """The safetensors file ``path`` with ``change(header, data_bytes)`` made to its parsed
    header, written to ``out`` (default ``path``); returns where it was written."""
    data = path.read_bytes()
    length = _header_length(path)
    header = json.loads(data[8:8 + length])
    change(header, len(data) - 8 - length)
    text = json.dumps(header).encode()
    out = out or path
    out.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    return out


def _header_length(path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.mark.parametrize("first_bytes", [b"\x80", b"PK"])
def test_a_valid_file_whose_header_length_reads_like_a_pickle_or_zip_loads(tmp_path, first_bytes):
    """The header length is the file's first 8 bytes (a multiple of 8: safetensors pads the
    header): lengths 0x..80 and 0x..4B50 make files that start like a pickle or a zip."""
    sd = cm.random_state_dict(CFG, seed=0)
    path = tmp_path / "m.safetensors"
    target = int.from_bytes(first_bytes, "little")
    modulus = 1 << (8 * len(first_bytes))
    io.save(path, sd, CFG, metadata={"pad": ""})
    estimate = (target - _header_length(path)) % modulus
    for pad in range(max(estimate - 8, 0), estimate + 9):
        io.save(path, sd, CFG, metadata={"pad": "x" * pad})
        if path.read_bytes()[: len(first_bytes)] == first_bytes:
            break
    assert path.read_bytes()[: len(first_bytes)] == first_bytes  # the case that was refused
    back, back_cfg = io.load(path)
    assert back_cfg == CFG and all(torch.equal(back[k], sd[k]) for k in sd)


def test_the_reported_config_round_trips(tmp_path):
    cfg = cm.Config(n_layers=3, d_model=64, n_heads=2, d_head=32, d_vocab=1000, n_ctx=1024)
    sd = cm.random_state_dict(cfg, seed=0)
    io.save(tmp_path / "m.safetensors", sd, cfg)
    back, back_cfg = io.load(tmp_path / "m.safetensors")
    assert back_cfg == cfg and back.keys() == sd.keys()


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(cfg=configs(**wide(max_layers=2, max_d_model=12, max_heads=3, max_d_head=4, max_vocab=40)),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       pad=st.integers(0, 300))
def test_save_then_load_round_trips_for_every_drawn_config(tmp_path_factory, cfg, dtype, pad):
    folder = tmp_path_factory.mktemp("round")
    sd = cm.random_state_dict(cfg, seed=1, dtype=dtype)
    io.save(folder / "m.safetensors", sd, cfg, metadata={"pad": "x" * pad})
    back, back_cfg = io.load(folder / "m.safetensors")
    assert back_cfg == cfg
    assert all(back[k].dtype == dtype and torch.equal(back[k], sd[k]) for k in sd)


def test_pickle_and_zip_content_are_still_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    pickled = tmp_path / "p.safetensors"
    pickled.write_bytes(b"\x80\x04\x95" + b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    zipped = tmp_path / "z.safetensors"
    torch.save({"embed.W_E": torch.zeros(2)}, zipped)
    for path in (pickled, zipped):
        with pytest.raises(io.UnsafeFormatError, match="never unpickles") as error:
            io.load(path)
        assert str(path) in str(error.value)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# 2. a config cannot make the library build more than the file holds


def test_a_config_claiming_a_billion_layers_is_refused_at_once(tmp_path, capsys):
    sd = cm.random_state_dict(CFG, seed=0)
    huge = CFG.replace(n_layers=10**9)
    path = raw_file(tmp_path / "m.safetensors", sd, {io.CONFIG_KEY: huge.to_json()})
    with no_hang(20):
        with pytest.raises(cm.StateDictError, match=r"n_layers=1000000000.*does not describe") as error:
            io.load(path)
        assert str(path) in str(error.value)
        with pytest.raises(cm.StateDictError, match="n_layers=1000000000"):
            cm.validate_state_dict(sd, huge)
        refused(capsys, tmp_path, path, naming=(path, "n_layers"))


def test_bounded_memory_for_configs_and_arguments_that_claim_too_much(tmp_path):
    """A child process checking hostile inputs peaks no higher than one checking a valid model."""
    sd = cm.random_state_dict(CFG, seed=0, dtype=torch.float64)
    valid = model_file(tmp_path, name="valid.safetensors")
    claims = raw_file(tmp_path / "claims.safetensors", sd, {io.CONFIG_KEY: CFG.replace(n_layers=10**9).to_json()})
    wide = tmp_path / "wide.json"
    wide.write_text(CFG.replace(d_vocab=10**12).to_json())
    script = (
        "import json, resource, sys\n"
        "from circuitmath import _cli\n"
        "codes = [_cli.main(['check', *a.split('|')]) for a in sys.argv[1:]]\n"
        "print(json.dumps([codes, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]), file=sys.stderr)\n"
    )

    def peak(*cases):
        out = subprocess.run([sys.executable, "-c", script, *cases], capture_output=True, text=True, timeout=300)
        codes, rss = json.loads(out.stderr.splitlines()[-1])
        return codes, rss

    hostile_codes, hostile = peak(str(claims), f"{valid}|--config|{wide}", f"{valid}|--batch|1000000000")
    valid_codes, baseline = peak(str(valid))
    assert hostile_codes == [2, 2, 2] and valid_codes == [0]
    assert hostile <= baseline + 64 * 1024, (hostile, baseline)  # kilobytes


# ---------------------------------------------------------------------------------------------
# 3. no unbounded read, no blocking open


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_config_that_is_a_device_is_refused_unread(tmp_path, capsys, device):
    path = model_file(tmp_path)
    with no_hang(20):
        refused(capsys, tmp_path, path, "--config", device, naming=(device, "not a regular file"))
        folder = tmp_path / "hf"
        folder.mkdir()
        raw_file(folder / "model.safetensors", {"wte.weight": torch.zeros(2, 2)}, None)
        (folder / "config.json").symlink_to(device)
        refused(capsys, tmp_path, folder, naming=("config.json", "not a regular file"))


def test_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "m.safetensors"
    os.mkfifo(fifo)
    with no_hang(20):
        with pytest.raises(cm.InputError, match="not a regular file"):
            io.load(fifo)
        refused(capsys, tmp_path, fifo, naming=(fifo,))


def test_a_config_over_the_size_limit_is_refused(tmp_path, capsys):
    path = model_file(tmp_path)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({**CFG.to_dict(), "pad": "x" * (2 << 20)}))
    refused(capsys, tmp_path, path, "--config", big, naming=(big, "limit"))


# ---------------------------------------------------------------------------------------------
# 4 and 6. non-finite output from finite input is an error; NaN never reaches an SVD


def _overflowing():
    sd = cm.random_state_dict(CFG, seed=0)
    fold = dict(sd)
    fold["blocks.0.ln1.w"] = torch.full_like(sd["blocks.0.ln1.w"], 1e20)
    fold["blocks.0.attn.W_Q"] = torch.full_like(sd["blocks.0.attn.W_Q"], 1e20)
    writers = dict(sd)
    writers["embed.W_E"] = sd["embed.W_E"].clone()
    writers["embed.W_E"][0] = torch.tensor([3.4e38, -3.4e38] * 3)
    half = {k: v.half() for k, v in sd.items()}
    half["unembed.b_U"] = torch.tensor([65000.0, -65000.0] * 3 + [65000.0], dtype=torch.float16)
    return [
        (cm.fold_layer_norm, fold, "fold_layer_norm", "blocks.0.attn.W_Q"),
        (cm.center_writing_weights, writers, "center_writing_weights", "embed.W_E"),
        (cm.center_unembed, half, "center_unembed", "unembed.b_U"),
    ]


@pytest.mark.parametrize("case", range(3))
def test_a_rewrite_that_overflows_is_refused_naming_identity_and_tensor(case):
    transform, sd, identity, tensor = _overflowing()[case]
    assert all(torch.isfinite(t).all() for t in sd.values())
    before = snapshot(sd)
    with pytest.raises(cm.OverflowedError, match=rf"{identity}: .*{tensor} has \d+ NaN or Inf"):
        transform(sd, CFG)
    assert same(sd, before)


@pytest.mark.parametrize("name", ["blocks.0.attn.W_Q", "blocks.0.attn.W_O", "blocks.0.ln1.w", "blocks.0.attn.b_K"])
def test_nan_never_reaches_the_svd(name):
    sd = cm.random_state_dict(CFG, seed=0)
    sd[name] = sd[name].clone()
    sd[name].view(-1)[0] = float("nan")
    with pytest.raises(cm.StateDictError, match=rf"{name} has 1 NaN or Inf"):
        cm.process_weights(sd, CFG, refactor_factored_attn_matrices=True)


# ---------------------------------------------------------------------------------------------
# 5. command-line inputs that ended in a traceback


def _hf_gpt2_folder(folder, *, config_changes=None, tensor_changes=None):
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=6)
    model = transformers.GPT2LMHeadModel(config)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items() if not re.fullmatch(r".*h\.\d+\.attn\.(masked_)?bias", k)}
    tensors.pop("lm_head.weight")
    tensors.update(tensor_changes or {})
    folder.mkdir()
    raw_file(folder / "model.safetensors", tensors, {"format": "pt"})
    data = {**config.to_dict(), **(config_changes or {})}
    for key, value in list(data.items()):
        if value == "DELETE":
            del data[key]
    (folder / "config.json").write_text(json.dumps(data))
    return folder


CONFIG_CASES = {
    "a missing key": ({"n_layers": "DELETE"}, "missing keys ['n_layers']"),
    "positional_embedding_type 5": ({"positional_embedding_type": 5}, "positional_embedding_type"),
    "rotary_dim as a string": ({"positional_embedding_type": "rotary", "rotary_dim": "4"}, "rotary_dim"),
    "applied 5": ({"applied": 5}, "applied"),
    "applied as a string": ({"applied": "center_unembed"}, "applied"),
    "rotary_base x": ({"positional_embedding_type": "rotary", "rotary_base": "x"}, "rotary_base"),
    "n_layers True": ({"n_layers": True}, "n_layers"),
    "causal no": ({"causal": "no"}, "causal"),
    "gated_mlp false": ({"gated_mlp": "false"}, "gated_mlp"),
    "eps inf": ({"eps": "Infinity"}, "eps"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_an_ill_typed_config_field_exits_2_naming_file_and_field(tmp_path, capsys, case):
    changes, field = CONFIG_CASES[case]
    path = model_file(tmp_path)
    data = CFG.to_dict()
    for key, value in changes.items():
        data.pop(key) if value == "DELETE" else data.__setitem__(key, value)
    text = json.dumps(data).replace('"Infinity"', "Infinity")
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(text)
    refused(capsys, tmp_path, path, "--config", cfg_file, naming=(cfg_file, field))
    stored = raw_file(tmp_path / "stored.safetensors", cm.random_state_dict(CFG, seed=0), {io.CONFIG_KEY: text})
    refused(capsys, tmp_path, stored, naming=(stored, io.CONFIG_KEY, field))


@pytest.mark.parametrize("text, why", [("5", "not an object"), ("null", "not an object"), ("[" * 5000 + "]" * 5000, "nests"),
                                       ("{nope", "not JSON")])
def test_a_config_that_is_not_an_object_exits_2(tmp_path, capsys, text, why):
    path = model_file(tmp_path)
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(text)
    refused(capsys, tmp_path, path, "--config", cfg_file, naming=(cfg_file, why))


def test_a_config_that_is_not_utf8_exits_2(tmp_path, capsys):
    path = model_file(tmp_path)
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_bytes(b'{"n_layers": "\xff\xfe"}')
    refused(capsys, tmp_path, path, "--config", cfg_file, naming=(cfg_file, "UTF-8"))


HF_CASES = {
    "no n_embd": ({"n_embd": "DELETE"}, None, "'n_embd' is missing"),
    "n_head 0": ({"n_head": 0}, None, "n_head must be an int >= 1"),
    "n_embd as a string": ({"n_embd": "8"}, None, "n_embd"),
    "wrong c_attn": (None, {"transformer.h.0.attn.c_attn.weight": torch.zeros(8, 20)}, "h.0.attn.c_attn.weight"),
    "wrong wte": (None, {"transformer.wte.weight": torch.zeros(11, 7)}, "wte.weight"),
    "a name twice": (None, {"h.0.ln_1.weight": torch.zeros(8)}, "h.0.ln_1.weight"),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_a_broken_hugging_face_folder_exits_2_naming_folder_and_field(tmp_path, capsys, case):
    config_changes, tensor_changes, field = HF_CASES[case]
    folder = _hf_gpt2_folder(tmp_path / "hf", config_changes=config_changes, tensor_changes=tensor_changes)
    refused(capsys, tmp_path, folder, naming=(folder, field))


def test_an_invalid_hugging_face_config_json_names_the_file(tmp_path, capsys):
    folder = _hf_gpt2_folder(tmp_path / "hf")
    (folder / "config.json").write_text("{not json")
    refused(capsys, tmp_path, folder, naming=(folder / "config.json", "not JSON"))


def test_float8_tensors_exit_2_naming_the_tensor(tmp_path, capsys):
    sd = {k: v.to(torch.float8_e4m3fn) for k, v in cm.random_state_dict(CFG, seed=0).items()}
    path = raw_file(tmp_path / "m.safetensors", sd, {io.CONFIG_KEY: CFG.to_json()})
    refused(capsys, tmp_path, path, naming=(path, "embed.W_E has dtype torch.float8_e4m3fn"))


def test_a_header_claiming_a_huge_tensor_is_refused_before_reading(tmp_path, capsys):
    hostile = _with_header(model_file(tmp_path), lambda header, _: header["embed.W_E"].update(shape=[10**6, 10**6]),
                           tmp_path / "huge.safetensors")
    with pytest.raises(cm.StateDictError, match="'embed.W_E' of shape"):
        io.load_tensors(hostile)
    refused(capsys, tmp_path, hostile, naming=(hostile, "embed.W_E"))


def test_truncated_files_name_the_file(tmp_path, capsys):
    path = model_file(tmp_path)
    data = path.read_bytes()
    for cut in (4, 20, len(data) - 3):
        short = tmp_path / f"short{cut}.safetensors"
        short.write_bytes(data[:cut])
        refused(capsys, tmp_path, short, naming=(short,))


def test_invalid_json_in_the_stored_config_names_file_and_key(tmp_path, capsys):
    path = raw_file(tmp_path / "m.safetensors", cm.random_state_dict(CFG, seed=0), {io.CONFIG_KEY: "{oops"})
    refused(capsys, tmp_path, path, naming=(path, io.CONFIG_KEY, "not JSON"))


@pytest.mark.parametrize("args, why", [(["--batch", "1000000000"], "--batch"), (["--batch", "0"], "at least 1"),
                                       (["--seq-len", "-3"], "at least 1")])
def test_check_arguments_out_of_range_exit_2(tmp_path, capsys, args, why):
    refused(capsys, tmp_path, model_file(tmp_path), *args, naming=(why,))


def test_a_broken_pipe_on_stdout_is_not_a_traceback(tmp_path):
    path = model_file(tmp_path)
    command = f"{sys.executable} -m circuitmath check {path} --json | head -c 10"
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert out.stdout == "[\n  {\n    " and "Traceback" not in out.stderr, out.stderr


# ---------------------------------------------------------------------------------------------
# 7 and 8. API inputs: grad, meta, float8, a dict for a config, wrong field types


def test_weights_that_require_grad_work_everywhere_and_come_back_plain():
    sd = {k: torch.nn.Parameter(v) for k, v in cm.random_state_dict(CFG, seed=0, dtype=torch.float64).items()}
    for transform in TRANSFORMS:
        try:
            out, _ = transform(sd, CFG)
        except cm.PreconditionError:  # does not apply to this model
            continue
        assert not any(t.requires_grad for t in out.values()), transform.__name__
    processed, processed_cfg = cm.process_weights(sd, CFG)
    wrong = dict(processed, **{"unembed.b_U": processed["unembed.b_U"] * 1.5 + 1})
    wrong = {k: torch.nn.Parameter(v) for k, v in wrong.items()}
    from circuitmath.testing import NotEquivalentError, assert_equivalent

    with pytest.raises(NotEquivalentError, match="unembed.b_U"):
        assert_equivalent(sd, wrong, CFG, after_cfg=processed_cfg)


def test_meta_float8_and_dict_configs_are_named():
    sd = cm.random_state_dict(CFG, seed=0)
    meta = dict(sd, **{"embed.W_E": torch.empty(7, 6, device="meta")})
    with pytest.raises(cm.StateDictError, match="embed.W_E is on the meta device"):
        cm.center_writing_weights(meta, CFG)
    eight = dict(sd, **{"unembed.W_U": sd["unembed.W_U"].to(torch.float8_e5m2)})
    with pytest.raises(cm.StateDictError, match="unembed.W_U has dtype torch.float8_e5m2"):
        cm.fold_layer_norm(eight, CFG)
    with pytest.raises(cm.StateDictError, match="got dict .build one with Config.from_dict"):
        cm.fold_layer_norm(sd, CFG.to_dict())


@pytest.mark.parametrize("field, value", [("n_layers", True), ("causal", "no"), ("gated_mlp", "false"),
                                          ("rotary_base", "ten thousand"), ("eps", math.inf), ("eps", math.nan),
                                          ("applied", "center_unembed"), ("applied", ["ok", 5]), ("d_mlp", 2.0),
                                          ("normalization_type", ["LN"]), ("act_fn", None)])
def test_config_refuses_wrong_types_naming_the_field(field, value):
    with pytest.raises(cm.ConfigError, match=field):
        CFG.replace(**{field: value})


def test_applied_as_a_string_cannot_slip_past_the_double_application_guard():
    sd = cm.random_state_dict(CFG, seed=0)
    _, once = cm.center_unembed(sd, CFG)
    with pytest.raises(cm.AlreadyAppliedError):
        cm.center_unembed(sd, once)
    with pytest.raises(cm.ConfigError):
        CFG.replace(applied="center_unembed")


def test_every_deliberate_error_is_a_circuitmath_error():
    with pytest.raises(cm.CircuitMathError):
        io.save("m.pt", cm.random_state_dict(CFG, seed=0), CFG)
    with pytest.raises(cm.CircuitMathError, match="path comes first"):
        io.save(cm.random_state_dict(CFG, seed=0), "m.safetensors", CFG)
    with pytest.raises(cm.CircuitMathError):
        cm.log_probs(cm.random_state_dict(CFG, seed=0), CFG, torch.tensor([[0, 99]]))
    with pytest.raises(cm.CircuitMathError):
        cm.Config.from_json("[1]")


# ---------------------------------------------------------------------------------------------
# fuzzing: random headers, random config JSON, random tensors, special files


def _valid_bytes(tmp_path) -> bytes:
    return model_file(tmp_path, name="seed.safetensors").read_bytes()


@st.composite
def damaged_files(draw, data: bytes):
    """A valid file's bytes with one kind of damage: a cut, changed header bytes, a new length,
    or a header replaced by other JSON."""
    length = struct.unpack("<Q", data[:8])[0]
    kind = draw(st.sampled_from(["cut", "flip", "length", "json"]))
    if kind == "cut":
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind == "flip":
        position = draw(st.integers(0, 8 + length - 1))
        byte = draw(st.integers(0, 255))
        return data[:position] + bytes([byte]) + data[position + 1:]
    if kind == "length":
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + data[8:]
    header = json.loads(data[8:8 + length])
    name = draw(st.sampled_from(sorted(header)))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
    junk = draw(st.one_of(st.none(), st.integers(-(2**70), 2**70), st.text(max_size=5),
                          st.lists(st.integers(-5, 2**40), max_size=4), st.floats()))
    if field is None:
        header[name] = junk
    elif isinstance(header[name], dict):
        header[name][field] = junk
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + length:]


@FUZZ
@given(data=st.data())
def test_fuzzed_safetensors_files_load_or_are_refused_by_name(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("fuzz")
    damaged = data.draw(damaged_files(_valid_bytes(folder)))
    path = folder / "damaged.safetensors"
    path.write_bytes(damaged)
    before = sorted(folder.iterdir())
    with no_hang(60):
        try:
            tensors, cfg = io.load(path)
        except cm.CircuitMathError as error:
            assert str(path) in str(error), error
        else:
            cm.validate_state_dict(tensors, cfg)
    assert sorted(folder.iterdir()) == before


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(sorted(CFG.to_dict()) + ["extra"]), json_values, min_size=1, max_size=3),
       drop=st.sets(st.sampled_from(sorted(CFG.to_dict())), max_size=2))
def test_fuzzed_configs_are_accepted_or_refused_by_field(tmp_path_factory, changes, drop):
    folder = tmp_path_factory.mktemp("cfg")
    data = {k: v for k, v in {**CFG.to_dict(), **changes}.items() if k not in drop}
    path = folder / "cfg.json"
    path.write_text(json.dumps(data))
    try:
        cfg = io.read_config(path)
    except cm.ConfigError as error:
        assert str(path) in str(error)
        named = set(changes) | drop
        assert any(name in str(error) for name in named) or "invalid Config" in str(error), error
    else:
        assert isinstance(cfg, (cm.Config, dict))


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int64,
          torch.bool, torch.complex64]


@FUZZ
@given(name=st.sampled_from(sorted(cm.expected_shapes(CFG))), dtype=st.sampled_from(DTYPES),
       shape=st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=3)),
       value=st.sampled_from([None, math.nan, math.inf, -math.inf, 1e30, 0.0]),
       transform=st.sampled_from(TRANSFORMS))
def test_fuzzed_tensors_are_rewritten_or_refused_by_name(name, dtype, shape, value, transform):
    sd = cm.random_state_dict(CFG, seed=0)
    tensor = sd[name] if shape is None else torch.randn(shape)
    if value is not None and tensor.numel():
        tensor = tensor.clone()
        tensor.view(-1)[0] = value
    sd[name] = tensor.to(dtype)
    before = snapshot(sd)
    try:
        out, out_cfg = transform(sd, CFG)
    except cm.PreconditionError:
        pass  # a transform that does not apply to this architecture says so
    except cm.CircuitMathError as error:
        assert name in str(error) or "overflowed" in str(error) or "range" in str(error), error
    else:
        assert all(torch.isfinite(t).all() for t in out.values() if t.is_floating_point())
        cm.validate_state_dict(out, out_cfg)
    assert same(sd, before)


@pytest.mark.parametrize("kind", ["folder", "empty", "absent", "dangling link", "socket"])
def test_special_files_are_refused_by_name(tmp_path, capsys, kind):
    path = tmp_path / "m.safetensors"
    if kind == "folder":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "dangling link":
        path.symlink_to(tmp_path / "nowhere")
    elif kind == "socket":
        import socket

        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    with no_hang(20):
        with pytest.raises(cm.CircuitMathError) as error:
            io.load(path)
        assert str(path) in str(error.value)
        if kind != "folder":  # a folder is read as a Hugging Face model folder by check
            refused(capsys, tmp_path, path, naming=(path,))


@pytest.mark.parametrize("command", [[], ["prove"], ["check"]])
def test_help_is_plain_text(capsys, command):
    with pytest.raises(SystemExit) as done:
        _cli.main([*command, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage:") and "``" not in out and ":func:" not in out


# ---------------------------------------------------------------------------------------------
# checkpoint folders: process and check read them a part at a time, and refuse as io.load does


def _processed_folder(tmp_path, name="after", **keywords):
    path = model_file(tmp_path, dtype=torch.float32)
    io.process_checkpoint(path, tmp_path / name, **keywords)
    return path, tmp_path / name


def test_a_folder_whose_config_claims_a_billion_layers_is_refused_at_once(tmp_path, capsys):
    folder = tmp_path / "billion"
    folder.mkdir()
    raw_file(folder / "model.safetensors", cm.random_state_dict(CFG, seed=0), None)
    (folder / "config.json").write_text(CFG.replace(n_layers=10**9).to_json())
    with no_hang(20):
        refused(capsys, tmp_path, folder, naming=(folder, "n_layers=1000000000"))
        refused(capsys, tmp_path, folder, tmp_path / "out", naming=(folder, "n_layers=1000000000"), command="process")


def test_a_processed_folder_with_nan_where_the_tokens_do_not_read_is_refused(tmp_path, capsys):
    """The forward pass over one token reads one row of the embedding; every entry is checked."""
    before, after = _processed_folder(tmp_path)
    index = json.loads((after / "model.safetensors.index.json").read_text())
    shard = after / index["weight_map"]["embed.W_E"]
    tensors, metadata = io.load_tensors(shard)
    used = int(torch.randint(0, CFG.d_vocab, (1, 1), generator=torch.Generator().manual_seed(0)))  # check's --seed 0
    tensors["embed.W_E"][(used + 1) % CFG.d_vocab, 0] = float("nan")
    raw_file(shard, tensors, metadata)
    refused(capsys, tmp_path, before, "--processed", after, "--batch", "1", "--seq-len", "1",
            naming=(after, "embed.W_E", "NaN or Inf"))


def test_a_processed_folder_of_steps_outside_the_pipeline_is_replayed(tmp_path, capsys):
    """The original first, the folder recording remove_key_biases (no process_weights step) second:
    its recorded identity is replayed, and the tensors and log-probs hold. Given the other way
    round the pair is refused as swapped (tests/test_misuse.py)."""
    before = model_file(tmp_path)
    sd, cfg = cm.remove_key_biases(cm.random_state_dict(CFG, seed=0, dtype=torch.float64), CFG)
    io.save(tmp_path / "removed.safetensors", sd, cfg)
    io.process_checkpoint(tmp_path / "removed.safetensors", tmp_path / "after", steps=[])
    status, out, err = run_cli(capsys, "check", before, "--processed", tmp_path / "after")
    assert status == 0 and "Traceback" not in err, (out, err)
    assert re.search(r"^tensors\s+holds", out, re.M) and re.search(r"^log-probs\s+holds", out, re.M), out
    assert "remove_key_biases of before" in out
    status, out, err = run_cli(capsys, "check", tmp_path / "removed.safetensors", "--processed", before)
    assert status == 2 and "swapped?" in err


HF_FIELD_CASES = {
    "an activation as a list": ({"activation_function": ["gelu"]}, "activation_function"),
    "an activation as an object": ({"activation_function": {"name": "gelu"}}, "activation_function"),
}


@pytest.mark.parametrize("case", sorted(HF_FIELD_CASES))
def test_an_ill_typed_hugging_face_field_exits_2_for_check_and_process(tmp_path, capsys, case):
    changes, field = HF_FIELD_CASES[case]
    folder = _hf_gpt2_folder(tmp_path / "hf", config_changes=changes)
    refused(capsys, tmp_path, folder, naming=(folder, field))
    refused(capsys, tmp_path, folder, tmp_path / "out", naming=(folder, field), command="process")


@pytest.mark.parametrize("fraction", [1e308, 1.5, 0.0, -0.5])
def test_a_rotary_fraction_outside_the_head_is_a_config_error(fraction):
    from circuitmath._hf import _rotary

    with pytest.raises(cm.ConfigError, match="partial_rotary_factor must be a fraction of the head"):
        _rotary({"rope_parameters": {"partial_rotary_factor": fraction}}, 8, "GPT-NeoX")
    assert _rotary({"rope_parameters": {"partial_rotary_factor": 1.0}}, 8, "GPT-NeoX") == (10000.0, 8)


def _indexed(tmp_path, weight_map_file, *, metadata=None):
    """A Hugging Face GPT-2 folder whose index names its one shard as ``weight_map_file``."""
    folder = _hf_gpt2_folder(tmp_path / "hf")
    names = list(io.read_header(folder / "model.safetensors")[0])
    index = {"weight_map": dict.fromkeys(names, weight_map_file)}
    if metadata is not None:
        index["metadata"] = metadata
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_a_shard_name_with_a_nul_byte_is_refused_by_name(tmp_path, capsys):
    folder = _indexed(tmp_path, "a\u0000.safetensors")
    refused(capsys, tmp_path, folder, naming=("a\\x00.safetensors", "not a file name"))
    refused(capsys, tmp_path, folder, tmp_path / "out", naming=("not a file name",), command="process")


@pytest.mark.parametrize("metadata", [[], 0, "", False])
def test_index_metadata_that_is_no_object_is_refused(tmp_path, capsys, metadata):
    folder = _indexed(tmp_path, "model.safetensors", metadata=metadata)
    refused(capsys, tmp_path, folder, naming=("model.safetensors.index.json", "'metadata' is not an object"))


def test_shards_in_a_folder_below_the_index_are_read_and_escapes_refused(tmp_path, capsys):
    """transformers joins the index's names to the folder: a shard in a subfolder is valid; a
    name that climbs out or is absolute is not."""
    import shutil

    folder = _indexed(tmp_path, "sub/model-1.safetensors")
    flat = tmp_path / "flat"
    shutil.copytree(folder, flat)
    (flat / "model.safetensors.index.json").unlink()
    (folder / "sub").mkdir()
    (folder / "model.safetensors").rename(folder / "sub" / "model-1.safetensors")
    io.process_checkpoint(folder, tmp_path / "out")
    io.process_checkpoint(flat, tmp_path / "out_flat")
    ours, _ = io.open_checkpoint(tmp_path / "out").load()
    theirs, _ = io.open_checkpoint(tmp_path / "out_flat").load()
    assert same(ours, theirs)
    for escape in ("../model.safetensors", "/tmp/model.safetensors", "sub/../model.safetensors", "sub//m.safetensors"):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": escape}}))
        refused(capsys, tmp_path, folder, naming=(escape, "not the name of a .safetensors file"))


@pytest.mark.parametrize("metadata", [[], 0, "", False, ["a"]])
def test_safetensors_metadata_that_is_no_mapping_is_refused(tmp_path, capsys, metadata):
    path = _with_header(model_file(tmp_path), lambda header, _: header.update(__metadata__=metadata))
    refused(capsys, tmp_path, path, naming=(path, "__metadata__"))


def test_a_dimension_of_2_to_the_63_is_refused_by_name(tmp_path, capsys):
    def zero_sized(header, end):
        header["z"] = {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [end, end]}

    path = _with_header(model_file(tmp_path), zero_sized)
    refused(capsys, tmp_path, path, naming=(path, "'z'", "below 2**63"))
    refused(capsys, tmp_path, path, tmp_path / "out", naming=(path, "'z'"), command="process")


def test_save_to_a_missing_folder_or_under_a_file_is_an_input_error(tmp_path):
    (tmp_path / "file").write_text("")
    for where in (tmp_path / "missing" / "m.safetensors", tmp_path / "file" / "m.safetensors"):
        with pytest.raises(cm.InputError, match="no such folder to write m.safetensors in"):
            io.save(where, cm.random_state_dict(CFG, seed=0), CFG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_full_disk_while_a_shard_is_written_exits_2_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """The shards are written to /dev/full, which answers every write with ENOSPC."""
    import builtins

    from circuitmath import _checkpoint

    path = model_file(tmp_path)
    def opened(name, mode="r", *args, **kwargs):
        return builtins.open("/dev/full" if "w" in mode else name, mode, *args, **kwargs)

    monkeypatch.setattr(_checkpoint, "open", opened, raising=False)
    refused(capsys, tmp_path, path, tmp_path / "out", naming=(tmp_path / "out", "No space left on device"),
            command="process")
