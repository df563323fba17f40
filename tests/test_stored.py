"""Processed Hugging Face folders written in their own architecture's names and layout
(circuitmath._stored): a LLaMA comes out as a LLaMA that transformers loads and that computes
the input's log-probs, with the tensors the processing does not touch copied byte for byte;
GPT-2 and GPT-NeoX keep their final norm's bias where the fold would make an unembedding bias
they lack; tied embeddings the processing makes differ are written untied; and a folder whose stored norms contradict its metadata is refused."""

import errno
import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import circuitmath as cm
from circuitmath import _checkpoint, io
from circuitmath._checkpoint import INDEX
from circuitmath._hf import hf_layout
from circuitmath._processing.fused import _scaled_rows
from circuitmath._stored import LAYOUT_KEY, NotStored, Untied, place
from circuitmath._streaming_check_processed import check_processed
from test_streaming import EVERYTHING, HF, ROPE, TOKENS, VOCAB, CTX, _hf_folder


def _index(folder) -> dict:
    return json.loads((folder / INDEX).read_text())


def _stored_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in set(_index(folder)["weight_map"].values()):
        tensors |= load_file(folder / shard)
    return tensors


def _log_probs(folder, dtype=torch.float32) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return torch.log_softmax(model(TOKENS).logits.double(), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_comes_out_as_a_llama_of_the_same_function(tmp_path, dtype):
    """The output folder holds the input's tensor names, shapes and dtype and its config.json;
    the norms are 1, the maps the processing hands back as given (o_proj, down_proj, the
    embedding) are the input's bytes, and transformers loads it and computes the input model's
    log-probs (computed in float64; the folded weights are rounded once more). Control: the same folder
    with one folded norm's gain put back computes something else, by far more than the tolerance."""
    folder = _hf_folder(tmp_path, "llama-gqa", dtype)
    out = tmp_path / "out"
    cfg = io.process_checkpoint(folder, out, steps="applicable")
    assert _index(out)["metadata"][LAYOUT_KEY] == "config.json"
    assert json.loads((out / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    before, after = _stored_tensors(folder), _stored_tensors(out)
    assert before.keys() == after.keys()
    assert all(after[n].dtype == dtype and after[n].shape == before[n].shape for n in before)
    norms = [n for n in after if n.endswith("norm.weight")]
    assert len(norms) == 2 * 3 + 1 and all(bool((after[n] == 1).all()) for n in norms)
    untouched = [n for n in before if n.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight"))]
    assert len(untouched) == 2 * 3 + 1 and all(torch.equal(after[n], before[n]) for n in untouched)
    assert not torch.equal(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])
    assert "fold_rms_norm" in cfg.applied and io.open_checkpoint(out).cfg == cfg

    expected = _log_probs(folder, torch.float64)
    got = _log_probs(out, torch.float64)
    # each folded weight is rounded once to the dtype: measured 1.6e-6 (float32) and 0.031 (bfloat16)
    # nats at most here, the control 2.7 nats
    tolerance = 1e-4 if dtype == torch.float32 else 0.15
    assert (got - expected).abs().max() < tolerance
    # control: a norm gain that the fold already multiplied into q, k and v, put back
    shard = out / _index(out)["weight_map"]["model.layers.1.input_layernorm.weight"]
    tensors = load_file(shard)
    tensors["model.layers.1.input_layernorm.weight"] = before["model.layers.1.input_layernorm.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    assert (_log_probs(out, torch.float64) - expected).abs().max() > 10 * tolerance


def _tied_llama():
    return (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, tie_word_embeddings=True, rope_parameters=ROPE, bos_token_id=0, eos_token_id=0,
        pad_token_id=None))


@pytest.mark.parametrize("name,dtype", [("gpt2", torch.float32), ("llama-tied", torch.float32),
                                        ("llama-tied", torch.bfloat16)])
def test_tied_embeddings_the_processing_makes_differ_are_written_untied_in_the_layout(tmp_path, name, dtype):
    """A tied GPT-2 and a tied LLaMA store W_E and W_U once, which folding the final norm's gain
    and centering the unembedding make differ: each is written in its own layout untied (the
    unembedding as lm_head.weight, tie_word_embeddings false in config.json), its config saying so
    (tied_embeddings false, true for the input), and transformers loads it as the same class with
    the input's log-probs (measured 1.2e-7 nats on GPT-2 in float32). LLaMA's folder, read back,
    is the in-memory processing bit for bit. Control: the stored lm_head.weight replaced by the
    embedding (tied again) moves the log-probs by far more than the tolerance."""
    spec = HF.get(name) or _tied_llama()
    folder = _hf_folder(tmp_path, name, dtype, spec=spec)
    state_dict, cfg = io.load_hf_directory(folder)
    assert cfg.tied_embeddings and "lm_head.weight" not in _stored_tensors(folder)
    out = tmp_path / "out"
    got_cfg = io.process_checkpoint(folder, out)
    assert _index(out)["metadata"][LAYOUT_KEY] == "config.json" and not got_cfg.tied_embeddings
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    after = _stored_tensors(out)
    assert after.keys() == _stored_tensors(folder).keys() | {"lm_head.weight"}
    got, read_cfg = io.open_checkpoint(out).load()
    assert read_cfg == got_cfg and not torch.equal(got["unembed.W_U"], got["embed.W_E"].T)
    if name == "llama-tied":
        expected, expected_cfg = cm.process_weights(state_dict, cfg)
        assert expected_cfg == got_cfg and all(torch.equal(got[k], expected[k]) for k in expected)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    assert type(loaded) is spec[0]
    expected_log_probs = _log_probs(folder, torch.float64)
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    assert (_log_probs(out, torch.float64) - expected_log_probs).abs().max() < tolerance
    shard = out / _index(out)["weight_map"]["lm_head.weight"]
    tensors = load_file(shard)
    embedding = next(n for n in tensors if n.endswith(("wte.weight", "embed_tokens.weight")))
    tensors["lm_head.weight"] = tensors[embedding].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    assert (_log_probs(out, torch.float64) - expected_log_probs).abs().max() > 4 * tolerance


def test_steps_that_keep_the_tied_embeddings_equal_keep_them_tied(tmp_path):
    """Folding the value biases leaves W_E and W_U alone: a tied GPT-2 processed so is written
    tied (no lm_head.weight, config.json as given) and its config still says tied_embeddings."""
    folder = _hf_folder(tmp_path, "gpt2", spec=HF["gpt2"])
    cfg = io.process_checkpoint(folder, tmp_path / "out", steps=("fold_value_biases",))
    assert cfg.tied_embeddings and cfg.applied == ("fold_value_biases",)
    assert "lm_head.weight" not in _stored_tensors(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    got, _ = io.open_checkpoint(tmp_path / "out").load()
    assert torch.equal(got["unembed.W_U"], got["embed.W_E"].T)


def _untied_gpt2():
    model_class, config = HF["gpt2"]
    return model_class, transformers.GPT2Config(**(config.to_dict() | {"tie_word_embeddings": False}))


_CLASSES = {"gpt2": "GPT2LMHeadModel", "gpt2-untied": "GPT2LMHeadModel", "neox-parallel-partial-rotary": "GPTNeoXForCausalLM"}


def _with_final_bias(out, tmp_path, label, final, change):
    """A copy of the folder ``out`` whose stored final norm bias is ``change(bias)``."""
    wrong = tmp_path / label
    shutil.copytree(out, wrong)
    shard = wrong / _index(wrong)["weight_map"][f"{final}.bias"]
    tensors = load_file(shard)
    tensors[f"{final}.bias"] = change(tensors[f"{final}.bias"])
    save_file(tensors, shard, metadata={"format": "pt"})
    return wrong


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["gpt2", "gpt2-untied", "neox-parallel-partial-rotary"])
def test_gpt2_and_neox_keep_their_layout_with_the_final_norms_bias(tmp_path, name, dtype):
    """GPT-2 and GPT-NeoX have no unembedding bias for the folded final LayerNorm's: the folder is
    processed with the same steps but for the centering of the norms' readers (not in
    ``applied``), and keeps ln_f's bias behind its folded gain (b / w) with gain 1, in every dtype
    (a tied GPT-2 untied). transformers loads it as the same class with the input's log-probs;
    read back by circuitmath, b_U is that bias through W_U; check --processed passes it, the kept
    bias certified as stored. Controls: the kept bias zeroed moves the log-probs by far more than
    the tolerance; the check refuses b taken for b / w (a wrong bias) and one entry of the kept
    bias moved by a few of the certificate's bounds (a near miss, named as stored)."""
    spec = _untied_gpt2() if name == "gpt2-untied" else HF[name]
    folder = _hf_folder(tmp_path, name, dtype, spec=spec)
    out = tmp_path / "out"
    cfg = io.process_checkpoint(folder, out)
    assert _index(out)["metadata"][LAYOUT_KEY] == "config.json"
    assert json.loads((out / "config.json").read_text())["architectures"] == [_CLASSES[name]]
    assert cfg.applied == ("fold_layer_norm", "fold_value_biases", "center_writing_weights", "center_unembed")
    assert not cfg.tied_embeddings
    final = "gpt_neox.final_layer_norm" if name.startswith("neox") else "transformer.ln_f"
    after = _stored_tensors(out)
    assert all(t.dtype == dtype for t in after.values())
    assert bool((after[f"{final}.weight"] == 1).all()) and bool(after[f"{final}.bias"].ne(0).any())
    assert type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__ == _CLASSES[name]
    expected = _log_probs(folder, torch.float64)
    # measured 2.3e-7 / 2.8e-7 / 4.9e-7 (float32), 0.012 / 0.012 / 0.015 (bfloat16, where
    # transformers' own bfloat16 forward pass is 0.026 / 0.032 from its float64 one) and
    # 0.0012 / 0.0014 / 0.0017 (float16) for gpt2 / gpt2-untied / neox
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.006}[dtype]
    assert (_log_probs(out, torch.float64) - expected).abs().max() < tolerance
    sd, got_cfg = io.open_checkpoint(out).load()
    assert got_cfg == cfg and bool(sd["unembed.b_U"].ne(0).any())
    with torch.no_grad():
        ours = torch.log_softmax(cm.forward({k: v.double() for k, v in sd.items()}, cfg, TOKENS), -1)
    assert (ours - expected).abs().max() < tolerance
    report = check_processed(folder, out, tokens=TOKENS)
    assert report.ok, str(report)
    assert "final LayerNorm's bias kept ahead of W_U" in report.rows[1]["explanation"]

    zeroed = _with_final_bias(out, tmp_path, "zeroed", final, torch.zeros_like)
    assert (_log_probs(zeroed, torch.float64) - expected).abs().max() > 4 * tolerance
    b = load_file(folder / _index(folder)["weight_map"][f"{final}.bias"])[f"{final}.bias"]
    assert not check_processed(folder, _with_final_bias(out, tmp_path, "undivided", final, lambda c: b), tokens=TOKENS).ok
    nudged = _with_final_bias(out, tmp_path, "nudged", final, _units_out)
    row = check_processed(folder, nudged, tokens=TOKENS).rows[1]
    assert row["status"] == "violated" and "ln_final.b" in row["explanation"]


def _units_out(c: torch.Tensor) -> torch.Tensor:
    """``c`` with its largest entry moved away from zero by 4 units in the last place of its dtype
    in half precision, 512 in float32 (6e-5 of it: the certificate's floor there is 8 float32 unit
    roundoffs times the square root of the widest dimension, about 78 units of the largest entry
    here); its bits, sign and magnitude, read as an integer: the magnitude's next values."""
    c, i = c.clone(), int(c.abs().argmax())
    if c.dtype == torch.float32:
        c.view(torch.int32)[i] += 512
    else:
        c.view(torch.int16)[i] += 4
    return c


def test_the_final_norms_bias_is_kept_only_where_it_gives_the_processed_b_U():
    """final_bias_kept stores b / w; it refuses a zero gain under a nonzero bias, and a b_U that
    the bias does not give through W_U (the bias itself, b, taken for b / w)."""
    from circuitmath._stored import final_bias_kept

    g = torch.Generator().manual_seed(0)
    w, b, W_U = torch.rand(8, generator=g) + 0.5, torch.randn(8, generator=g), torch.randn(8, 5, generator=g)
    zeros = torch.zeros(5)
    folded = {"unembed.W_U": w[:, None] * W_U, "unembed.b_U": b @ W_U}
    kept = final_bias_kept(folded, w, b, zeros)
    assert torch.equal(kept["unembed.b_U"], zeros) and torch.allclose(kept["ln_final.b"] * w, b)
    with pytest.raises(NotStored, match="zero gain"):
        final_bias_kept(folded, torch.cat([w[:7], torch.zeros(1)]), b, zeros)
    with pytest.raises(NotStored, match="not the final LayerNorm's bias"):
        final_bias_kept(folded | {"unembed.b_U": (b * w) @ W_U * w.mean()}, w, b, zeros)
    assert final_bias_kept({"unembed.W_U": W_U, "unembed.b_U": zeros}, w, b, zeros)["unembed.b_U"] is zeros


def test_the_check_certifies_a_kept_final_bias_as_stored_only_where_it_gives_the_replayed_b_U():
    """check --processed holds a kept final bias c (stored bfloat16) to before's b / w, 1 unit in
    the last place, where b / w through the replayed W_U gives the replayed b_U: c rounded once
    passes (at most half a unit); c moved by 2 units fails; a replay whose W_U the kept bias does not
    explain (its rows rotated) or a zero gain leaves b_U to be compared as read back (None)."""
    from types import SimpleNamespace

    from circuitmath._diagnosis._tensors import Thresholds
    from circuitmath._streaming_check_processed import _Tensors

    g = torch.Generator().manual_seed(0)
    w, b, W = torch.rand(24, generator=g) + 0.5, torch.randn(24, generator=g), torch.randn(24, 64, generator=g)
    W = W - W.mean(1, keepdim=True)
    replayed = {"unembed.W_U": w[:, None] * W, "unembed.b_U": b @ W}
    c = (b.double() / w.double()).to(torch.bfloat16)
    cfg = cm.Config(n_layers=1, d_model=24, n_heads=3, d_head=8, d_vocab=64, n_ctx=4, d_mlp=96)
    tensors = SimpleNamespace(kept=(c, w, b), compute=torch.float32, thresholds=Thresholds.of(torch.bfloat16, cfg))
    assert _Tensors.kept_ratio(tensors, replayed) <= 0.5
    moved = c.clone()
    moved.view(torch.int16)[int(c.abs().argmax())] += 2
    assert _Tensors.kept_ratio(SimpleNamespace(**{**vars(tensors), "kept": (moved, w, b)}), replayed) > 1
    q, _ = torch.linalg.qr(torch.randn(24, 24, generator=g))
    rotated = {"unembed.W_U": q.T @ replayed["unembed.W_U"], "unembed.b_U": replayed["unembed.b_U"]}
    assert _Tensors.kept_ratio(tensors, rotated) is None
    assert _Tensors.kept_ratio(SimpleNamespace(**{**vars(tensors), "kept": (c, torch.cat([w[:23], torch.zeros(1)]), b)}),
                               replayed) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_opt_post_keeps_its_layout_with_its_positions_copied(tmp_path, dtype):
    """OPT's positions start at row 2 of embed_positions, a stored tensor W_pos does not cover
    once: where the processing leaves W_pos as it is (a post-norm OPT), the stored tensor is
    copied, in half precision too, where the processing computes in float32 and hands back a new
    tensor of the same bits. The folder loads as OPTForCausalLM with the input's log-probs
    (measured 0.010 in bfloat16, 0.0008 in float16, where transformers' own passes in those dtypes
    are 0.020 and 0.0028 from float64) and check --processed passes it. Control: W_pos moved by one
    unit in one entry is not copied."""
    from circuitmath._streaming_process import _unchanged_partly_viewed
    from test_families import _hf_log_probs, _model, _tokens

    model, _ = _model("OPT-post")
    model.to(dtype).save_pretrained(tmp_path / "in")
    out = tmp_path / "out"
    cfg = io.process_checkpoint(tmp_path / "in", out)
    assert _index(out)["metadata"][LAYOUT_KEY] == "config.json" and "center_unembed" in cfg.applied
    name = "model.decoder.embed_positions.weight"
    assert torch.equal(_stored_tensors(out)[name], load_file(tmp_path / "in" / "model.safetensors")[name])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    assert type(loaded) is transformers.OPTForCausalLM
    tokens = _tokens()
    expected = _hf_log_probs(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "in", dtype=torch.float64), tokens)
    assert (_hf_log_probs(loaded, tokens) - expected).abs().max() < 0.05
    assert check_processed(tmp_path / "in", out, tokens=tokens).ok
    checkpoint = io.open_checkpoint(tmp_path / "in")
    ends = {n: t.clone() for n, t in checkpoint.ends().items()}
    assert {"pos_embed.W_pos"} <= _unchanged_partly_viewed(checkpoint, None, ends)
    ends["pos_embed.W_pos"].view(torch.int16)[0, 0] += 1
    assert "pos_embed.W_pos" not in _unchanged_partly_viewed(checkpoint, None, ends)


def test_steps_that_fit_the_layout_keep_it_for_any_architecture(tmp_path):
    """GPT-2 with only the unembedding centered (no bias appears; it is untied here) and the
    value biases folded is written in GPT-2's own names, the in-memory transform's bit for bit."""
    model_class, config = HF["gpt2"]
    config = transformers.GPT2Config(**(config.to_dict() | {"tie_word_embeddings": False}))
    folder = _hf_folder(tmp_path, "gpt2-untied", spec=(model_class, config))
    state_dict, cfg = io.load_hf_directory(folder)
    steps = ["fold_value_biases", "center_unembed"]
    expected, expected_cfg = cm.process_weights(state_dict, cfg, **{k: k in steps for k in EVERYTHING})
    io.process_checkpoint(folder, tmp_path / "out", steps=steps)
    assert _index(tmp_path / "out")["metadata"][LAYOUT_KEY] == "config.json"
    assert "transformer.h.0.attn.c_attn.weight" in _index(tmp_path / "out")["weight_map"]
    got, got_cfg = io.open_checkpoint(tmp_path / "out").load()
    assert got_cfg == expected_cfg and all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_processed_folder_is_processed_again_in_its_layout(tmp_path):
    """The output is an input like any other: the norm fold first, the unembedding's centering
    second gives the one-go result; applying the fold twice is refused, naming the identity."""
    folder = _hf_folder(tmp_path, "llama-gqa", torch.bfloat16)
    state_dict, cfg = io.load_hf_directory(folder)
    expected, expected_cfg = cm.process_weights(state_dict, cfg, fold_ln=True, fold_value_biases=False,
                                                center_unembed=False, center_writing_weights=False)
    expected, expected_cfg = cm.process_weights(expected, expected_cfg, fold_ln=False, center_unembed=True,
                                                fold_value_biases=False, center_writing_weights=False)
    io.process_checkpoint(folder, tmp_path / "first", steps=["fold_ln"])
    io.process_checkpoint(tmp_path / "first", tmp_path / "second", steps=["center_unembed"])
    assert _index(tmp_path / "second")["metadata"][LAYOUT_KEY] == "config.json"
    got, got_cfg = io.open_checkpoint(tmp_path / "second").load()
    assert got_cfg == expected_cfg and all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(cm.PreconditionError, match="fold_rms_norm"):
        io.process_checkpoint(tmp_path / "first", tmp_path / "third", steps=["fold_ln"])
    assert not (tmp_path / "third").exists()


def test_a_stored_norm_that_contradicts_the_metadata_is_refused(tmp_path):
    """The metadata says the norms were folded, so each stored gain must be 1: one that is not
    is refused when its part is read, naming the file and the tensor."""
    folder = _hf_folder(tmp_path, "llama-gqa")
    out = tmp_path / "out"
    io.process_checkpoint(folder, out, steps="applicable")
    shard = out / _index(out)["weight_map"]["model.layers.2.post_attention_layernorm.weight"]
    tensors, metadata = load_file(shard), json.loads(shard.read_bytes()[8:8 + int.from_bytes(shard.read_bytes()[:8], "little")])["__metadata__"]
    tensors["model.layers.2.post_attention_layernorm.weight"][3] = 1.5
    save_file(tensors, shard, metadata=metadata)
    checkpoint = io.open_checkpoint(out)
    checkpoint.block(1)  # the other blocks read as before
    with pytest.raises(cm.StateDictError, match=r"out.*blocks\.2\.ln2\.w.*not 1 everywhere"):
        checkpoint.block(2)


def test_the_converters_views_cover_each_stored_tensor_once(tmp_path):
    """The contract place() relies on: for every architecture, each stored tensor of a part is
    covered exactly once by the converter's views of it (or whole by each of tied views). Each
    stored tensor is filled with its entries' indices and every view's entries are collected."""
    for name in sorted(HF):
        checkpoint = io.open_checkpoint(_hf_folder(tmp_path / name, name))
        for layer in [None, *range(checkpoint.cfg.n_layers)]:
            viewers = checkpoint.stored(layer)
            entries = checkpoint.tensors.entries
            buffers = {n: torch.arange(float(torch.Size(entries[n][2]["shape"]).numel())).view(entries[n][2]["shape"])
                       for n in viewers}
            views = (checkpoint.native.embed(src := checkpoint.native.source(buffers)) | checkpoint.native.final(src)
                     if layer is None else checkpoint.native.block(checkpoint.native.source(buffers), layer))
            for stored, names in viewers.items():
                assert names, f"{name}: {stored} is stored but no view takes it"
                seen = torch.cat([views[n].reshape(-1) for n in names]).sort().values
                whole = torch.arange(float(buffers[stored].numel()))
                assert torch.equal(seen, whole) or all(torch.equal(views[n].reshape(-1).sort().values, whole) for n in names), \
                    (name, stored, names)


def _llama_part(tmp_path):
    folder = _hf_folder(tmp_path, "llama-gqa")
    checkpoint = io.open_checkpoint(folder)
    return checkpoint, checkpoint.ends(), checkpoint.stored(None)


def _buffers(checkpoint, viewers):
    entries = checkpoint.tensors.entries
    return {n: torch.empty(entries[n][2]["shape"]) for n in viewers}


def test_place_refuses_a_made_up_tensor_the_processing_changed(tmp_path):
    checkpoint, ends, viewers = _llama_part(tmp_path)
    place(checkpoint.native, None, ends, _buffers(checkpoint, viewers))  # as read: it fits
    ends["unembed.b_U"] = ends["unembed.b_U"] + 1
    with pytest.raises(NotStored, match="unembed.b_U is not the zeros"):
        place(checkpoint.native, None, ends, _buffers(checkpoint, viewers))


def test_place_refuses_tied_tensors_made_different(tmp_path):
    folder = _hf_folder(tmp_path, "tied", spec=(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=CTX, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, tie_word_embeddings=True, rope_parameters=ROPE, bos_token_id=0, eos_token_id=0,
        pad_token_id=None)))
    checkpoint = io.open_checkpoint(folder)
    ends, viewers = {n: t.contiguous() for n, t in checkpoint.ends().items()}, checkpoint.stored(None)
    assert sorted(viewers["model.embed_tokens.weight"]) == ["embed.W_E", "unembed.W_U"]
    place(checkpoint.native, None, ends, _buffers(checkpoint, viewers))
    ends["unembed.W_U"] = ends["unembed.W_U"] - ends["unembed.W_U"].mean(-1, keepdim=True)
    with pytest.raises(Untied, match="stored once for"):
        place(checkpoint.native, None, ends, _buffers(checkpoint, viewers))


