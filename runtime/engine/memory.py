"""Memory figures the engine sizes its pool from, measured now: this process's resident memory and what a new
pool may take. torch is imported only for CUDA devices (the bench's llama.cpp worker reads its RSS here too)."""

from __future__ import annotations

import os


def process_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 where it cannot be read)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM)."""
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    try:
        with open(f"/proc/{os.getpid()}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_bytes(device) -> int:
    """Memory a new pool may take from (device: a torch.device): free device memory on CUDA, MemAvailable on the
    host otherwise."""
    if device.type == "cuda":
        import torch

        if not torch.cuda.get_device_properties(device).is_integrated:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free)
    # Host memory, and Jetson's unified memory: cudaMemGetInfo reports MemFree there and hides reclaimable
    # page cache, so MemAvailable is the figure a pool can really take.
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
