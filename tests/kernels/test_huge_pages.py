"""Weights on huge pages (kernels/huge_pages.py) and the arena that puts them there
(kernels/dense/layer.py pack_contiguous).

Whether the kernel grants 2 MiB pages depends on the machine's THP setting and free memory,
so no test asserts that it did. What is deterministic is asserted: the memory is zero-filled,
aligned and writable, it outlives every Python reference but the tensor's own, the mapping
carries the MADV_HUGEPAGE advice (VmFlags `hg`, read here from /proc/self/smaps, independently
of the module's own parser) wherever the kernel has THP, and moving weights into the arena
keeps every tensor's identity and every bit of its value.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kernels.dense.layer import pack_contiguous
from kernels.huge_pages import HUGE_PAGE, huge_page_bytes, huge_page_empty
from tests.support.huge_pages import THP, mapping_flags


def test_zero_filled_aligned_writable_and_advised() -> None:
    buf = huge_page_empty(3 * HUGE_PAGE + 12345)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 12345
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert buf.untyped_storage().nbytes() == buf.numel()  # what byte counts read
    assert int(buf.count_nonzero()) == 0
    buf.fill_(7)
    assert int(buf.sum()) == 7 * buf.numel()
    if THP:
        assert "hg" in mapping_flags(buf.data_ptr())
    got = huge_page_bytes(buf)
    assert 0 <= got <= buf.numel()


def test_a_view_keeps_the_mapping_alive() -> None:
    buf = huge_page_empty(HUGE_PAGE)
    tail = buf[-64:]
    del buf
    gc.collect()
    tail.fill_(3)  # would fault if the mapping had gone with the last Python reference
    assert tail.tolist() == [3] * 64


def test_ordinary_memory_and_bad_sizes() -> None:
    assert 0 <= huge_page_bytes(torch.ones(16)) <= 64
    assert huge_page_empty(0).numel() == 0 and pack_contiguous([None]) == 0
    with pytest.raises(ValueError, match="negative"):
        huge_page_empty(-1)


def test_pack_contiguous_keeps_identity_and_bits() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(torch.bfloat16),
                                  requires_grad=False)
               for shape in [(33, 17), (5,), (64, 576)]]
    ints = torch.randint(-128, 127, (7, 9), generator=gen, dtype=torch.int8)
    tensors: list[torch.Tensor | None] = [weights[0], None, ints, weights[1], weights[2]]
    before = [t.clone() for t in tensors if t is not None]
    ids = [id(t) for t in tensors]
    size = pack_contiguous(tensors)
    assert [id(t) for t in tensors] == ids
    live = [t for t in tensors if t is not None]
    for old, new in zip(before, live, strict=True):
        assert new.dtype == old.dtype and new.shape == old.shape
        assert torch.equal(new, old)
        assert new.data_ptr() % 64 == 0
    # One buffer, in list order, each tensor 64-byte aligned.
    starts = [t.data_ptr() for t in live]
    assert starts == sorted(starts)
    assert starts[-1] + live[-1].numel() * live[-1].element_size() <= starts[0] + size
    if THP:
        assert "hg" in mapping_flags(starts[0])


def test_pack_contiguous_rejects_shared_or_strided() -> None:
    t = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="twice"):
        pack_contiguous([t, t])
    with pytest.raises(ValueError, match="contiguous"):
        pack_contiguous([torch.zeros(4, 4).t()])
