"""Checkpoints processed and checked a layer at a time (circuitmath._checkpoint, circuitmath._streaming_process):
small sharded checkpoints built here, the streaming output equal to the in-memory transform
tensor for tensor, streaming checks agreeing with the in-memory ones, and bad or interrupted
runs leaving nothing behind."""

import json
import re
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch
import transformers
from safetensors.torch import save_file

import circuitmath as cm
from circuitmath import _cli, _streaming_check_model as streaming_model, io
from circuitmath import _diagnosis as diagnosis_module
from circuitmath._checkpoint import INDEX, Checkpoint, CheckpointWriter
from circuitmath._hf import hf_layout
from circuitmath._processing.norms import WRITES_CENTERED
from circuitmath._processing.steps import STEPS
from circuitmath._stored import LAYOUT_KEY, writing_steps
from circuitmath._streaming_parts import find_untouched
from circuitmath._processing._memory import in_memory as streaming_in_memory
from circuitmath._streaming_check_processed import check_processed
from circuitmath._streaming_check_model import check_model_streaming
from circuitmath.testing import NotEquivalentError, assert_equivalent, compare_log_probs
from support import Identity, same_rows, with_identities

VOCAB, CTX = 64, 12
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
HF = {
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=CTX, n_embd=24, n_layer=3, n_head=3, bos_token_id=0, eos_token_id=0)),
    "neox-parallel-partial-rotary": (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
        vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=24, num_hidden_layers=3, num_attention_heads=3,
        intermediate_size=40, use_parallel_residual=True, rope_parameters=ROPE | {"partial_rotary_factor": 0.5},
        bos_token_id=0, eos_token_id=0)),
    "llama-gqa": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, rope_parameters=ROPE, bos_token_id=0, eos_token_id=0,
        pad_token_id=None)),
    "llama-attention-bias": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, attention_bias=True, rope_parameters=ROPE, bos_token_id=0, eos_token_id=0,
        pad_token_id=None)),
}
EVERYTHING = dict.fromkeys(STEPS)
TOKENS = torch.randint(0, VOCAB, (2, CTX), generator=torch.Generator().manual_seed(0))


def _hf_folder(tmp_path, name: str, dtype: torch.dtype = torch.float32, spec=None):
    """A Hugging Face folder of ``name`` (``spec``: its model class and config, by default
    ``HF[name]``) with random weights of unit scale, in several shards."""
    model_class, config = spec or HF[name]
    torch.manual_seed(0)
    model = model_class(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            value = torch.randn(param.shape, generator=g)
            if param.ndim == 1:
                value = torch.exp(0.3 * value) if param_name.endswith("weight") else 0.5 * value
            else:
                value = value * param.shape[-1] ** -0.5
            param.copy_(value)
    folder = tmp_path / name
    model.to(dtype).save_pretrained(folder, max_shard_size="8KB")
    return folder


def _shards(folder) -> set[str]:
    return set(json.loads((folder / INDEX).read_text())["weight_map"].values())


def _left_behind(tmp_path, name="out") -> list:
    return sorted(p.name for p in tmp_path.iterdir() if name in p.name)


def _in_memory(folder, out, state_dict, cfg):
    """The in-memory transform that the processing of ``folder`` into ``out`` with every step that
    applies equals: process_weights', or, where ``out`` kept the architecture's layout by keeping
    the final norm's bias (GPT-NeoX; a tied GPT-2 cannot), the writer's steps on the whole model
    (``_stored.writing_steps``)."""
    steps = writing_steps(io.open_checkpoint(folder).stored(None), cfg, EVERYTHING)
    if isinstance(steps, dict) or LAYOUT_KEY not in json.loads((out / INDEX).read_text())["metadata"]:
        return cm.process_weights(state_dict, cfg, **EVERYTHING)
    return steps(state_dict, cfg)


def _equal(got, expected) -> bool:
    """Bit for bit; but a b_U read back as a kept final norm's bias through W_U (summed in float64
    and rounded once, as the fold rounds it) to a few units of rounding of its largest entry."""
    for k in expected:
        if k == "unembed.b_U" and not torch.equal(got[k], expected[k]):
            bound = 4 * torch.finfo(expected[k].dtype).eps * expected[k].double().abs().max()
            if not bool(((got[k].double() - expected[k].double()).abs() <= bound).all()):
                return False
        elif got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k]):
            return False
    return True


@pytest.mark.parametrize("name", sorted(HF))
def test_streaming_process_equals_the_in_memory_transform(tmp_path, name):
    folder = _hf_folder(tmp_path, name)
    assert len(_shards(folder)) >= 3
    state_dict, cfg = io.load_hf_directory(folder)  # the shards read whole, through the same converter
    out_cfg = io.process_checkpoint(folder, tmp_path / "out", steps="applicable")
    expected, expected_cfg = _in_memory(folder, tmp_path / "out", state_dict, cfg)
    assert len(_shards(tmp_path / "out")) == cfg.n_layers + 1
    got, got_cfg = io.open_checkpoint(tmp_path / "out").load()
    assert out_cfg == got_cfg == expected_cfg
    assert got.keys() == expected.keys()
    assert _equal(got, expected)


@pytest.mark.parametrize("name", sorted(HF))
def test_half_precision_folders_stream_bit_for_bit(tmp_path, name):
    """bfloat16 Hugging Face folders: the streaming path transposes each stored matrix in
    bfloat16, and writes the tensors the processing passes through (W_O, W_out, W_E for LLaMA)
    as stored; the result is still the in-memory transform's, bit for bit."""
    folder = _hf_folder(tmp_path, name, torch.bfloat16)
    state_dict, cfg = io.load_hf_directory(folder)
    assert next(iter(state_dict.values())).dtype == torch.bfloat16
    io.process_checkpoint(folder, tmp_path / "out", steps="applicable")
    expected, expected_cfg = _in_memory(folder, tmp_path / "out", state_dict, cfg)
    got, got_cfg = io.open_checkpoint(tmp_path / "out").load()
    assert got_cfg == expected_cfg and got.keys() == expected.keys()
    assert all(got[k].dtype == torch.bfloat16 for k in expected) and _equal(got, expected)


