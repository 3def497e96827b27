"""What device is this, and how many bytes may a model server use on it right now?

    Jetson  (/etc/nv_tegra_release or a Jetson device-tree model): L4T release, module (table entry), jtop
            when its service runs, and MemAvailable from /proc/meminfo as the budget (see meminfo.py for why
            not cudaMemGetInfo).
    CUDA    torch.cuda.mem_get_info() on a discrete GPU; host MemAvailable on an integrated one (is_integrated).
    CPU     host MemAvailable.

Every reader takes `root` (default "/") so the tests point it at recorded files. torch is imported only inside
`probe_cuda`, never when this module is imported (the tests check that in a fresh interpreter).

Run `python -m oval_edge.jetson.probe [ROOT]` to print the probe of this machine.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from .jtop_info import JtopInfo, read_jtop
from .l4t import L4TRelease, identify_module, read_compatible, read_l4t, read_model
from .meminfo import MemInfo, read_meminfo
from .modules import ModuleSpec, cpu_host, cuda_device


@dataclass(frozen=True)
class DeviceProbe:
    kind: str  # "jetson" | "cuda" | "cpu"
    title: str
    module: ModuleSpec | None  # Orin table entry, or the spec built for this CUDA device / CPU host
    module_how: str
    l4t: L4TRelease | None
    model: str | None
    meminfo: MemInfo | None
    budget_bytes: int | None  # bytes a new process may take now; None when it could not be read
    budget_source: str
    jtop: JtopInfo | None
    jtop_status: str
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        lines = [f"device: {self.title} ({self.kind})"]
        if self.l4t:
            jp = f", JetPack {self.l4t.jetpack}" if self.l4t.jetpack else ""
            lines.append(f"L4T: R{self.l4t.version}{jp} (board {self.l4t.board or '?'})")
        if self.model:
            lines.append(f"model: {self.model}")
        if self.kind == "jetson":
            lines.append(f"module: {self.module.name if self.module else 'not identified'} ({self.module_how})")
        if self.meminfo:
            lines.append(f"memory: {self.meminfo.describe()}")
        budget = "unknown" if self.budget_bytes is None else f"{self.budget_bytes / 2**30:.2f} GiB"
        lines.append(f"budget now: {budget} ({self.budget_source})")
        if self.kind == "jetson":
            lines.append(self.jtop.describe() if self.jtop else self.jtop_status)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def is_jetson(root: str = "/") -> bool:
    if os.path.exists(os.path.join(root, "etc", "nv_tegra_release")):
        return True
    model = read_model(root) or ""
    return "jetson" in model.lower()


def probe_jetson(root: str = "/") -> DeviceProbe:
    notes: list[str] = []
    l4t = read_l4t(root)
    model = read_model(root)
    try:
        meminfo: MemInfo | None = read_meminfo(root)
    except ValueError as exc:
        meminfo = None
        notes.append(str(exc))
    jtop = read_jtop(root)
    jtop_info = jtop if isinstance(jtop, JtopInfo) else None
    match = identify_module(
        model,
        read_compatible(root),
        meminfo.total if meminfo else None,
        power_mode=jtop_info.nvpmodel if jtop_info else None,
        p_number=jtop_info.p_number if jtop_info else None,
    )
    if meminfo is None:
        budget, source = None, "/proc/meminfo unreadable"
    else:
        budget = meminfo.available
        source = (
            "MemAvailable: CPU and GPU share this DRAM; cudaMemGetInfo would report MemFree and hide the "
            "reclaimable page cache; GPU memory cannot swap, so swap is not counted"
        )
        if meminfo.nvmap_used is not None:
            notes.append(f"NvMapMemUsed {meminfo.nvmap_used / 2**30:.2f} GiB is held by the GPU/engines now")
    title = match.module.title if match.module else (model or "unknown Jetson")
    return DeviceProbe(
        "jetson", title, match.module, match.how, l4t, model, meminfo, budget, source, jtop_info,
        jtop_info.describe() if jtop_info else str(jtop), tuple(notes),
    )


def probe_cuda(root: str = "/", index: int = 0) -> DeviceProbe | None:
    """The CUDA device through torch (imported here), or None when torch or CUDA is missing."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    spec = cuda_device(index)
    props = torch.cuda.get_device_properties(index)
    meminfo = None
    if getattr(props, "is_integrated", False):
        # Integrated GPU (e.g. a Jetson inside a container without the L4T files): MemFree is what CUDA reports,
        # the host's MemAvailable is what can really be allocated.
        meminfo = read_meminfo(root)
        budget, source = meminfo.available, "integrated GPU: host MemAvailable (not cudaMemGetInfo)"
    else:
        free, _total = torch.cuda.mem_get_info(index)
        budget, source = int(free), "torch.cuda.mem_get_info() free bytes on this discrete GPU"
    return DeviceProbe("cuda", spec.title, spec, "torch device properties", None, None, meminfo, budget, source,
                       None, "jtop not available: not a Jetson")


def probe_cpu(root: str = "/") -> DeviceProbe:
    spec = cpu_host(root)
    meminfo = read_meminfo(root)
    return DeviceProbe("cpu", spec.title, spec, "host", None, None, meminfo, meminfo.available,
                       "host MemAvailable", None, "jtop not available: not a Jetson")


def probe(root: str = "/", use_torch: bool = True) -> DeviceProbe:
    """Jetson first (from files under `root`), then a CUDA device (torch), else this CPU host."""
    if is_jetson(root):
        return probe_jetson(root)
    if use_torch:
        found = probe_cuda(root)
        if found is not None:
            return found
    return probe_cpu(root)


if __name__ == "__main__":
    print(probe(sys.argv[1] if len(sys.argv) > 1 else "/").describe())
