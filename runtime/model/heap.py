"""The process heap around model loading and prefill: glibc's allocator kept compact and trimmed (no-ops elsewhere).

The loader streams hundreds of MB of transient tensors through the allocator and the engine frees tens of MB per
prefill chunk; without this the freed pages stay resident, which wastes a Jetson's shared memory and inflates the
reserve the pool is sized against.
"""

from __future__ import annotations

import ctypes
import functools
import gc
from contextlib import contextmanager


def return_freed_memory() -> None:
    """Give the heap freed after loading (full-precision tensors, GGUF buffers) back to the OS.

    glibc keeps freed arenas mapped; without this the process's RSS stays at the load-time peak, which would
    both waste a Jetson's shared memory and inflate the reserve the pool is sized against.
    """
    gc.collect()
    release_heap()


# glibc mallopt parameters and the values used around a load (see compact_heap_while_loading).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LOAD_MMAP_THRESHOLD = 1 << 20
SERVE_MMAP_THRESHOLD = 32 << 20  # the ceiling glibc's own dynamic threshold rises to on 64-bit systems
SERVE_TRIM_THRESHOLD = 64 << 20  # twice that, as glibc's dynamic scheme sets it


@contextmanager
def compact_heap_while_loading():
    """While a model loads, allocations of 1 MB or more get mappings of their own (returned to the OS when freed).

    Loading streams hundreds of MB of transient tensors (dequantized GGUF chunks, 16-bit layer copies) through the
    allocator. From its heap they would leave it hundreds of MB large around ~150 MB of live objects; trimmed, those
    free pages stop counting, but every later allocation that lands in them touches fresh pages, and a prefill
    chunk's 30 layers wandered over tens of MB that way (8k peak RSS 660 vs 635 MB with the heap kept compact).
    Afterwards the thresholds are fixed where glibc's dynamic scheme would take them (32 MB / 64 MB), so a decode
    step's multi-MB temporaries stay in the heap instead of page-faulting on every step.
    """
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, SERVE_TRIM_THRESHOLD)


@functools.cache  # one dlopen handle for the process: release_heap runs per prefill chunk and per loaded layer
def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (musl, macOS): the allocator is left alone
        return None


def release_heap() -> None:
    """malloc_trim(0): return free heap pages to the OS (no garbage collection; ~0.1 ms here).

    A long prompt's prefill allocates and frees tens of MB per chunk (history K/V in fp32, MLP rows); glibc serves
    them from its heap once its dynamic mmap threshold has risen, and keeps the freed pages resident.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