def test_products_of_stored_matrices_keep_their_layout_and_bits():
    """_scaled_rows on a transposed view (a converter's W_Q) writes the product in that layout,
    with the bits of the product of the contiguous matrix."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        stored = torch.randn(4, 16, 64, generator=g).to(dtype)  # [heads, d_head, d_model]
        w = torch.randn(64, generator=g).to(dtype)
        view = stored.mT  # W_Q: [heads, d_model, d_head]
        got = _scaled_rows(view, w, sums=[])
        assert got.mT.is_contiguous() and not got.is_contiguous()
        assert torch.equal(got, _scaled_rows(view.contiguous(), w, sums=[]))
        assert torch.equal(got, view * w[:, None])


def test_tensors_are_copied_where_the_kernel_cannot_copy_them(tmp_path, monkeypatch):
    """Where copy_file_range is refused (another file system, an old kernel), the bytes are read
    and written: the same output."""
    folder = _hf_folder(tmp_path, "llama-gqa", torch.bfloat16)
    io.process_checkpoint(folder, tmp_path / "kernel", steps="applicable")
    calls = []

    def refused(*args):
        calls.append(1)
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(_checkpoint.os, "copy_file_range", refused)
    io.process_checkpoint(folder, tmp_path / "read", steps="applicable")
    assert calls
    kernel, read = _stored_tensors(tmp_path / "kernel"), _stored_tensors(tmp_path / "read")
    assert kernel.keys() == read.keys() and all(torch.equal(kernel[n], read[n]) for n in kernel)


def test_a_dtype_change_is_written_in_the_layout_with_its_config(tmp_path):
    folder = _hf_folder(tmp_path, "llama-gqa", torch.bfloat16)
    state_dict, cfg = io.load_hf_directory(folder)
    expected, _ = cm.process_weights({k: v.float() for k, v in state_dict.items()}, cfg, **EVERYTHING)
    io.process_checkpoint(folder, tmp_path / "out", steps="applicable", dtype=torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    got, _ = io.open_checkpoint(tmp_path / "out").load()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("case", ["layout value", "config.json missing", "config.json circuitmath's"])
def test_a_layout_the_folder_does_not_back_is_refused_naming_it(tmp_path, case):
    """The metadata's layout key must say config.json, and config.json must be a Hugging Face
    config: otherwise opening the folder fails with an input error naming the file and field."""
    folder = _hf_folder(tmp_path, "llama-gqa")
    out = tmp_path / "out"
    cfg = io.process_checkpoint(folder, out, steps="applicable")
    if case == "layout value":
        index = _index(out)
        index["metadata"][LAYOUT_KEY] = "tokenizer.json"
        (out / INDEX).write_text(json.dumps(index))
        match = r"circuitmath\.layout.*'tokenizer\.json'"
    elif case == "config.json missing":
        (out / "config.json").unlink()
        match = r"config\.json"
    else:
        (out / "config.json").write_text(cfg.to_json())
        match = r"config\.json: a circuitmath config"
    with pytest.raises(cm.CircuitMathError, match=match) as raised:
        io.open_checkpoint(out)
    assert str(out) in str(raised.value)
