"""``python -m circuitmath check``: the table, JSON, exit codes, progress line and bad input."""

import io as text_io
import json
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import save_file

import circuitmath as cm
from circuitmath import _cli, io

F64 = torch.float64
CFG = cm.Config(n_layers=2, d_model=6, n_heads=2, d_head=3, d_vocab=9, n_ctx=5, d_mlp=12)
JSON_KEYS = {"name", "kind", "applicable", "reason", "rewrite", "max_abs_error", "tolerance", "status", "parameters"}


@pytest.fixture
def files(tmp_path):
    """A model, a correct processing of it and a wrong one (unembed centered over d_model)."""
    model = cm.random_state_dict(CFG, seed=0, dtype=F64)
    good, good_cfg = cm.process_weights(model, CFG)
    wrong = dict(model, **{"unembed.W_U": model["unembed.W_U"] - model["unembed.W_U"].mean(0, keepdim=True)})
    paths = {name: tmp_path / f"{name}.safetensors" for name in ("model", "good", "wrong")}
    io.save(paths["model"], model, CFG)
    io.save(paths["good"], good, good_cfg)
    io.save(paths["wrong"], wrong, CFG)
    return paths


def _run(capsys, *args):
    status = _cli.main(["check", *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


def test_one_model_every_identity_applies_or_says_why_not(files, capsys):
    status, out, err = _run(capsys, files["model"])
    assert status == 0 and not err
    header = out.splitlines()[0].split()
    assert header[:2] == ["identity", "applicable"] and "tolerance" in header and header[-1] == "status"
    rows = {line.split()[0]: line for line in out.splitlines()[2:] if line.strip()}
    assert "holds" in rows["fold_layer_norm"] and "not applicable" in rows["fold_rms_norm"]
    # what it needs, then what the model has instead
    assert "no: needs normalization_type is RMS; this model: normalization_type is 'LN'" in rows["fold_rms_norm"]


def test_one_model_as_json(files, capsys):
    status, out, _ = _run(capsys, files["model"], "--json")
    rows = json.loads(out)
    assert status == 0 and rows and all(JSON_KEYS <= row.keys() for row in rows)
    by_name = {row["name"]: row for row in rows}
    fold = by_name["fold_layer_norm"]
    assert fold["applicable"] is True and fold["status"] == "holds" and 0 <= fold["max_abs_error"] <= fold["tolerance"]
    assert by_name["rescale_residual_stream"]["applicable"] is False and "eps" in by_name["rescale_residual_stream"]["reason"]


def test_a_valid_processing_exits_0(files, capsys):
    status, out, _ = _run(capsys, files["model"], "--processed", files["good"])
    assert status == 0
    assert "before and after agree" in out and "center_reading_weights" in out and "VIOLATED" not in out


def test_a_wrong_processing_exits_1_naming_identity_and_parameter(files, capsys):
    status, out, _ = _run(capsys, files["model"], "--processed", files["wrong"])
    assert status == 1
    assert "center_unembed.over_d_model" in out and "unembed.W_U" in out and "violated" in out
    status, out, _ = _run(capsys, files["model"], "--processed", files["wrong"], "--json")
    rows = json.loads(out)
    assert status == 1 and [r["kind"] for r in rows] == ["identity", "residual", "equivalence"]
    assert rows[0]["status"] == "violated" and rows[0]["max_abs_error"] > rows[0]["tolerance"]
    assert rows[0]["parameters"][0]["name"] == "unembed.W_U"


def _counting(monkeypatch):
    """Count file loads (per path) and state-dict validations (per state dict object)."""
    from circuitmath import _state

    loads, validations, alive = {}, {}, []
    real_load, real_validate = io.load_tensors, _state._validate

    def load(path):
        loads[str(path)] = loads.get(str(path), 0) + 1
        return real_load(path)

    def validate(state_dict, cfg, **kwargs):
        alive.append(state_dict)  # keeps each id unique while counting
        validations[id(state_dict)] = validations.get(id(state_dict), 0) + 1
        return real_validate(state_dict, cfg, **kwargs)

    monkeypatch.setattr(io, "load_tensors", load)
    monkeypatch.setattr(_state, "_validate", validate)
    return loads, validations


@pytest.mark.parametrize("other", ["good", "wrong"])
def test_check_processed_reads_each_file_once_and_validates_each_state_dict_once(files, capsys, monkeypatch, other):
    loads, validations = _counting(monkeypatch)
    status, out, _ = _run(capsys, files["model"], "--processed", files[other])
    assert status == (0 if other == "good" else 1), out
    assert loads == {str(files["model"]): 1, str(files[other]): 1}
    assert validations and max(validations.values()) == 1, sorted(validations.values())


def test_the_counts_can_fail(files, capsys, monkeypatch):
    """Where a validated state dict is not trusted as one, the model is validated again (by the
    rounding sensitivity, which a failing check measures; a passing one needs only the a-priori term)."""
    from circuitmath import _state

    loads, validations = _counting(monkeypatch)
    monkeypatch.setattr(_state.Validated, "holds_for", lambda self, cfg: False)
    _run(capsys, files["model"], "--processed", files["wrong"])
    assert max(validations.values()) > 1
    io.load_tensors(files["model"])
    assert loads[str(files["model"])] == 2


def test_exit_codes_through_python_dash_m(files):
    done = subprocess.run([sys.executable, "-m", "circuitmath", "check", str(files["model"]), "--processed",
                           str(files["wrong"]), "--json"], capture_output=True, text=True)
    assert done.returncode == 1 and json.loads(done.stdout)[-1]["name"] == "before -> after"


def test_config_json_for_a_plain_safetensors_file(tmp_path, capsys):
    model = cm.random_state_dict(CFG, seed=0, dtype=F64)
    save_file(model, str(tmp_path / "plain.safetensors"))
    (tmp_path / "cfg.json").write_text(CFG.to_json())
    status, out, _ = _run(capsys, tmp_path / "plain.safetensors", "--config", tmp_path / "cfg.json", "--batch", "2",
                          "--seq-len", "3")
    assert status == 0 and "fold_layer_norm" in out


def test_hugging_face_config_and_weights(tmp_path, capsys):
    config = transformers.GPT2Config(vocab_size=16, n_positions=6, n_embd=8, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(tmp_path / "gpt2.safetensors"))
    (tmp_path / "config.json").write_text(config.to_json_string())
    status, out, err = _run(capsys, tmp_path / "gpt2.safetensors", "--config", tmp_path / "config.json", "--json")
    assert status == 0, err
    assert {row["name"] for row in json.loads(out)} >= {"fold_layer_norm", "center_unembed"}


def test_progress_line_on_a_terminal_only(files, capsys, monkeypatch):
    class Terminal(text_io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(_cli, "PROGRESS_DELAY", 0.0)
    for extra, shown in (([], True), (["--json"], False)):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert _cli.main(["check", str(files["model"]), "--processed", str(files["good"]), *extra]) == 0
        written = terminal.getvalue()
        assert ("check [" in written) is shown, written
        if shown:
            assert written.endswith("\r") and "forward pass" in written  # the line is cleared at the end
    assert "check [" not in capsys.readouterr().err  # not a terminal: no progress line


# -- bad input: a clear error, exit 2, nothing on stdout, no file written --------------------------


def _broken_file(tmp_path, change):
    model = {k: v.clone() for k, v in cm.random_state_dict(CFG, seed=0, dtype=F64).items()}
    change(model)
    save_file(model, str(tmp_path / "broken.safetensors"))
    (tmp_path / "cfg.json").write_text(CFG.to_json())
    return [tmp_path / "broken.safetensors", "--config", tmp_path / "cfg.json"]


def _nan(model):
    model["blocks.1.mlp.b_in"][3] = float("nan")


def _inf(model):
    model["embed.W_E"][2, 1] = float("-inf")


BAD_INPUTS = {
    "missing key": (lambda tmp: _broken_file(tmp, lambda m: m.pop("blocks.0.attn.W_K")), "missing keys"),
    "wrong shape": (lambda tmp: _broken_file(tmp, lambda m: m.update({"unembed.W_U": torch.zeros(6, 10, dtype=F64)})),
                    "has shape"),
    "nan": (lambda tmp: _broken_file(tmp, _nan), "NaN or Inf"),
    "inf": (lambda tmp: _broken_file(tmp, _inf), "NaN or Inf"),
    "config does not match": (
        lambda tmp: _broken_file(tmp, lambda m: None)[:2] + [_write(tmp / "other.json", CFG.replace(n_layers=3).to_json())],
        "missing keys",
    ),
    "pickle": (lambda tmp: [_pickle(tmp)], "never unpickles"),
    "no such file": (lambda tmp: [tmp / "absent.safetensors"], "no such file"),
    "no config": (lambda tmp: _broken_file(tmp, lambda m: None)[:1], "pass its config"),
    "config not JSON": (lambda tmp: _broken_file(tmp, lambda m: None)[:2] + [_write(tmp / "bad.json", "{nope")],
                        "not JSON"),
    "unknown config key": (
        lambda tmp: _broken_file(tmp, lambda m: None)[:2] + [_write(tmp / "bad.json", '{"n_layerz": 2}')],
        "unknown keys",
    ),
    "processed is broken": (
        lambda tmp: [_write_model(tmp), "--processed"] + _broken_file(tmp, _nan)[:1], "NaN or Inf",
    ),
    "not safetensors": (lambda tmp: [_write(tmp / "junk.safetensors", "plain text, no header")],
                        "not a safetensors file"),
}


if not torch.cuda.is_available():
    BAD_INPUTS["cuda without a GPU"] = (lambda tmp: [_write_model(tmp), "--device", "cuda"], "--device cuda")
BAD_INPUTS["unknown device"] = (lambda tmp: [_write_model(tmp), "--device", "nonsense:0"], "--device nonsense:0")
BAD_INPUTS["a device torch cannot import"] = (lambda tmp: [_write_model(tmp), "--device", "hpu"], "--device hpu")
BAD_INPUTS["meta device"] = (lambda tmp: [_write_model(tmp), "--device", "meta"], "holds no values")
BAD_INPUTS["--exact with --processed"] = (
    lambda tmp: [_write_model(tmp), "--processed", tmp / "absent.safetensors", "--exact"], "--exact is for check MODEL")
# the device is refused before any file is read: the missing file is not what is reported
BAD_INPUTS["device before files"] = (lambda tmp: [tmp / "absent.safetensors", "--device", "nonsense"], "--device nonsense")


def _write(path, text):
    path.write_text(text)
    return path


def _pickle(tmp):
    torch.save(cm.random_state_dict(CFG, seed=0), tmp / "model.pt")
    return tmp / "model.pt"


def _write_model(tmp):
    io.save(tmp / "model.safetensors", cm.random_state_dict(CFG, seed=0, dtype=F64), CFG)
    return tmp / "model.safetensors"


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_a_clear_error_and_writes_nothing(case, tmp_path, capsys):
    build, message = BAD_INPUTS[case]
    args = build(tmp_path)
    before = sorted(tmp_path.iterdir())
    status, out, err = _run(capsys, *args)
    assert status == 2, (out, err)
    assert out == "" and err.startswith("error: ") and message in err, err
    assert sorted(tmp_path.iterdir()) == before


def _three_paths(files, tmp_path, capsys):
    """The argument lists of check's three paths: one model, a processed file, a processed
    checkpoint folder (read a block at a time); what ``process`` printed is read out."""
    assert _cli.main(["process", str(files["model"]), str(tmp_path / "folder")]) == 0
    capsys.readouterr()
    return {
        "model": [files["model"]],
        "processed file": [files["model"], "--processed", files["wrong"]],
        "processed folder": [files["model"], "--processed", tmp_path / "folder"],
    }


def test_device_cpu_gives_what_the_default_gives(files, tmp_path, capsys):
    paths = _three_paths(files, tmp_path, capsys)
    for name, args in paths.items():
        default = _run(capsys, *args, "--json")
        on_cpu = _run(capsys, *args, "--json", "--device", "cpu")
        assert default == on_cpu and default[0] == (1 if name == "processed file" else 0), name


def test_the_device_reaches_every_path(files, tmp_path, capsys, monkeypatch):
    """Negative control for the plumbing: with the option's validation patched to let ``meta``
    (a device whose tensors hold no values) through, every path stops at the first tensor it
    checks or computes with, so each one works on the device it is given, not on the CPU the
    files are read onto."""
    paths = _three_paths(files, tmp_path, capsys)
    monkeypatch.setattr(_cli, "usable_device", lambda text, option: torch.device(text or "cpu"))
    for name, args in paths.items():
        assert _run(capsys, *args, "--device", "cpu")[0] in (0, 1), name
        try:
            status, _out, err = _run(capsys, *args, "--device", "meta")
        except (NotImplementedError, RuntimeError) as error:  # a computation met a meta tensor
            status, err = None, str(error)
        assert status in (None, 2) and "meta" in err, (name, status, err[:300])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_cuda_gives_the_same_verdicts(files, tmp_path, capsys):
    for name, args in _three_paths(files, tmp_path, capsys).items():
        status, out, _ = _run(capsys, *args, "--json")
        on_gpu, gpu_out, _ = _run(capsys, *args, "--json", "--device", "cuda")
        rows, gpu_rows = json.loads(out), json.loads(gpu_out)
        assert on_gpu == status and [r["status"] for r in gpu_rows] == [r["status"] for r in rows], name


@pytest.mark.parametrize("flags, exact", [([], False), (["--exact"], True)])
def test_a_folder_is_checked_in_float64_too_with_exact(flags, exact, tmp_path, capsys, monkeypatch):
    """``check FOLDER --exact`` asks the streamed check for the float64 checks (a file always
    gets them); without it, not. Both hold on a valid bfloat16 model."""
    from circuitmath import _streaming_check_model

    asked, streamed = [], _streaming_check_model.check_model_streaming
    monkeypatch.setattr(_streaming_check_model, "check_model_streaming",
                        lambda *a, **k: asked.append(k["exact"]) or streamed(*a, **k))
    io.save(tmp_path / "m.safetensors", cm.random_state_dict(CFG, seed=0, dtype=torch.bfloat16), CFG)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "folder", steps=[])
    status, out, err = _run(capsys, tmp_path / "folder", "--batch", "1", "--seq-len", "4", *flags)
    assert status == 0 and asked == [exact], (out, err)