def _mapped_llama(tmp_path):
    """A bfloat16 LLaMA folder of 4 layers whose gate and up maps, rewritten in every block, are
    large enough to be mapped ([1024, 2048], :data:`HUGE_PAGE_MIN_BYTES`)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=2048, rope_parameters=ROPE, bos_token_id=0, eos_token_id=0,
        pad_token_id=None)
    return _hf_folder(tmp_path, "llama-mapped", torch.bfloat16, spec=(transformers.LlamaForCausalLM, config))


@pytest.mark.parametrize("reuse", ["unused", "in use"], ids=["recycled", "control"])
def test_blocks_reuse_the_maps_of_blocks_written_and_nothing_in_use(tmp_path, monkeypatch, reuse):
    """The blocks' new tensors take the memory of those already written (recycled maps): the
    output is still the in-memory transform's, bit for bit. Control: a recycler that hands out
    maps still in use (a block's own W_gate for its W_in) writes another model, and the same
    comparison says so.

    The writing thread is held after each part, between handing in its result and dropping its
    work item, as a busy machine may hold it: the count of maps recycled must not depend on
    that schedule (nothing the pool keeps may refer to a written part's tensors)."""
    from concurrent.futures import thread

    from circuitmath._processing import _memory

    finish = thread._WorkItem.run

    def held(item):
        finish(item)
        time.sleep(0.25)

    monkeypatch.setattr(thread._WorkItem, "run", held)

    folder = _mapped_llama(tmp_path)
    state_dict, cfg = io.load_hf_directory(folder)
    expected, _ = cm.process_weights(state_dict, cfg, **EVERYTHING)
    assert expected["blocks.0.mlp.W_in"].nbytes >= _memory.HUGE_PAGE_MIN_BYTES
    reused, found = [], _memory._reused

    def spied(size):
        maps = _memory._RECYCLED.get()
        buffer = found(size) if reuse == "unused" else next((b for b in maps or () if len(b) == size), None)
        reused.append(buffer is not None)
        return buffer

    monkeypatch.setattr(_memory, "_reused", spied)
    io.process_checkpoint(folder, tmp_path / "out", steps="applicable")
    got, _ = io.open_checkpoint(tmp_path / "out").load()
    assert sum(reused) >= 2 * (cfg.n_layers - 2)  # gate and up of each block after the first two at least
    same = all(torch.equal(got[k], expected[k]) for k in expected)
    assert same == (reuse == "unused")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untouched_tensors_are_found_on_a_small_model(dtype):
    """What process_checkpoint writes unconverted: for LLaMA, W_O comes back as it went in but
    b_O is computed from it (fold_value_biases), so it is read; W_out and W_E are neither
    rewritten nor read (in bfloat16 too: its fused steps, all that apply, run in bfloat16).
    GPT-2's fused steps rewrite every tensor; in bfloat16 its refactor casts the blocks to float32."""
    _, llama = HF["llama-gqa"]
    cfg = hf_layout(llama.to_dict()).cfg
    block, ends = (find_untouched(cfg, EVERYTHING, layer, dtype) for layer in (0, None))
    assert "blocks.0.attn.W_O" in block.kept and "blocks.0.attn.W_O" not in block.unread
    assert {"blocks.0.mlp.W_out", "blocks.0.mlp.b_out"} <= block.unread
    assert not {"blocks.0.attn.W_Q", "blocks.0.mlp.W_in", "blocks.0.mlp.W_gate", "blocks.0.attn.b_O"} & block.kept
    assert ends.unread == {"embed.W_E"}
    _, gpt2 = HF["gpt2"]
    cfg = hf_layout(gpt2.to_dict()).cfg
    assert find_untouched(cfg, EVERYTHING, 0, dtype).kept == find_untouched(cfg, EVERYTHING, None, dtype).kept == frozenset()


@pytest.mark.parametrize("cfg", [
    cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16),
    cm.Config(n_layers=2, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5,
              positional_embedding_type="shortformer"),
    cm.Config(n_layers=2, d_model=8, n_heads=4, d_head=2, d_vocab=11, n_ctx=5, d_mlp=16, normalization_type="RMS",
              gated_mlp=True, n_key_value_heads=2, act_fn="silu"),
], ids=["pre-ln", "shortformer", "rms-gqa-gated"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_circuitmath_files_stream_too(tmp_path, cfg, dtype):
    state_dict = cm.random_state_dict(cfg, seed=0, dtype=dtype)
    io.save(tmp_path / "m.safetensors", state_dict, cfg)
    expected, expected_cfg = cm.process_weights(state_dict, cfg, **EVERYTHING)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "out", steps="applicable")
    got, got_cfg = io.open_checkpoint(tmp_path / "out").load()
    assert got_cfg == expected_cfg and got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_dtype_option_processes_in_that_dtype(tmp_path):
    folder = _hf_folder(tmp_path, "llama-gqa")  # its own layout read back is process_weights' output, bit for bit
    state_dict, cfg = io.load_hf_directory(folder)
    expected, _ = cm.process_weights({k: v.double() for k, v in state_dict.items()}, cfg)
    io.process_checkpoint(folder, tmp_path / "out", dtype=torch.float64)
    got, _ = io.open_checkpoint(tmp_path / "out").load()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_opening_reads_headers_only_and_tensors_are_memory_mapped(tmp_path):
    folder = _hf_folder(tmp_path, "llama-gqa")
    checkpoint = io.open_checkpoint(folder)
    weight = checkpoint.block(1)["blocks.1.mlp.W_in"]  # up_proj.weight transposed: a view of the map
    assert not weight.is_contiguous()
    shard = folder / json.loads((folder / INDEX).read_text())["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    file_bytes = shard.read_bytes()
    assert weight.T.contiguous().numpy().tobytes() in file_bytes


def _corrupt(folder, tensor: str, value: float) -> None:
    """Set one entry of ``tensor`` in its shard to ``value``, the header left as it is."""
    shard = folder / json.loads((folder / INDEX).read_text())["weight_map"][tensor]
    tensors, metadata = io.load_tensors(shard)
    tensors[tensor] = tensors[tensor].clone()
    tensors[tensor].view(-1)[3] = value
    save_file(tensors, str(shard), metadata=metadata)


def test_a_nan_in_a_late_layer_is_named_and_nothing_is_written(tmp_path):
    folder = _hf_folder(tmp_path, "gpt2")
    _corrupt(folder, "transformer.h.2.mlp.c_fc.weight", float("nan"))
    with pytest.raises(cm.StateDictError, match=r"gpt2: .*blocks\.2\.mlp\.W_in has 1 NaN"):
        io.process_checkpoint(folder, tmp_path / "out")
    assert _left_behind(tmp_path) == []


def test_a_nan_in_an_unread_tensor_is_named_and_nothing_is_written(tmp_path):
    folder = _hf_folder(tmp_path, "llama-gqa", torch.bfloat16)
    _corrupt(folder, "model.layers.1.mlp.down_proj.weight", float("nan"))  # W_out: written unconverted
    with pytest.raises(cm.StateDictError, match=r"llama-gqa: .*blocks\.1\.mlp\.W_out has 1 NaN"):
        io.process_checkpoint(folder, tmp_path / "out", steps="applicable")
    assert _left_behind(tmp_path) == []


def test_refusals_are_the_in_memory_transforms(tmp_path):
    folder = _hf_folder(tmp_path, "llama-gqa")
    state_dict, cfg = io.load_hf_directory(folder)
    asked = ["fold_ln", "fold_value_biases", "center_writing_weights", "center_unembed"]
    with pytest.raises(cm.PreconditionError) as in_memory:  # centering the writers behind an RMSNorm, asked for
        cm.process_weights(state_dict, cfg, **dict.fromkeys(asked, True))
    with pytest.raises(cm.PreconditionError) as streamed:
        io.process_checkpoint(folder, tmp_path / "out", steps=asked)
    assert str(streamed.value) == str(in_memory.value)
    assert _left_behind(tmp_path) == []


def test_an_interrupted_run_leaves_nothing(tmp_path):
    folder = _hf_folder(tmp_path, "gpt2")

    def interrupt(done, total, what):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        io.process_checkpoint(folder, tmp_path / "out", progress=interrupt)
    assert _left_behind(tmp_path) == []


def _wrong_processing(tmp_path, folder):
    """``process_weights`` of ``folder`` with layer 1's ln1 gain folded into W_Q twice, written
    as a processed checkpoint."""
    state_dict, cfg = io.load_hf_directory(folder)
    right, right_cfg = cm.process_weights(state_dict, cfg, **EVERYTHING)
    wrong = dict(right, **{"blocks.1.attn.W_Q": right["blocks.1.attn.W_Q"] * state_dict["blocks.1.ln1.w"][:, None]})
    with CheckpointWriter(tmp_path / "wrong", 1) as out:
        out.write(wrong, right_cfg)
    return state_dict, cfg, wrong, right_cfg


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_assert_equivalent_takes_checkpoint_folders(tmp_path, name):
    """``assert_equivalent`` on two folders checks them a block at a time, as ``check --processed``
    does: it passes the streaming processing, and in bfloat16 it fails a 1 % change of one
    tensor (the tensor certificate), which the log-prob tolerance alone lets through."""
    folder = _hf_folder(tmp_path, name)
    io.process_checkpoint(folder, tmp_path / "out", steps="applicable", dtype=torch.bfloat16)
    half = tmp_path / "half"
    io.process_checkpoint(folder, half, steps=[], dtype=torch.bfloat16)  # the original, cast to bfloat16
    result = assert_equivalent(half, tmp_path / "out", tokens=TOKENS)
    assert result.passed and len(result.where) == 3
    processed, processed_cfg = io.open_checkpoint(tmp_path / "out").load()
    name_changed = "blocks.1.mlp.W_in"
    changed = dict(processed, **{name_changed: (processed[name_changed].float() * 1.01).to(torch.bfloat16)})
    with CheckpointWriter(tmp_path / "changed", 1) as out:
        out.write(changed, processed_cfg)
    with pytest.raises(NotEquivalentError) as failed:
        assert_equivalent(half, tmp_path / "changed", tokens=TOKENS)
    assert failed.value.comparison.passed  # the log-probs alone agree...
    assert name_changed in str(failed.value)  # ...the certificate names the tensor


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_streaming_check_agrees_with_the_in_memory_check(tmp_path, name):
    folder = _hf_folder(tmp_path, name)
    io.process_checkpoint(folder, tmp_path / "out", steps="applicable")
    state_dict, cfg = io.load_hf_directory(folder)
    processed, processed_cfg = io.open_checkpoint(tmp_path / "out").load()
    in_memory = compare_log_probs(state_dict, cfg, processed, processed_cfg, TOKENS)
    report = check_processed(folder, tmp_path / "out", tokens=TOKENS)
    log_probs, tensors = report.rows
    assert report.ok and in_memory.passed
    assert log_probs["max_abs_error"] == pytest.approx(in_memory.max_abs_error, rel=1e-3, abs=1e-7)
    assert in_memory.tolerance / 3 < log_probs["tolerance"] < 3 * in_memory.tolerance
    assert tensors["status"] == "holds" and "bit for bit" in tensors["explanation"]
    # negative twin: layer 1's ln1 gain folded into W_Q twice (only that tensor differs)
    _state, _cfg, wrong, wrong_cfg = _wrong_processing(tmp_path, folder)
    in_memory = compare_log_probs(state_dict, cfg, wrong, wrong_cfg, TOKENS)
    report = check_processed(folder, tmp_path / "wrong", tokens=TOKENS)
    log_probs, tensors = report.rows
    assert not report.ok and not in_memory.passed
    assert log_probs["status"] == "violated" and log_probs["max_abs_error"] == pytest.approx(in_memory.max_abs_error, rel=1e-3)
    assert tensors["status"] == "violated" and "blocks.1.attn.W_Q" in tensors["explanation"]
    assert "blocks.0." not in tensors["explanation"] and "blocks.2." not in tensors["explanation"]


def test_tensors_off_the_rounding_are_certified_entry_by_entry(tmp_path):
    """A processed tensor equal to the rounded rewrite passes without a certificate (the
    rounding puts it within half a unit); one rounded otherwise (toward zero: within a unit) is
    certified entry by entry and passes, and one moved a unit further fails."""
    folder = _hf_folder(tmp_path, "llama-gqa", torch.bfloat16)
    io.process_checkpoint(folder, tmp_path / "out", steps="applicable")
    state_dict, cfg = io.load_hf_directory(folder)
    exact, _ = cm.process_weights({k: v.float() for k, v in state_dict.items()}, cfg, **EVERYTHING)
    processed, processed_cfg = io.open_checkpoint(tmp_path / "out").load()
    name = "blocks.1.mlp.W_in"
    toward_zero = (exact[name].view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    further = (toward_zero.view(torch.int16) - 1).view(torch.bfloat16)  # one more unit toward zero
    assert not torch.equal(toward_zero, processed[name])
    for tensor, status in ((toward_zero, "holds"), (further, "violated")):
        folder_name = f"changed-{status}"
        with CheckpointWriter(tmp_path / folder_name, 1) as out:
            out.write(dict(processed, **{name: tensor}), processed_cfg)
        log_probs, tensors = check_processed(folder, tmp_path / folder_name, tokens=TOKENS).rows
        assert log_probs["status"] == "holds" and tensors["status"] == status
        assert ("1 certified entry by entry" if status == "holds" else name) in tensors["explanation"]


def test_check_command_streams_checkpoint_folders(tmp_path, capsys):
    folder = _hf_folder(tmp_path, "gpt2")
    assert _cli.main(["process", str(folder), str(tmp_path / "out")]) == 0
    assert "4 shards" in capsys.readouterr().out
    assert _cli.main(["check", str(folder), "--processed", str(tmp_path / "out"), "--batch", "2", "--seq-len", "8"]) == 0
    assert "log-probs  holds" in capsys.readouterr().out
    _wrong_processing(tmp_path, folder)
    assert _cli.main(["check", str(folder), "--processed", str(tmp_path / "wrong"), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"]) for r in rows] == [("log-probs", "violated"), ("tensors", "violated")]


def _index_naming(folder, file_name):
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = file_name
    (folder / INDEX).write_text(json.dumps(index))


BAD_INPUTS = {
    "no such input": (lambda tmp, folder: [str(tmp / "absent"), str(tmp / "out")], "no such file"),
    "only a pickle": (
        lambda tmp, folder: [_pickle_folder(tmp), str(tmp / "out")], "pickled weights"),
    "output exists": (lambda tmp, folder: [str(folder), str(folder)], "exists"),
    "unknown step": (lambda tmp, folder: [str(folder), str(tmp / "out"), "--steps", "fold_ln,fold_everything"],
                     "unknown processing steps"),
    "step refused": (lambda tmp, folder: [str(folder), str(tmp / "out"), "--steps", "refactor_factored_attn_matrices"],
                     "keys and queries are not rotated"),
    "index points outside": (lambda tmp, folder: [_index_naming(folder, "../x.safetensors") or str(folder),
                                                  str(tmp / "out")], "not the name of a .safetensors file"),
    "index lists a tensor the shard lacks": (lambda tmp, folder: [_index_naming(folder, sorted(_shards(folder))[-1])
                                                                  or str(folder), str(tmp / "out")], "does not hold"),
    "nan in block 1": (lambda tmp, folder: [_corrupt(folder, "model.layers.1.self_attn.o_proj.weight", float("inf"))
                                            or str(folder), str(tmp / "out")], r"blocks\.1\.attn\.W_O has 1 NaN or Inf"),
    "unusable device": (lambda tmp, folder: [str(folder), str(tmp / "out"), "--device", "nonsense:0"],
                        "--device nonsense:0: not a device"),
    "a device torch cannot import": (lambda tmp, folder: [str(folder), str(tmp / "out"), "--device", "hpu"],
                                     "--device hpu: not a device"),
    "meta device": (lambda tmp, folder: [str(folder), str(tmp / "out"), "--device", "meta"],
                    "--device meta: .*holds no values"),
    "device before files": (lambda tmp, folder: [str(tmp / "absent"), str(tmp / "out"), "--device", "nonsense"],
                            "--device nonsense: not a device"),
    "bad shape": (lambda tmp, folder: [_reshaped_config(folder) or str(folder), str(tmp / "out")], "has shape"),
}


def _pickle_folder(tmp):
    (tmp / "pickled").mkdir()
    (tmp / "pickled" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    return str(tmp / "pickled")


def _reshaped_config(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 40}))


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_writing_nothing(tmp_path, capsys, case):
    arguments, message = BAD_INPUTS[case]
    folder = _hf_folder(tmp_path, "llama-gqa")
    argv = arguments(tmp_path, folder)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert _cli.main(["process", *argv, "--steps", "applicable"] if "--steps" not in argv else ["process", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' own progress bar
    assert err.startswith("error: ")
    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary left


def test_sharded_folders_load_whole_as_before(tmp_path):
    folder = _hf_folder(tmp_path, "neox-parallel-partial-rotary")
    merged = {}
    for shard in _shards(folder):
        merged |= io.load_tensors(folder / shard)[0]
    expected, expected_cfg = io.from_hf(merged, json.loads((folder / "config.json").read_text()))
    got, got_cfg = io.load_hf_directory(folder)
    assert got_cfg == expected_cfg and all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_terminated_process_command_leaves_nothing(tmp_path):
    # big enough (150 blocks, 60 MB) that the signal arrives while the output is being written
    cfg = cm.Config(n_layers=150, d_model=64, n_heads=4, d_head=16, d_vocab=11, n_ctx=5, d_mlp=256)
    io.save(tmp_path / "m.safetensors", cm.random_state_dict(cfg, seed=0), cfg)
    child = subprocess.Popen([sys.executable, "-m", "circuitmath", "process", str(tmp_path / "m.safetensors"),
                              str(tmp_path / "out")], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60

    def partial() -> list:
        return [name for name in _left_behind(tmp_path) if name.endswith(".partial")]

    while not partial() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert partial(), "the temporary output never appeared"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 130
    assert "not written" in child.stderr.read().decode()
    assert _left_behind(tmp_path) == []


@pytest.mark.parametrize("interrupted", [True, False], ids=["interrupted", "control"])
def test_an_interruption_just_after_the_temporary_folder_is_made_leaves_nothing(tmp_path, monkeypatch, interrupted):
    """The signal can land between the temporary folder's mkdir and the with block that would
    remove it (seen under load: a '.out.PID.partial' left by a terminated process): the writer
    removes it itself. Control: without the interruption the folder is made and written."""
    import pathlib

    made = pathlib.Path.mkdir

    def mkdir_then_signal(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if interrupted:
            raise KeyboardInterrupt

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir_then_signal)
    writer = CheckpointWriter(tmp_path / "out", 1)
    if interrupted:
        with pytest.raises(KeyboardInterrupt):
            writer.__enter__()
        assert _left_behind(tmp_path) == []
    else:
        assert writer.__enter__() is writer and _left_behind(tmp_path) == [writer.temporary.name]
        writer.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)  # inside the block: __exit__ removes it
        assert _left_behind(tmp_path) == []


# -- check MODEL on a checkpoint folder, streamed ------------------------------------------------

def _model_folder(tmp_path, name):
    """A sharded checkpoint folder of ``name`` and its model in memory ``(state_dict, cfg)``: the
    Hugging Face folders above, a circuitmath folder written by ``process`` (GPT-2, every step
    applied) and one of a shortformer model (written with no step, one shard per part)."""
    if name in HF:
        folder = _hf_folder(tmp_path, name)
        return folder, io.load_hf_directory(folder)
    if name == "gpt2-processed":
        io.process_checkpoint(_hf_folder(tmp_path, "gpt2"), tmp_path / name, steps="applicable")
    else:
        cfg = cm.Config(n_layers=3, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=6, d_mlp=16,
                        positional_embedding_type="shortformer")
        io.save(tmp_path / "m.safetensors", cm.random_state_dict(cfg, seed=0), cfg)
        io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / name, steps=[])
    assert len(_shards(tmp_path / name)) >= 4
    return tmp_path / name, io.open_checkpoint(tmp_path / name).load()


STREAMED_MODELS = sorted(HF) + ["gpt2-processed", "shortformer"]


@pytest.mark.parametrize("name", STREAMED_MODELS)
def test_check_model_streams_the_in_memory_rows(tmp_path, name):
    folder, (state_dict, cfg) = _model_folder(tmp_path, name)
    in_memory = diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS[:, :cfg.n_ctx] % cfg.d_vocab)
    streamed = check_model_streaming(folder, tokens=TOKENS[:, :cfg.n_ctx] % cfg.d_vocab)
    same_rows(streamed, in_memory, tolerances=0.2)
    assert streamed.ok and sum(f.status == "holds" for f in streamed.findings) >= 4
    assert any(f.status == "not applicable" for f in streamed.findings)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_check_model_streams_bfloat16_folders(tmp_path, name):
    """In bfloat16 each identity runs in the model's dtype on each part, as in memory on the
    whole model: the same rows, the same |Δ log-prob| (the tolerance, a nudged pass's sample,
    within 50 %)."""
    folder = _hf_folder(tmp_path, name, torch.bfloat16)
    state_dict, cfg = io.load_hf_directory(folder)
    in_memory = diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS)
    streamed = check_model_streaming(folder, tokens=TOKENS)
    same_rows(streamed, in_memory, tolerances=0.5)
    assert streamed.ok


def _lnpre_folder(tmp_path, offsets: dict[int, float], scale: dict[int, float] = {}):
    """A circuitmath folder of an ``LNPre`` model, every write centered, then block ``l``'s
    ``W_O`` shifted by ``offsets[l]`` (its mean over d_model) and its writers scaled by ``scale[l]``."""
    cfg = cm.Config(n_layers=4, d_model=16, n_heads=2, d_head=8, d_vocab=13, n_ctx=6, d_mlp=32,
                    normalization_type="LNPre")
    state_dict, cfg = cm.center_writing_weights(cm.random_state_dict(cfg, seed=0), cfg)
    for layer, factor in scale.items():
        for name in ("attn.W_O", "attn.b_O", "mlp.W_out", "mlp.b_out"):
            state_dict[f"blocks.{layer}.{name}"] = state_dict[f"blocks.{layer}.{name}"] * factor
    for layer, offset in offsets.items():
        state_dict[f"blocks.{layer}.attn.W_O"] = state_dict[f"blocks.{layer}.attn.W_O"] + offset
    io.save(tmp_path / "m.safetensors", state_dict, cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "lnpre", steps=[])
    return tmp_path / "lnpre", state_dict, cfg


TOKENS_13 = TOKENS[:, :6] % 13


def test_a_precondition_broken_in_one_layer_is_refused_as_in_memory(tmp_path, monkeypatch):
    """layer_norm_to_rms_norm without its preparation, on a model whose block 2 alone writes
    off-center: not applicable in both checks, naming that writer, with the same reason."""
    folder, state_dict, cfg = _lnpre_folder(tmp_path, {2: 0.1})
    with_identities(monkeypatch, Identity("layer_norm_to_rms_norm", cm.layer_norm_to_rms_norm),
                     Identity("fold_value_biases", cm.fold_value_biases))
    in_memory = diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS_13)
    streamed = check_model_streaming(folder, tokens=TOKENS_13)
    same_rows(streamed, in_memory, tolerances=0.2)
    refused, kept = streamed.findings
    assert refused.status == "not applicable" and "blocks.2.attn.W_O" in refused.reason
    assert refused.precondition == WRITES_CENTERED
    assert kept.status == "holds"


def test_the_centered_writes_are_decided_on_the_whole_model(tmp_path, monkeypatch):
    """Block 0's writes are off-center by 1e-4 (beyond rounding for its own largest entry, within
    it for block 3's, 100x larger): in memory the model writes centered, and so it does streamed,
    each part measured against the whole model's largest writer entry. Measured against each
    part's own (the recording pass skipped), block 0 would be refused."""
    folder, state_dict, cfg = _lnpre_folder(tmp_path, {0: 1e-4}, {3: 100.0})
    with_identities(monkeypatch, Identity("layer_norm_to_rms_norm", cm.layer_norm_to_rms_norm))
    in_memory = diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS_13)
    streamed = check_model_streaming(folder, tokens=TOKENS_13)
    same_rows(streamed, in_memory, tolerances=0.2)
    assert streamed.findings[0].applicable
    monkeypatch.setattr(streaming_model._ModelWriters, "__call__", lambda self, means, scale: (means, scale))
    per_part = check_model_streaming(folder, tokens=TOKENS_13).findings[0]
    assert per_part.status == "not applicable" and "blocks.0.attn.W_O" in per_part.reason


def test_a_wrong_transform_in_one_layer_is_violated(tmp_path, monkeypatch):
    """fold_layer_norm with one block's W_V scaled by 1.01 (the block recognised by its ln1
    gain, in the whole model as in a part): violated streamed as in memory (in float32 without
    the float64 check too)."""
    folder, (state_dict, cfg) = _model_folder(tmp_path, "gpt2")
    marker = state_dict["blocks.1.ln1.w"]

    def slightly_wrong(sd, c):
        out, out_cfg = cm.fold_layer_norm(sd, c)
        for layer in range(c.n_layers):
            if torch.equal(sd[f"blocks.{layer}.ln1.w"], marker):
                out[f"blocks.{layer}.attn.W_V"] = out[f"blocks.{layer}.attn.W_V"] * 1.01
        return out, out_cfg

    with_identities(monkeypatch, Identity("fold_layer_norm", cm.fold_layer_norm),
                     Identity("fold_layer_norm.wrong", slightly_wrong))
    in_memory = diagnosis_module.check_model(state_dict, cfg, tokens=TOKENS)
    streamed = check_model_streaming(folder, tokens=TOKENS, exact=True)  # float64 too, as in memory
    same_rows(streamed, in_memory, tolerances=0.2)
    assert [f.status for f in streamed.findings] == ["holds", "violated"] and not streamed.ok
    assert [f.status for f in check_model_streaming(folder, tokens=TOKENS).findings] == ["holds", "violated"]


def test_check_model_holds_a_couple_of_layers_at_most(tmp_path, monkeypatch):
    """Every tensor read from the checkpoint, its contiguous copy, and every prepared and
    transformed part is watched (weakref): when a part is read, the tensors of at most one other
    part are still alive."""
    cfg = cm.Config(n_layers=8, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=6, d_mlp=16)
    io.save(tmp_path / "m.safetensors", cm.random_state_dict(cfg, seed=0), cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "folder", steps=[])
    alive: dict = {}  # id -> part

    def watch(tensors, part):
        for tensor in tensors.values():
            if isinstance(tensor, torch.Tensor):
                alive[id(tensor)] = part
                weakref.finalize(tensor, alive.pop, id(tensor), None)
        return tensors

    most, reading = [], [None]

    def read(part, tensors):
        most.append(len(set(alive.values()) - {part}))
        reading[0] = part
        return watch(tensors, part)

    original_block, original_ends = Checkpoint.block, Checkpoint.ends
    monkeypatch.setattr(Checkpoint, "block", lambda self, layer: read(layer, original_block(self, layer)))
    monkeypatch.setattr(Checkpoint, "ends", lambda self: read(None, original_ends(self)))
    transformed = streaming_model._Run.transformed

    def watched(self, parts, layer):
        got = transformed(self, parts, layer)
        watch(got[0], layer), watch(got[2], layer)
        return got

    monkeypatch.setattr(streaming_model._Run, "transformed", watched)
    monkeypatch.setattr(streaming_model, "in_memory", lambda t: watch({0: streaming_in_memory(t)}, reading[0])[0])
    report = check_model_streaming(tmp_path / "folder", tokens=TOKENS[:, :6] % 11)
    assert report.ok and len(most) >= cfg.n_layers + 2
    assert max(most) <= 1, str(most)
    # negative twin: a source that keeps every part it read is seen holding them all
    kept, part = [], streaming_model._OnePart._part
    monkeypatch.setattr(streaming_model._OnePart, "_part", lambda self, which, read: kept.append(part(self, which, read)) or kept[-1])
    most.clear()
    check_model_streaming(tmp_path / "folder", tokens=TOKENS[:, :6] % 11)
    assert max(most) >= cfg.n_layers, str(most)


def test_check_command_streams_a_model_folder(tmp_path, capsys, monkeypatch):
    folder = _hf_folder(tmp_path, "llama-gqa")
    loaded = []
    monkeypatch.setattr(io, "load_hf_directory", lambda *a, **k: loaded.append(1))
    assert _cli.main(["check", str(folder), "--batch", "2", "--seq-len", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert not loaded and {r["name"]: r["status"] for r in rows}["fold_rms_norm"] == "holds"
    _corrupt(folder, "model.layers.2.mlp.up_proj.weight", float("nan"))
    assert _cli.main(["check", str(folder)]) == 2
    assert re.search(r"error: .*llama-gqa.*blocks\.2\.mlp\.W_in has 1 NaN", capsys.readouterr().err)
