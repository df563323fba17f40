"""Large processed weights live in huge-page-advised memory: they must behave as ordinary tensors."""

import gc
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from circuitmath._processing._memory import HUGE_PAGE_MIN_BYTES, new_tensor


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_large_new_tensor_is_an_ordinary_contiguous_tensor(dtype, tmp_path):
    shape = (HUGE_PAGE_MIN_BYTES // dtype.itemsize // 64 + 1, 64)
    tensor = new_tensor(shape, dtype, "cpu")
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    tensor.copy_(torch.randn(shape, dtype=dtype))
    save_file({"w": tensor, "v": new_tensor(shape, dtype, "cpu").zero_()}, tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")
    assert torch.equal(loaded["w"], tensor) and not loaded["v"].any()
    assert torch.equal((tensor * 2).sub_(tensor), tensor)


def test_a_small_new_tensor_comes_from_torch_empty():
    tensor = new_tensor((3, 5), torch.float32, "cpu")
    assert tensor.untyped_storage().resizable()  # a frombuffer storage is not


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
def test_the_memory_is_returned_when_the_last_view_goes():
    gc.collect()
    before = _rss_bytes()
    tensor = new_tensor((64 << 20,), torch.float32, "cpu")  # 256 MiB
    tensor.fill_(1.0)
    view = tensor[1:]
    del tensor
    gc.collect()
    assert _rss_bytes() - before > 200 << 20 and float(view[-1]) == 1.0
    del view
    gc.collect()
    assert _rss_bytes() - before < 32 << 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_through_mapped_temporaries_is_float32_processing_rounded_once(dtype):
    """A half-precision model whose float32 temporaries pass :data:`SCRATCH_MIN_BYTES` (the cast
    and folded readers, ``W_O`` in float64, the blocks of the unembed and of the writers) is
    computed in mapped scratch memory reused across blocks. With sizes that leave short last
    blocks (d_model 100: the unembed's blocks of 64 and 8 rows; a vocabulary past one block of
    the embedding's centering), the output is still float32 processing rounded once, bit for
    bit, and the input is left as it was."""
    from circuitmath import Config, process_weights, random_state_dict

    cfg = Config(n_layers=2, d_model=100, n_heads=4, d_head=48, d_vocab=5300, n_ctx=9, d_mlp=300)
    half = {k: v.to(dtype) for k, v in random_state_dict(cfg, seed=1, dtype=torch.float32).items()}
    assert cfg.d_vocab * cfg.d_model * dtype.itemsize > 1 << 20  # the embedding is centered in 2 blocks
    kept = {k: v.clone() for k, v in half.items()}
    expected, expected_cfg = process_weights({k: v.float() for k, v in half.items()}, cfg)
    got, got_cfg = process_weights(half, cfg)
    assert got_cfg == expected_cfg and set(got) == set(expected)
    for name, tensor in got.items():
        assert tensor.dtype == dtype and torch.equal(tensor, expected[name].to(dtype)), name
    assert all(torch.equal(half[k], kept[k]) for k in kept)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_value_bias_is_the_same_bits_whatever_the_layout_of_W_O(kv_heads):
    """The fused steps hand ``value_bias_through_output`` a ``W_O`` laid out ``[d_head, n_heads,
    d_model]`` (so its einsum copies nothing): the bits must be those of a contiguous ``W_O``."""
    from circuitmath._processing.attention import value_bias_through_output

    g = torch.Generator().manual_seed(0)
    W_O = torch.randn(4, 48, 100, dtype=torch.float64, generator=g)
    b_V = torch.randn(kv_heads, 48, dtype=torch.float64, generator=g)
    laid_out = W_O.transpose(0, 1).contiguous().transpose(0, 1)
    assert not laid_out.is_contiguous()
    assert torch.equal(value_bias_through_output(b_V, laid_out), value_bias_through_output(b_V, W_O))


def test_recycling_reuses_a_map_only_once_no_tensor_uses_it():
    """Within :func:`recycling`, a new tensor takes the map of an earlier one of the same size in
    bytes once every view of it is gone, and not before, as it was left."""
    from circuitmath._processing._memory import recycling

    shape, cpu = (HUGE_PAGE_MIN_BYTES // 4,), torch.device("cpu")
    with recycling():
        first = new_tensor(shape, torch.float32, cpu).fill_(3.0)
        address, view = first.data_ptr(), first[1:]
        del first
        while_viewed = new_tensor(shape, torch.float32, cpu)
        other_size = new_tensor((shape[0] + 1024,), torch.float32, cpu)
        assert while_viewed.data_ptr() != address and other_size.data_ptr() != address
        assert float(view[-1]) == 3.0
        del view
        again = new_tensor((2, shape[0] // 4), torch.float64, cpu)  # the same bytes, any shape and dtype
        assert again.data_ptr() == address and float(again.view(torch.float32)[-1, -1]) == 3.0


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no huge-page advice here")
def test_checks_map_their_tensors_without_the_huge_page_advice(monkeypatch):
    """The tensors a check replays live as long as the check: they are mapped without the advice,
    in diagnose and check_model; process_weights' own outputs are advised (the control)."""
    import mmap

    import circuitmath as cm
    from circuitmath import _diagnosis
    from circuitmath._processing import _memory

    advised = []

    class Spied(mmap.mmap):
        def madvise(self, option, *args):
            advised.append(option)
            return super().madvise(option, *args)

    monkeypatch.setattr(_memory.mmap, "mmap", Spied)
    monkeypatch.setattr(_memory, "HUGE_PAGE_MIN_BYTES", 256)  # the small model's tensors mapped
    cfg = cm.Config(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=40, n_ctx=8, d_mlp=64)
    model = cm.random_state_dict(cfg, seed=0, dtype=torch.float32)
    processed, processed_cfg = cm.process_weights(model, cfg)
    assert mmap.MADV_HUGEPAGE in advised
    advised.clear()
    assert _diagnosis.diagnose(model, processed, cfg, after_cfg=processed_cfg).ok
    assert _diagnosis.check_model(model, cfg).ok
    assert not advised
    with _memory.recycling():
        new_tensor((1024,), torch.float32, "cpu")
    assert advised == [mmap.MADV_HUGEPAGE]
