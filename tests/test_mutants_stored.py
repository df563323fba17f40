"""Reading and writing processed folders in an architecture's own layout (``circuitmath._stored``)
where mutation testing (``make mutate``) found no test reaching: a folder whose metadata config
has no place for a tensor the architecture's converter gives is refused naming the tensor, and
a processed tensor the layout has no place for is not written; each beside the case that fits."""

import dataclasses

import pytest
import torch
import transformers

import circuitmath as cm
from circuitmath import io
from circuitmath._stored import NotStored, place, processed_layout
from test_streaming import VOCAB, _hf_folder

BLOOM = (transformers.BloomForCausalLM, transformers.BloomConfig(
    vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))


def _as_processed(checkpoint, cfg):
    """``checkpoint``'s folder read in its architecture's layout as a processed model of ``cfg``
    (what the metadata of a processed folder says)."""
    return dataclasses.replace(checkpoint, cfg=cfg, layout=processed_layout(checkpoint.native, cfg))


def test_a_metadata_config_without_the_embedding_norm_the_folder_stores_is_refused(tmp_path):
    """BLOOM's converter gives its embedding LayerNorm; a metadata config that says the norm was
    folded into W_E (embedding_norm off) is refused naming it, since no stored LayerNorm is the
    identity; read with the LayerNorms folded but the embedding norm kept, the ends fit."""
    checkpoint = io.open_checkpoint(_hf_folder(tmp_path, "bloom", spec=BLOOM))
    assert checkpoint.cfg.embedding_norm and checkpoint.cfg.normalization_type == "LN"
    folded = checkpoint.cfg.replace(embedding_norm=False)
    with pytest.raises(cm.StateDictError, match=r"gives 'embed\.ln\.[wb]', but .* embedding norm was folded into W_E"):
        _as_processed(checkpoint, folded).ends()
    assert "embed.ln.w" in _as_processed(checkpoint, checkpoint.cfg).ends()


def test_a_metadata_config_without_tensors_the_folder_stores_is_refused(tmp_path):
    """A LLaMA folder read with a metadata config of an attention-only model: the MLP tensors the
    converter gives are refused by name, naming the folder, when the layout is made; read with
    its own config, every block reads."""
    checkpoint = io.open_checkpoint(_hf_folder(tmp_path, "llama-gqa"))
    with pytest.raises(cm.StateDictError, match=r"llama-gqa: the converter gives 'blocks\.0\.mlp\.W_(in|gate|out)', which"
                                                " the circuitmath config in the metadata lacks"):
        _as_processed(checkpoint, checkpoint.cfg.replace(d_mlp=None, gated_mlp=False))
    read = _as_processed(checkpoint, checkpoint.cfg)
    assert all(f"blocks.{layer}.mlp.W_in" in read.block(layer) for layer in range(checkpoint.cfg.n_layers))


def test_a_processed_tensor_the_layout_has_no_place_for_is_not_stored(tmp_path):
    """place() of the LLaMA ends with a learned position table added (LLaMA stores none):
    NotStored names it; the ends as read fit."""
    checkpoint = io.open_checkpoint(_hf_folder(tmp_path, "llama-gqa"))
    ends, viewers = checkpoint.ends(), checkpoint.stored(None)
    entries = checkpoint.tensors.entries
    buffers = {n: torch.empty(entries[n][2]["shape"]) for n in viewers}
    place(checkpoint.native, None, ends, buffers)
    extra = dict(ends, **{"pos_embed.W_pos": torch.zeros(checkpoint.cfg.n_ctx, checkpoint.cfg.d_model)})
    with pytest.raises(NotStored, match=r"the processed \['pos_embed\.W_pos'\] have no place in the checkpoint's layout"):
        place(checkpoint.native, None, extra, buffers)


def test_a_tensor_taken_for_untouched_that_the_processing_rewrites_is_caught_and_nothing_written(tmp_path, monkeypatch):
    """The streamed processing hands a tensor found untouched (on a small model of the same kind)
    over as zeros and writes the stored one in its place; were one rewritten after all (here
    W_Q, which the norm fold rewrites, claimed unread), the run stops, naming that tensor alone
    among those handed over as zeros, and leaves no folder. The same run with the true answer writes the in-memory processing (the control)."""
    from circuitmath import _streaming_process

    folder = _hf_folder(tmp_path, "llama-gqa")
    state_dict, cfg = io.load_hf_directory(folder)
    io.process_checkpoint(folder, tmp_path / "right", steps=["fold_ln"])
    got, _ = io.open_checkpoint(tmp_path / "right").load()
    expected, _ = cm.process_weights(state_dict, cfg, fold_ln=True, fold_value_biases=False, center_unembed=False,
                                     center_writing_weights=False)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    found = _streaming_process.find_untouched

    def claiming_w_q(cfg, keywords, layer, dtype):
        right = found(cfg, keywords, layer, dtype)
        claimed = frozenset() if layer is None else frozenset({"blocks.0.attn.W_Q"})
        return dataclasses.replace(right, kept=right.kept | claimed, unread=right.unread | claimed)

    monkeypatch.setattr(_streaming_process, "find_untouched", claiming_w_q)
    with pytest.raises(RuntimeError, match=r"rewrote \['blocks\.0\.attn\.W_Q'\], found untouched"):
        io.process_checkpoint(folder, tmp_path / "wrong", steps=["fold_ln"])
    assert not (tmp_path / "wrong").exists()
