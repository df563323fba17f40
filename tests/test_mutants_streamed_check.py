"""The streamed ``check MODEL`` where parts of a model apply other steps of process_weights,
pinned where mutation testing (``make mutate``) found it unpinned: the steps some block cannot
take are left out of every part, and the passes start again once, as the whole model leaves
them out in memory."""

import signal

import torch

import circuitmath as cm
from circuitmath import _diagnosis as diagnosis_module
from circuitmath import _streaming_check_model as streaming_model
from circuitmath import io
from circuitmath._diagnosis import weight_identities
from circuitmath._streaming_check_model import check_model_streaming
from support import same_rows, with_identities

GATED_LN = cm.Config(n_layers=3, d_model=8, n_heads=2, d_head=4, d_vocab=11, n_ctx=5, d_mlp=16, gated_mlp=True,
                     act_fn="silu")
TOKENS = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))


def _within(seconds: int, call):
    """``call()``, failing the test past ``seconds`` (a pass that never ends) instead of hanging."""
    def late(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        return call()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_step_some_block_cannot_take_is_left_out_of_the_streamed_check(tmp_path, monkeypatch):
    """A gated LayerNorm model whose ln2 bias is zero in block 0 only: the ends and block 0 could
    fold the LayerNorm, blocks 1 and 2 cannot (W_gate has no bias to take ln2.b). The streamed
    check of process_weights leaves the fold out of every part, as the whole model does in memory,
    and its row is the in-memory row; it ends (within 30 s on a busy machine: it takes well
    under a second alone), its passes started again once, at
    block 1. Control: without the zero bias the whole
    model refuses nothing, and the fold is applied."""
    state_dict = cm.random_state_dict(GATED_LN, seed=0, dtype=torch.float32)
    state_dict["blocks.0.ln2.b"] = torch.zeros_like(state_dict["blocks.0.ln2.b"])
    io.save(tmp_path / "m.safetensors", state_dict, GATED_LN)
    identity = next(i for i in weight_identities(symmetries=True) if i.name == "process_weights")
    with_identities(monkeypatch, identity)
    agreed, agrees = [], streaming_model._Run.agrees
    monkeypatch.setattr(streaming_model._Run, "agrees", lambda run, cfg: agreed.append(agrees(run, cfg)) or agreed[-1])
    in_memory = diagnosis_module.check_model(state_dict, GATED_LN, tokens=TOKENS)
    streamed = _within(30, lambda: check_model_streaming(tmp_path / "m.safetensors", tokens=TOKENS))
    same_rows(streamed, in_memory)
    assert agreed.count(False) == 1 and agreed[-GATED_LN.n_layers:] == [True] * GATED_LN.n_layers
    assert [f.status for f in streamed.findings] == ["holds"]
    _, applied_cfg = cm.process_weights(state_dict, GATED_LN)
    assert "fold_layer_norm" not in applied_cfg.applied and "fold_value_biases" in applied_cfg.applied
    every_bias_zero = {n: torch.zeros_like(t) if n.endswith("ln2.b") else t for n, t in state_dict.items()}
    assert "fold_layer_norm" in cm.process_weights(every_bias_zero, GATED_LN)[1].applied


def test_the_streamed_check_reports_each_part_once_and_ends_at_its_total(tmp_path):
    """progress(done, total, what) of a streamed check of an LN model, whose identities that
    reach layer_norm_to_rms_norm's decision record the writers of every block first: each part
    once, counted from 1 to the total announced from the start, the writers' pass before the
    main pass and 'done' last."""
    cfg = GATED_LN.replace(gated_mlp=False, act_fn="gelu", n_layers=2)
    io.save(tmp_path / "m.safetensors", cm.random_state_dict(cfg, seed=0, dtype=torch.float32), cfg)
    calls = []
    check_model_streaming(tmp_path / "m.safetensors", tokens=TOKENS, progress=lambda *call: calls.append(call))
    assert calls == [(1, 6, "embedding and unembedding"), (2, 6, "writers, block 0"), (3, 6, "writers, block 1"),
                     (4, 6, "block 0"), (5, 6, "block 1"), (6, 6, "done")]


def test_check_processed_reports_each_part_once_and_ends_at_its_total(tmp_path):
    """progress(done, total, what) of check --processed on a folder and its processing: the ends,
    then each block, counted from 1 to the total (blocks + 1); the pair holds."""
    from circuitmath._streaming_check_processed import check_processed

    cfg = GATED_LN.replace(gated_mlp=False, act_fn="gelu", n_layers=2)
    io.save(tmp_path / "m.safetensors", cm.random_state_dict(cfg, seed=0, dtype=torch.float32), cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "before", steps=[])
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "after", steps="applicable")
    calls = []
    report = check_processed(tmp_path / "before", tmp_path / "after", tokens=TOKENS, progress=lambda *c: calls.append(c))
    assert report.ok
    assert calls == [(1, 3, "embedding and unembedding"), (2, 3, "block 0"), (3, 3, "block 1")]


def test_a_bfloat16_processing_equal_to_the_rounded_rewrite_is_reported_within_half_a_unit(tmp_path):
    """check --processed of a bfloat16 folder's processing, every tensor equal bit for bit to the
    float32 rewrite rounded once: the tensors row holds at half a unit of the bound of one
    (the rounding to nearest), never more than its tolerance."""
    from circuitmath._streaming_check_processed import check_processed

    cfg = GATED_LN.replace(gated_mlp=False, act_fn="gelu", n_layers=2)
    io.save(tmp_path / "m.safetensors", cm.random_state_dict(cfg, seed=0, dtype=torch.bfloat16), cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "before", steps=[])
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "after", steps="applicable")
    tensors = check_processed(tmp_path / "before", tmp_path / "after", tokens=TOKENS).rows[1]
    assert tensors["name"] == "tensors" and tensors["status"] == "holds"
    assert (tensors["max_abs_error"], tensors["tolerance"]) == (0.5, 1.0)
    assert "equal to it rounded, bit for bit, so within half a unit" in tensors["explanation"]


def test_a_bfloat16_tensor_a_few_units_off_is_a_near_miss_reported_against_a_tolerance_of_one(tmp_path):
    """check --processed of a bfloat16 processing with one tensor's entries moved by four units
    in the last place (within the near-miss range): the tensors row is violated, naming it, its
    worst entry a multiple of the bound above the tolerance of 1 (the bound itself)."""
    from circuitmath._checkpoint import CheckpointWriter
    from circuitmath._streaming_check_processed import check_processed

    cfg = GATED_LN.replace(gated_mlp=False, act_fn="gelu", n_layers=2)
    io.save(tmp_path / "m.safetensors", cm.random_state_dict(cfg, seed=0, dtype=torch.bfloat16), cfg)
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "before", steps=[])
    io.process_checkpoint(tmp_path / "m.safetensors", tmp_path / "after", steps="applicable")
    processed, processed_cfg = io.open_checkpoint(tmp_path / "after").load()
    name = "blocks.1.mlp.W_in"
    moved = dict(processed, **{name: (processed[name].float() * (1 + 4 * 2.0**-8)).to(torch.bfloat16)})
    with CheckpointWriter(tmp_path / "moved", 1) as writer:
        writer.write(moved, processed_cfg)
    tensors = check_processed(tmp_path / "before", tmp_path / "moved", tokens=TOKENS).rows[1]
    assert tensors["status"] == "violated" and name in tensors["explanation"]
    assert tensors["tolerance"] == 1.0 < tensors["max_abs_error"]
