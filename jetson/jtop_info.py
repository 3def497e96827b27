"""Power mode, jetson_clocks and board from jtop (jetson-stats), when its service is running.

jtop is a client of the `jtop.service` daemon, reached through the UNIX socket /run/jtop.sock (jetson-stats
`jtop/service.py`, JTOP_PIPE). Without the socket, `jtop()` fails with "The jtop.service is not active", so the
socket is checked first and every failure becomes a plain "jtop not available: <reason>" string: the probe and
the planner work without it.

Shapes read (jetson-stats 4.x, `jtop/jtop.py`):
    jetson.stats  -> {..., 'jetson_clocks': 'ON'|'OFF', 'nvp model': '<NAME>', 'RAM': <fraction>, ...}
    jetson.board  -> {'hardware': {'Model', 'Module', 'P-Number', 'SoC', 'CUDA Arch BIN', 'L4T', 'Jetpack', ...},
                      'platform': {...}, 'libraries': {...}}
    jetson.memory -> {'RAM': {'tot': kB, 'used': kB, 'free', 'buffers', 'cached', 'shared', 'lfb'},
                      'SWAP': {...}, 'EMC': {'cur': kHz, 'max': kHz, ...}}
"""

from __future__ import annotations

import os
from dataclasses import dataclass

JTOP_SOCKET = ("run", "jtop.sock")


@dataclass(frozen=True)
class JtopInfo:
    nvpmodel: str | None
    jetson_clocks: bool | None
    model: str | None
    module: str | None  # jtop's module name, e.g. "NVIDIA Jetson Orin Nano (4GB ram)"
    p_number: str | None  # e.g. "p3767-0004"
    l4t: str | None
    jetpack: str | None
    cuda_arch: str | None
    ram_total_kib: int | None
    ram_used_kib: int | None
    emc_max_khz: int | None

    def describe(self) -> str:
        clocks = {True: "on", False: "off", None: "unknown"}[self.jetson_clocks]
        return (
            f"jtop: {self.module or self.model or 'unknown module'} ({self.p_number or '?'}), power mode "
            f"{self.nvpmodel or '?'}, jetson_clocks {clocks}, L4T {self.l4t or '?'} / JetPack {self.jetpack or '?'}"
        )


def summarize_jtop(stats: dict, board: dict, memory: dict | None = None) -> JtopInfo:
    """Pick what the planner uses out of jtop's stats / board / memory dicts (missing keys -> None)."""
    hardware = (board or {}).get("hardware", {}) or {}
    clocks = stats.get("jetson_clocks")
    ram = (memory or {}).get("RAM", {}) or {}
    emc = (memory or {}).get("EMC", {}) or {}
    return JtopInfo(
        nvpmodel=str(stats["nvp model"]).strip() if stats.get("nvp model") is not None else None,
        jetson_clocks=_on_off(clocks),
        model=hardware.get("Model"),
        module=hardware.get("Module"),
        p_number=hardware.get("P-Number"),
        l4t=hardware.get("L4T"),
        jetpack=hardware.get("Jetpack"),
        cuda_arch=hardware.get("CUDA Arch BIN"),
        ram_total_kib=ram.get("tot"),
        ram_used_kib=ram.get("used"),
        emc_max_khz=emc.get("max"),
    )


def _on_off(value) -> bool | None:
    # stats says 'ON'/'OFF'; jetson.jetson_clocks is an object that converts to bool
    if value is None:
        return None
    return value.strip().upper() == "ON" if isinstance(value, str) else bool(value)


def read_jtop(root: str = "/") -> JtopInfo | str:
    """JtopInfo from the running service, or the string 'jtop not available: <reason>'."""
    socket_path = os.path.join(root, *JTOP_SOCKET)
    if not os.path.exists(socket_path):
        return (
            f"jtop not available: its service socket {socket_path} does not exist "
            "(install jetson-stats: `sudo pip3 install jetson-stats`, then `sudo systemctl restart jtop.service`)"
        )
    try:
        from jtop import jtop  # jetson-stats; optional dependency, imported only here
    except ImportError as exc:
        return f"jtop not available: the jetson-stats Python package is not importable here ({exc})"
    try:
        with jtop() as jetson:
            if not jetson.ok():
                return "jtop not available: the service answered but sent no data"
            return summarize_jtop(jetson.stats, jetson.board, jetson.memory)
    except Exception as exc:  # JtopException for version mismatch / permissions; the message says which
        return f"jtop not available: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
