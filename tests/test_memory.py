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
