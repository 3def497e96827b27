"""/proc/meminfo, read the way a unified-memory budget needs it.

Why MemAvailable is the budget on a Jetson (and not what CUDA reports):
  * The Orin GPU has no memory of its own: CPU and GPU allocate from the same LPDDR5. On such integrated GPUs
    `cudaMemGetInfo` (torch.cuda.mem_get_info) reports the kernel's *MemFree* as "free", and MemFree does not
    count the page cache the kernel would drop on demand. After reading a model file the cache holds gigabytes,
    so MemFree says "almost full" while the memory is in fact available (see ollama/ollama#12283; vLLM and
    SGLang read host available memory instead when `torch.cuda.get_device_properties().is_integrated`).
    MemAvailable is the kernel's own estimate of what can be allocated without swapping: free + reclaimable
    cache and slab, minus the low watermarks.
  * GPU allocations are pinned physical pages (nvmap / nvgpu): they cannot be swapped out. SwapFree therefore
    never adds to what the model, the workspace and the KV pool can use; swap only relieves *other* processes.
  * NvMapMemUsed (when the kernel reports it, i.e. the in-tree nvmap driver of L4T R32-R35) is what the GPU and
    other engines hold right now; it is shown for diagnosis, it is already inside MemTotal - MemAvailable.
    L4T R36 (out-of-tree nvgpu/nvmap modules) no longer prints it, so it is optional.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_LINE = re.compile(r"^(?P<key>[^:\s]+):\s+(?P<value>\d+)(?:\s+(?P<unit>kB))?\s*$")


@dataclass(frozen=True)
class MemInfo:
    """Byte counts from /proc/meminfo (the file says kB; it means KiB)."""

    total: int
    available: int
    free: int
    swap_total: int
    swap_free: int
    nvmap_used: int | None  # None: the kernel does not print NvMapMemUsed (L4T R36, non-Jetson hosts)
    source: str

    @property
    def used(self) -> int:
        return self.total - self.available

    def describe(self) -> str:
        nvmap = "n/a (not reported by this kernel)" if self.nvmap_used is None else f"{self.nvmap_used / 2**30:.2f} GiB"
        return (
            f"MemTotal {self.total / 2**30:.2f} GiB, MemAvailable {self.available / 2**30:.2f} GiB, "
            f"MemFree {self.free / 2**30:.2f} GiB, NvMapMemUsed {nvmap}, "
            f"swap {self.swap_free / 2**30:.2f}/{self.swap_total / 2**30:.2f} GiB free (GPU memory never swaps)"
        )


def parse_meminfo(text: str, source: str = "/proc/meminfo") -> MemInfo:
    values: dict[str, int] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            scale = 1024 if m.group("unit") else 1
            values[m.group("key")] = int(m.group("value")) * scale
    if "MemTotal" not in values:
        raise ValueError(f"{source} has no MemTotal line; is it a Linux /proc/meminfo?")
    if "MemAvailable" in values:
        available = values["MemAvailable"]
    else:  # kernels before 3.14: approximate as the kernel later defined it (free + reclaimable cache)
        available = values.get("MemFree", 0) + values.get("Cached", 0) + values.get("SReclaimable", 0)
    return MemInfo(
        total=values["MemTotal"],
        available=available,
        free=values.get("MemFree", 0),
        swap_total=values.get("SwapTotal", 0),
        swap_free=values.get("SwapFree", 0),
        nvmap_used=values.get("NvMapMemUsed"),
        source=source,
    )


def read_meminfo(root: str = "/") -> MemInfo:
    path = os.path.join(root, "proc", "meminfo")
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return parse_meminfo(handle.read(), path)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
