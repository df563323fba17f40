"""How streaming ``process`` moves bytes (circuitmath._streaming_process): the reader's alternating
buffer sets, and the part written while the next is processed
(an error in either still leaves nothing behind, and progress comes in order)."""

import time

import pytest
import torch

import circuitmath as cm
from circuitmath import io
from circuitmath._checkpoint import CheckpointWriter, open_checkpoint
from circuitmath._processing.steps import STEPS
from circuitmath._streaming_parts import PartReader

CFG = cm.Config(n_layers=4, d_model=8, n_heads=4, d_head=2, d_vocab=11, n_ctx=5, d_mlp=16, normalization_type="RMS",
                positional_embedding_type="rotary", gated_mlp=True, n_key_value_heads=2, act_fn="silu")


def _folder(tmp_path, dtype=torch.bfloat16):
    """A circuitmath checkpoint folder of CFG, one shard per part, its matrices stored transposed
    (a Hugging Face layout's ``[out, in]``: the reader copies each into a buffer)."""
    state_dict = cm.random_state_dict(CFG, seed=0, dtype=dtype)
    io.save(tmp_path / "m.safetensors", state_dict, CFG)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "folder", steps=[])
    return state_dict, tmp_path / "folder"


class _Transposed:
    """A checkpoint whose blocks' matrices come as transposed views, as the converters hand them."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def ends(self):
        return self.checkpoint.ends()

    def block(self, layer):
        return {n: t.T.contiguous().T if t.dim() == 2 else t for n, t in self.checkpoint.block(layer).items()}


@pytest.mark.parametrize("sets", [1, 2])
def test_a_block_lives_until_its_buffers_come_round_again(tmp_path, sets):
    """With two sets of buffers, block k's tensors are intact while block k + 1 is read (and
    written to disk meanwhile) and reused by block k + 2: the memory of two blocks, not more."""
    state_dict, folder = _folder(tmp_path)
    reader = PartReader(_Transposed(open_checkpoint(folder)), None, buffer_sets=sets)
    name = "blocks.0.mlp.W_in"
    first = reader.block(0)[name]
    assert first.is_contiguous() and torch.equal(first, state_dict[name])
    reader.block(1)
    assert torch.equal(first, state_dict[name]) == (sets == 2)
    third = reader.block(2)["blocks.2.mlp.W_in"]
    assert third.data_ptr() == first.data_ptr() and torch.equal(first, state_dict["blocks.2.mlp.W_in"])


def test_progress_comes_in_order_once_each_part_is_written(tmp_path, monkeypatch):
    _, folder = _folder(tmp_path)
    on_disk, reported = [], []
    write = CheckpointWriter.write

    def recorded(self, tensors, cfg):
        time.sleep(0.05)  # a slow disk: a report made before its part is written would see it missing
        write(self, tensors, cfg)
        on_disk.append(len(self.weight_map))

    monkeypatch.setattr(CheckpointWriter, "write", recorded)
    io.process_checkpoint(folder, tmp_path / "out",
                          progress=lambda done, total, what: reported.append((done, total, what, len(on_disk))))
    assert [r[:3] for r in reported] == [(1, 5, "embedding and unembedding"), *((k + 2, 5, f"block {k}") for k in range(4))]
    assert [written for *_, written in reported] == [1, 2, 3, 4, 5]  # each report once its part is on disk


@pytest.mark.parametrize("failing", [1, 4])
def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch, failing):
    """A write that fails in the writing thread (here the second or the last part's) is raised
    by process_checkpoint, and the folder is not left half-written."""
    _, folder = _folder(tmp_path)
    write, calls = CheckpointWriter.write, []

    def failing_write(self, tensors, cfg):
        calls.append(1)
        if len(calls) == failing + 1:
            raise OSError("disk full")
        write(self, tensors, cfg)

    monkeypatch.setattr(CheckpointWriter, "write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        io.process_checkpoint(folder, tmp_path / "out")
    assert not any("out" in p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("steps", [None, "applicable"])
def test_a_step_that_some_block_cannot_take_is_left_out_of_every_part(tmp_path, steps):
    """An LN model with a gated MLP whose ln2 bias is zero in block 0 only: the ends and block 0
    could fold the LayerNorm, blocks 1 to 3 cannot (W_gate has no bias to take ln2.b), so the
    whole model leaves the fold out in memory, and so does the streamed process (it starts again
    once block 1 disagrees), where it used to refuse."""
    cfg = CFG.replace(normalization_type="LN", positional_embedding_type="standard", gated_mlp=True,
                      n_key_value_heads=None)
    state_dict = cm.random_state_dict(cfg, seed=0)
    state_dict["blocks.0.ln2.b"] = torch.zeros_like(state_dict["blocks.0.ln2.b"])
    io.save(tmp_path / "m.safetensors", state_dict, cfg)
    keywords = {} if steps is None else dict.fromkeys(STEPS)
    expected, expected_cfg = cm.process_weights(state_dict, cfg, **keywords)
    assert "fold_layer_norm" not in expected_cfg.applied and expected_cfg.applied
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "out", steps=steps)
    got, got_cfg = open_checkpoint(tmp_path / "out").load()
    assert got_cfg == expected_cfg and got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert [p.name for p in tmp_path.iterdir() if "out" in p.name] == ["out"]
