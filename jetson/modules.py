"""Jetson Orin modules (and the two non-Jetson targets) as the planner sees them: memory, bandwidth, GPU, power.

Sources (read for every figure below; nothing here is a guess unless it says "estimate"):
  * DRAM, bus width, peak bandwidth, CUDA/Tensor cores: NVIDIA "Jetson Orin Nano Series" module data sheet
    (Orin Nano 8GB: 8GB 128-bit LPDDR5 68 GB/s, 1024 CUDA cores; Orin Nano 4GB: 4GB 64-bit LPDDR5 34 GB/s,
    512 CUDA cores), NVIDIA "Jetson Orin NX Series" data sheet (8GB / 16GB 128-bit LPDDR5 102.4 GB/s, 1024
    CUDA cores), NVIDIA "Jetson AGX Orin Series" data sheet and technical brief v1.2 (32GB / 64GB 256-bit
    LPDDR5 204.8 GB/s; 1792 / 2048 CUDA cores, 128 per SM), NVIDIA "Jetson Orin Nano Super Developer Kit"
    data sheet (Dec 2024: same module, memory clock raised, 102 GB/s).
  * SM counts cross-checked against the TPC masks of the nvpmodel files NVIDIA ships per module
    (nvpmodel_p3767_000X[_super].conf, nvpmodel_p3701_000X.conf, as mirrored in LineageOS/
    android_device_nvidia_concord/nvpmodel): an Orin GPU has 8 TPCs of 2 SMs; MAXN masks 0 (AGX 64GB, 16 SMs),
    128 (AGX 32GB, 14 SMs), 240 (Orin NX / Orin Nano 8GB, 8 SMs), 252 (Orin Nano 4GB, 4 SMs).
  * Power modes: POWER_MODEL ID/NAME lines of those same nvpmodel files (`sudo nvpmodel -m ID` selects one).
  * OS reserve: see `_reserve`: carve-outs (DRAM the kernel never sees) from recorded MemTotal values plus the
    memory an idle JetPack install uses, from a recorded /proc/meminfo of an Orin Nano with the desktop running.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

GiB = 2**30
KiB = 2**10
ORIN_ARCH = "sm_87"  # every Orin module: Ampere GA10B, compute capability 8.7

# Recorded: Orin Nano (8GB module, L4T R36, 5.15.148-tegra, GNOME desktop running), /proc/meminfo at idle.
_NANO8_MEMTOTAL = 7802736 * KiB
_NANO8_MEMAVAILABLE = 6245596 * KiB
# The OS + desktop at idle take MemTotal - MemAvailable (page cache excluded: it is reclaimable).
OS_IDLE_WITH_DESKTOP = _NANO8_MEMTOTAL - _NANO8_MEMAVAILABLE  # 1.49 GiB
# NVIDIA jetson-containers setup guide: stopping the Ubuntu desktop "will free up ... around ~800MB for
# Unity/GNOME". Headless = the recorded idle use minus that.
GNOME_DESKTOP_BYTES = 800 * 10**6
OS_IDLE_HEADLESS = OS_IDLE_WITH_DESKTOP - GNOME_DESKTOP_BYTES


@dataclass(frozen=True)
class PowerMode:
    id: int  # `sudo nvpmodel -m <id>`
    name: str  # NAME= in the nvpmodel file, what `nvpmodel -q` and jtop print
    watts: int | None  # budget in the name; None for MAXN / MAXN_SUPER (no cap)


def _modes(*names: str) -> tuple[PowerMode, ...]:
    out = []
    for i, name in enumerate(names):
        m = re.search(r"(\d+)W", name)
        out.append(PowerMode(i, name, int(m.group(1)) if m else None))
    return tuple(out)


@dataclass(frozen=True)
class ModuleSpec:
    """One target the planner can size for. `bandwidth_gbps` is peak DRAM bandwidth in GB/s (10^9 B/s)."""

    name: str  # lookup key, e.g. "orin-nano-8gb"
    title: str
    kind: str  # "jetson" | "cuda" | "cpu"
    dram_bytes: int
    bandwidth_gbps: float | None
    bandwidth_note: str
    gpu_sms: int | None
    cuda_cores: int | None
    arch: str | None
    power_modes: tuple[PowerMode, ...] = ()
    super_power_modes: tuple[PowerMode, ...] = ()  # JetPack 6.2 "super" nvpmodel file, where one exists
    os_reserve_headless: int = 0
    os_reserve_desktop: int = 0
    reserve_note: str = ""
    p_numbers: tuple[str, ...] = ()  # module part numbers (device tree / EEPROM), e.g. "p3767-0003"
    unified_memory: bool = True
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def os_reserve(self, desktop: bool = False) -> int:
        return self.os_reserve_desktop if desktop else self.os_reserve_headless


def _reserve(dram: int, visible: int, how: str) -> dict:
    """OS reserve = carve-out (dram - kernel-visible MemTotal) + what the idle OS uses (headless / desktop)."""
    carve = dram - visible
    return {
        "os_reserve_headless": carve + OS_IDLE_HEADLESS,
        "os_reserve_desktop": carve + OS_IDLE_WITH_DESKTOP,
        "reserve_note": f"carve-out {(carve / GiB):.2f} GiB ({how}) + idle OS "
        f"{OS_IDLE_HEADLESS / GiB:.2f} GiB headless / {OS_IDLE_WITH_DESKTOP / GiB:.2f} GiB with the GNOME desktop",
    }


# Kernel-visible memory (MemTotal) per module: recorded where a recording exists, else labelled an estimate.
_VISIBLE = {
    "nano4": (3688892 * KiB, "recorded MemTotal, Orin Nano 4GB, L4T 36.4.3"),
    "nano8": (_NANO8_MEMTOTAL, "recorded MemTotal, Orin Nano 8GB, L4T R36"),
    # deviceQuery on an Orin NX 16GB (1024 cores @ 918 MHz) reports 15189422080 bytes of global memory, which is
    # MemTotal on an integrated GPU.
    "nx16": (15189422080, "recorded cudaMemGetInfo total, Orin NX 16GB"),
    # `free -h` on the 32GB AGX Orin developer kit prints 29Gi; 29 GiB is used (rounded recording).
    "agx32": (29 * GiB, "recorded `free -h` total (rounded), AGX Orin 32GB"),
}

_NANO_SOURCE = "Jetson Orin Nano Series data sheet"
_NX_SOURCE = "Jetson Orin NX Series data sheet"
_AGX_SOURCE = "Jetson AGX Orin Series data sheet / technical brief v1.2"

ORIN_MODULES: tuple[ModuleSpec, ...] = (
    ModuleSpec(
        "orin-nano-4gb", "Jetson Orin Nano 4GB", "jetson", 4 * GiB, 34.0, f"64-bit LPDDR5 ({_NANO_SOURCE})",
        4, 512, ORIN_ARCH,
        power_modes=_modes("10W", "7W_AI", "7W_CPU"),  # nvpmodel_p3767_0004.conf
        super_power_modes=_modes("10W", "25W", "MAXN_SUPER"),  # nvpmodel_p3767_0004_super.conf
        p_numbers=("p3767-0004",), **_reserve(4 * GiB, *_VISIBLE["nano4"]),
    ),
    ModuleSpec(
        "orin-nano-8gb", "Jetson Orin Nano 8GB", "jetson", 8 * GiB, 68.0, f"128-bit LPDDR5 ({_NANO_SOURCE})",
        8, 1024, ORIN_ARCH,
        power_modes=_modes("15W", "7W"),  # nvpmodel_p3767_0003.conf (0005 = developer kit module, same modes)
        p_numbers=("p3767-0003", "p3767-0005"), **_reserve(8 * GiB, *_VISIBLE["nano8"]),
    ),
    ModuleSpec(
        "orin-nano-8gb-super", "Jetson Orin Nano 8GB Super (JetPack 6.2 super modes)", "jetson", 8 * GiB, 102.0,
        "128-bit LPDDR5, memory clock raised by the super modes (Orin Nano Super Developer Kit data sheet)",
        8, 1024, ORIN_ARCH,
        power_modes=_modes("15W", "25W", "MAXN_SUPER"),  # nvpmodel_p3767_0003_super.conf
        p_numbers=("p3767-0003", "p3767-0005"), **_reserve(8 * GiB, *_VISIBLE["nano8"]),
    ),
    ModuleSpec(
        "orin-nx-8gb", "Jetson Orin NX 8GB", "jetson", 8 * GiB, 102.4, f"128-bit LPDDR5 ({_NX_SOURCE})",
        8, 1024, ORIN_ARCH,
        power_modes=_modes("MAXN", "10W", "15W", "20W"),  # nvpmodel_p3767_0001.conf
        super_power_modes=_modes("MAXN_SUPER", "10W", "15W", "20W", "40W"),  # nvpmodel_p3767_0001_super.conf
        p_numbers=("p3767-0001",),
        # No recording of an NX 8GB: the NX 16GB carve-out is used (same SoC configuration, DLA/PVA enabled).
        **_reserve(8 * GiB, 8 * GiB - (16 * GiB - _VISIBLE["nx16"][0]), "estimate: NX 16GB carve-out"),
    ),
    ModuleSpec(
        "orin-nx-16gb", "Jetson Orin NX 16GB", "jetson", 16 * GiB, 102.4, f"128-bit LPDDR5 ({_NX_SOURCE})",
        8, 1024, ORIN_ARCH,
        power_modes=_modes("MAXN", "10W", "15W", "25W"),  # nvpmodel_p3767_0000.conf
        super_power_modes=_modes("MAXN_SUPER", "10W", "15W", "25W", "40W"),  # nvpmodel_p3767_0000_super.conf
        p_numbers=("p3767-0000",), **_reserve(16 * GiB, *_VISIBLE["nx16"]),
    ),
    ModuleSpec(
        "agx-orin-32gb", "Jetson AGX Orin 32GB", "jetson", 32 * GiB, 204.8, f"256-bit LPDDR5 ({_AGX_SOURCE})",
        14, 1792, ORIN_ARCH,
        power_modes=_modes("MAXN", "MODE_15W", "MODE_30W", "MODE_40W"),  # nvpmodel_p3701_0004.conf
        p_numbers=("p3701-0004",), **_reserve(32 * GiB, *_VISIBLE["agx32"]),
    ),
    ModuleSpec(
        "agx-orin-64gb", "Jetson AGX Orin 64GB", "jetson", 64 * GiB, 204.8, f"256-bit LPDDR5 ({_AGX_SOURCE})",
        16, 2048, ORIN_ARCH,
        # nvpmodel_p3701_0000.conf: developer-kit module with the full 16-SM GPU of the 64GB module
        power_modes=_modes("MAXN", "MODE_15W", "MODE_30W", "MODE_50W"),
        p_numbers=("p3701-0005",),
        # No recording of a 64GB module: the 32GB module's carve-out is used.
        **_reserve(64 * GiB, 64 * GiB - (32 * GiB - _VISIBLE["agx32"][0]), "estimate: AGX 32GB carve-out"),
    ),
)

GENERIC_NAMES = ("cuda", "cpu")


def module_names() -> list[str]:
    return [m.name for m in ORIN_MODULES] + list(GENERIC_NAMES)


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def get_module(name: str, root: str = "/") -> ModuleSpec:
    """Orin module by name, or 'cuda' (this machine's CUDA device) / 'cpu' (this host). ValueError lists names."""
    key = _norm(name)
    for module in ORIN_MODULES:
        if module.name == key:
            return module
    if key == "cuda":
        return cuda_device()
    if key == "cpu":
        return cpu_host(root)
    raise ValueError(f"device {name!r} is unknown; known devices: {', '.join(module_names())} (or 'auto', 'all')")


def module_for_part(p_number: str | None, super_mode: bool = False) -> ModuleSpec | None:
    """The table entry for a module part number such as 'p3767-0005' (None if it is not an Orin in the table).

    The Orin Nano 8GB modules (p3767-0003 / -0005) have two entries; `super_mode` (the device tree or the power
    mode says JetPack 6.2 super) picks the faster one.
    """
    matches = [m for m in ORIN_MODULES if p_number and p_number in m.p_numbers]
    if len(matches) > 1:
        matches = [m for m in matches if m.name.endswith("-super") == super_mode] or matches
    return matches[0] if matches else None


def cuda_device(index: int = 0) -> ModuleSpec:
    """This machine's CUDA GPU from torch's device properties (torch imported here, never at module import)."""
    try:
        import torch
    except ImportError as exc:
        raise ValueError(f"device 'cuda' needs torch with CUDA ({exc}); use an Orin module name or 'cpu'") from exc
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda': torch sees no CUDA device; use an Orin module name (e.g. orin-nano-8gb) or 'cpu'")
    props = torch.cuda.get_device_properties(index)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:
        # Double data rate: two transfers per memory clock. Theoretical peak, not a measurement.
        bandwidth, note = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "theoretical: 2 x memory clock x bus width"
    else:
        bandwidth, note = None, "unknown: this torch does not report the memory clock / bus width"
    integrated = bool(getattr(props, "is_integrated", False))
    return ModuleSpec(
        "cuda", f"{props.name} (CUDA device {index})", "cuda", int(props.total_memory), bandwidth, note,
        props.multi_processor_count, None, f"sm_{props.major}{props.minor}", unified_memory=integrated,
        reserve_note="a discrete GPU's memory holds no OS; an integrated one shares DRAM (use an Orin name)",
    )


def cpu_host(root: str = "/") -> ModuleSpec:
    """This host's memory (MemTotal from <root>/proc/meminfo). DRAM bandwidth cannot be read from Linux."""
    from .meminfo import read_meminfo

    info = read_meminfo(root)
    flags = _cpu_flags(root)
    return ModuleSpec(
        "cpu", f"CPU host ({os.cpu_count() or '?'} CPUs{', AVX512-BF16' if 'avx512_bf16' in flags else ''})",
        "cpu", info.total, None, "unknown: Linux does not report DRAM bandwidth; pass --bandwidth GB/s",
        None, None, None, os_reserve_headless=max(info.total - info.available, 0),
        os_reserve_desktop=max(info.total - info.available, 0),
        reserve_note="what this host's other processes use now (MemTotal - MemAvailable)",
        unified_memory=True, extra={"cpu_flags": flags},
    )


def _cpu_flags(root: str) -> frozenset[str]:
    try:
        with open(os.path.join(root, "proc", "cpuinfo"), encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
