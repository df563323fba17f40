"""Which tensors new_tensor backs with huge-page-advised memory, pinned at the threshold."""

import mmap

import pytest
import torch

from circuitmath._processing._memory import HUGE_PAGE_MIN_BYTES, SCRATCH_MIN_BYTES, new_tensor, scratch


def _mapped(tensor: torch.Tensor) -> bool:
    """A tensor over an mmap buffer (torch.frombuffer) cannot resize its storage."""
    try:
        tensor.untyped_storage().resize_(tensor.untyped_storage().nbytes() + 8)
    except RuntimeError:
        return True
    return False


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_tensors_from_the_threshold_up_are_mapped_and_smaller_ones_are_not():
    count = HUGE_PAGE_MIN_BYTES // 4
    assert _mapped(new_tensor((count,), torch.float32, "cpu"))
    assert not _mapped(new_tensor((count - 1,), torch.float32, "cpu"))


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_scratch_is_mapped_from_its_threshold_up():
    count = SCRATCH_MIN_BYTES // 4
    assert SCRATCH_MIN_BYTES < HUGE_PAGE_MIN_BYTES
    assert _mapped(scratch((count,), torch.float32, "cpu"))
    assert not _mapped(scratch((count - 1,), torch.float32, "cpu"))
    assert not _mapped(new_tensor((count,), torch.float32, "cpu"))  # an output below the huge-page threshold
