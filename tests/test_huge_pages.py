"""The pool's tensors on transparent huge pages (oval_edge/kv/huge_pages.py): same values and bytes as torch.full,
and, where the kernel's THP mode lets a process ask (madvise or always), advised onto 2 MiB pages before first touch
(the kernel's flag on the mapping; a plain torch tensor has none)."""
from pathlib import Path

import pytest
import torch

from oval_edge.kv.huge_pages import HUGE_PAGE, pool_tensor

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.parametrize("dtype,fill", [(torch.bfloat16, 0.0), (torch.float32, 1.0), (torch.int8, 0.0)])
def test_pool_tensor_is_torch_full(dtype, fill):
    for shape in [(3, 5), (2, 1 << 20)]:  # under and over one huge page
        got = pool_tensor(shape, dtype, "cpu", fill=fill)
        assert got.shape == shape and got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, torch.full(shape, fill, dtype=dtype))


def _mapping_of(address: int) -> tuple[set[str], int]:
    """(VmFlags, AnonHugePages KiB) of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside, huge = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms offset dev inode path"
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            huge = int(line.split()[1])
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:]), huge
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="this kernel offers no transparent huge pages")
def test_a_large_pool_tensor_is_advised_onto_huge_pages():
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so freshly mapped, never-touched memory, as a pool is.
    tensor = pool_tensor((32 * HUGE_PAGE,), torch.uint8, "cpu")
    interior = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    flags, huge_kib = _mapping_of(interior)
    # "hg": the kernel recorded MADV_HUGEPAGE on the aligned interior before it was touched. Whether a fault then
    # finds free 2 MiB frames depends on the machine's memory fragmentation, not on this code (on a fresh machine
    # all 31 interior huge pages are backed: the CI of 2026-12-05 saw 31, and 19 on a fragmented one).
    assert "hg" in flags, flags
    assert huge_kib % (HUGE_PAGE // 1024) == 0
    assert int(tensor.sum()) == 0
