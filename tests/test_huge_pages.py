"""The pool's tensors on transparent huge pages (oval_edge/kv/huge_pages.py): same values and bytes as torch.full,
and, where the kernel's THP mode lets a process ask (madvise or always), really backed by 2 MiB pages."""
from pathlib import Path

import pytest
import torch

from oval_edge.kv.huge_pages import HUGE_PAGE, pool_tensor

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(text.split("AnonHugePages:")[1].split()[0])


@pytest.mark.parametrize("dtype,fill", [(torch.bfloat16, 0.0), (torch.float32, 1.0), (torch.int8, 0.0)])
def test_pool_tensor_is_torch_full(dtype, fill):
    for shape in [(3, 5), (2, 1 << 20)]:  # under and over one huge page
        got = pool_tensor(shape, dtype, "cpu", fill=fill)
        assert got.shape == shape and got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, torch.full(shape, fill, dtype=dtype))


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="this kernel offers no transparent huge pages")
def test_a_large_pool_tensor_sits_on_huge_pages():
    before = _anon_huge_kib()
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so freshly mapped, never-touched memory, as a pool is;
    # a smaller block may come from heap memory the process touched before, which the advice does not convert.
    tensor = pool_tensor((32 * HUGE_PAGE,), torch.uint8, "cpu")
    after = _anon_huge_kib()
    assert after - before >= 31 * HUGE_PAGE // 1024, (before, after)  # every whole aligned 2 MiB of it
    assert int(tensor.sum()) == 0
