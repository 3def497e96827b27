"""Which Jetson this is: the L4T release (/etc/nv_tegra_release) and the module (/proc/device-tree).

Formats, as the boards write them:
  /etc/nv_tegra_release, first line, e.g.
      # R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025
      # R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: Tue Aug  1 19:57:35 UTC 2023
    (R36 adds lines such as "# KERNEL_VARIANT: oot" and TARGET_USERSPACE_LIB_DIR=...). jetson-stats notes the
    BOARD field is not a reliable SoC name, so it is kept as text only.
  /proc/device-tree/model: one NUL-terminated string, e.g. "NVIDIA Jetson Orin Nano Developer Kit\\0". Developer
    kit names do not say the memory size (an "Orin NX ... Developer Kit" may carry 8 or 16 GB), so the size comes
    from the part number in /proc/device-tree/compatible ("nvidia,p3768-0000+p3767-0005-super\\0...") when
    present, else from MemTotal.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .modules import ORIN_MODULES, ModuleSpec, module_for_part

# JetPack release for an L4T release (NVIDIA's JetPack archive, as tabulated by jetson-stats).
JETPACK_FOR_L4T = {
    "35.1.0": "5.0.2", "35.2.1": "5.1", "35.3.1": "5.1.1", "35.4.1": "5.1.2", "35.5.0": "5.1.3", "35.6.0": "5.1.4",
    "36.2.0": "6.0 DP", "36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2", "36.4.4": "6.2.1", "36.4.7": "6.2.1",
}
_RELEASE = re.compile(r"#\s*R(?P<major>\d+)\s*\(release\),\s*REVISION:\s*(?P<rev>[\d.]+)")
_FIELD = re.compile(r"(?P<key>GCID|BOARD|EABI|DATE):\s*(?P<value>[^,]+)")
_PART = re.compile(r"p(3767|3701)-\d{4}")


@dataclass(frozen=True)
class L4TRelease:
    major: int  # 36
    revision: str  # "4.3"
    board: str | None
    date: str | None
    raw: str

    @property
    def version(self) -> str:
        rev = self.revision if self.revision.count(".") >= 1 else f"{self.revision}.0"
        return f"{self.major}.{rev}"

    @property
    def jetpack(self) -> str | None:
        return JETPACK_FOR_L4T.get(self.version)


def parse_nv_tegra_release(text: str, source: str = "/etc/nv_tegra_release") -> L4TRelease:
    first = text.strip().splitlines()[0] if text.strip() else ""
    m = _RELEASE.search(first)
    if not m:
        raise ValueError(f"{source}: first line {first!r} is not '# R<major> (release), REVISION: <x.y>, ...'")
    fields = {f.group("key"): f.group("value").strip() for f in _FIELD.finditer(first)}
    return L4TRelease(int(m.group("major")), m.group("rev"), fields.get("BOARD"), fields.get("DATE"), first)


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def read_l4t(root: str = "/") -> L4TRelease | None:
    text = _read(os.path.join(root, "etc", "nv_tegra_release"))
    return None if text is None else parse_nv_tegra_release(text, os.path.join(root, "etc", "nv_tegra_release"))


def read_model(root: str = "/") -> str | None:
    """/proc/device-tree/model without its trailing NUL (None when there is no device tree)."""
    text = _read(os.path.join(root, "proc", "device-tree", "model"))
    return None if text is None else text.split("\0", 1)[0].strip()


def read_compatible(root: str = "/") -> list[str]:
    text = _read(os.path.join(root, "proc", "device-tree", "compatible"))
    return [s for s in (text or "").split("\0") if s]


@dataclass(frozen=True)
class ModuleMatch:
    module: ModuleSpec | None
    how: str  # how it was identified, for the report


def identify_module(
    model: str | None,
    compatible: list[str],
    mem_total: int | None,
    power_mode: str | None = None,
    p_number: str | None = None,
) -> ModuleMatch:
    """Map what the board says about itself to a table entry.

    Order: an explicit part number (jtop reads the EEPROM), the part number in the device-tree compatible list,
    then the model name plus the memory size. "Super" (JetPack 6.2 modes on an Orin Nano) comes from the device
    tree ("-super" compatible, "... Super" model) or from a super-only power mode name.
    """
    super_mode = bool(
        (model and "super" in model.lower())
        or any(c.endswith("-super") for c in compatible)
        # 25W and MAXN_SUPER exist on an Orin Nano only in the super nvpmodel files (only the Nano entry uses this)
        or (power_mode and power_mode.upper() in ("MAXN_SUPER", "25W"))
    )
    part = p_number
    if not part:
        for entry in compatible:  # carrier boards (p3768, p3737, p3509) do not match _PART; modules do
            found = _PART.search(entry)
            if found:
                part = found.group(0)
                break
    module = module_for_part(part, super_mode)
    if module is not None:
        return ModuleMatch(module, f"part number {part}" + (" (super modes)" if super_mode else ""))
    if model and mem_total:
        family = "orin-nano" if "orin nano" in model.lower() else "orin-nx" if "orin nx" in model.lower() else (
            "agx-orin" if "agx orin" in model.lower() else None
        )
        if family:
            candidates = [m for m in ORIN_MODULES if m.name.startswith(family)]
            if family == "orin-nano":
                candidates = [m for m in candidates if m.name.endswith("-super") == super_mode or "4gb" in m.name]
            # The module whose DRAM is the smallest one that still holds what the kernel sees.
            fitting = sorted((m for m in candidates if m.dram_bytes >= mem_total), key=lambda m: m.dram_bytes)
            if fitting:
                return ModuleMatch(fitting[0], f"model {model!r} with MemTotal {mem_total / 2**30:.2f} GiB")
    return ModuleMatch(None, f"model {model!r} is not an Orin module in the table")
