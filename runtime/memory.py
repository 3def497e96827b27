"""Memory figures the engine sizes its pool from: measured process memory and the prefill workspace."""

from __future__ import annotations

import ctypes
import gc
import os

import torch

from oval_edge.geometry import KVGeometry


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


def available_bytes(device: torch.device) -> int:
    """Memory a new pool may take from: free device memory on CUDA, MemAvailable on the host otherwise."""
    if device.type == "cuda" and not torch.cuda.get_device_properties(device).is_integrated:
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


def prefill_workspace_bytes(
    hidden: int, intermediate: int, q_heads: int, geometry: KVGeometry, chunk: int, context: int, act_bytes: int
) -> int:
    """Transient memory of one prefill chunk of `chunk` tokens against `context` cached tokens.

    Largest live set in a layer: the residual + normed input + q/k/v/o (≈ 6 x hidden), the MLP's gate/up/act
    (3 x intermediate), the K/V of the whole context gathered for the chunk (2 x kv_heads x context x D, fp32),
    and the attention scores when the kernel materialises them (q_heads x chunk x context, fp32).
    """
    per_token = (6 * hidden + 3 * intermediate) * act_bytes
    gathered = 2 * geometry.kv_heads * context * geometry.head_dim * 4
    scores = q_heads * chunk * context * 4
    return chunk * per_token + gathered + scores


def return_freed_memory() -> None:
    """Give the heap freed after loading (full-precision tensors, GGUF buffers) back to the OS.

    glibc keeps freed arenas mapped; without this the process's RSS stays at the load-time peak, which would
    both waste a Jetson's shared memory and inflate the reserve the pool is sized against.
    """
    gc.collect()
    release_heap()


def release_heap() -> None:
    """malloc_trim(0): return free heap pages to the OS (no garbage collection; ~0.1 ms here).

    A long prompt's prefill allocates and frees tens of MB per chunk (history K/V in fp32, MLP rows); glibc serves
    them from its heap once its dynamic mmap threshold has risen, and keeps the freed pages resident.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass
