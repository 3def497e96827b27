"""The page store: a file on the NVMe drive holding sealed pages beyond the in-memory pool ([R-kinds-and-tiers]).

Why a file and not host memory: on a Jetson CPU and GPU share one DRAM, so offloading to "host" buys nothing; the
tier below DRAM is the drive (2-3 GB/s on Orin dev kits). Records stay in memory (the pool's summary tensors),
so selection still scores every page; only the pages it names are read back (tier.py).

Layout: block b holds one page of every paged layer; layer l of block b starts at (b * layers + l) * layer_bytes
and is that layer's K [Hkv, P, D] then V [Hkv, P, D] as the pool stores them (int8 pools: the codes, then the K and
V scales [Hkv, P] fp32), padded to a multiple of 4 KiB (the drive's block). A page is written once, with one
pwritev over all its layers, when it leaves the pool; one layer of it is read with one preadv when that layer's
selection names it, the misses of one selection announced to the kernel together first (read_layers). The file is
created at startup at full size (posix_fallocate: no surprise ENOSPC later) and removed when the store is closed or
the process exits.
"""

from __future__ import annotations

import errno
import os
import time
import weakref
import zlib
from typing import Callable, Sequence

import numpy as np

from oval_edge.units import format_bytes

ALIGN = 4096
# File systems that live in RAM (or in compressed RAM): a store there takes the very memory it exists to save.
RAM_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")
# (operation 'read' | 'write', block) -> None; raise OSError to simulate a failing drive (tests)
IOHook = Callable[[str, int], None]


class StoreError(OSError):
    """A store read or write failed (the request that needed it fails; the pool and other requests go on)."""


def mount_of(path: str) -> tuple[str, str, str]:
    """(mount point, file system type, source device) of the mount holding `path` (/proc/self/mountinfo)."""
    real = os.path.realpath(path)
    best = ("/", "unknown", "unknown")
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = left.split()[4].replace("\\040", " ")
                fstype, source = (right.split() + ["", ""])[:2]
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, fstype, source)
    except OSError:  # no procfs (not Linux): nothing to refuse on
        pass
    return best


def check_store_path(path: str, size_bytes: int) -> str:
    """The file path the store will create, or ValueError saying what to change: the path must be on a real drive
    (not tmpfs / ramfs / zram), its folder writable, the file new, and the drive must have `size_bytes` free."""
    if os.path.isdir(path):
        path = os.path.join(path, f"oval-edge-kv-{os.getpid()}.store")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"kv_store={path!r}: the folder {folder!r} does not exist; create it or pick a path on "
                         "the NVMe drive")
    if os.path.exists(path):
        raise ValueError(f"kv_store={path!r} already exists (a store from a run that did not exit cleanly, or "
                         "another file); remove it or choose another path")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"kv_store={path!r}: {folder!r} is not writable by this user; choose a writable folder")
    point, fstype, source = mount_of(folder)
    if fstype in RAM_FILESYSTEMS or os.path.basename(source).startswith("zram"):
        raise ValueError(f"kv_store={path!r} is on {fstype} ({source}, mounted at {point}), which lives in RAM: "
                         "the store would take the memory it exists to save; put it on the NVMe drive")
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    if free < size_bytes:
        raise ValueError(f"kv_store={path!r}: {format_bytes(free)} free on {point}, the store needs "
                         f"{format_bytes(size_bytes)}; lower kv_store_size or free space")
    return path


def layer_bytes_for(kv_heads: int, page_size: int, head_dim: int, element_bytes: int, int8: bool) -> int:
    """Bytes one page of one layer takes in the store: K and V (+ their int8 scales), padded to 4 KiB."""
    rows = kv_heads * page_size
    raw = 2 * rows * head_dim * element_bytes + (2 * rows * 4 if int8 else 0)
    return -(-raw // ALIGN) * ALIGN


def _remove(fd: int, path: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.unlink(path)
    except OSError:
        pass


class PageStore:
    """A fixed-size file of page blocks. Knows bytes and blocks, not sequences (tier.py owns those)."""

    def __init__(self, path: str, size_bytes: int, layer_bytes: int, layers: int, checksums: bool = False,
                 io_hook: IOHook | None = None) -> None:
        if layer_bytes <= 0 or layer_bytes % ALIGN:
            raise ValueError(f"layer_bytes={layer_bytes} must be a positive multiple of {ALIGN}")
        self.block_bytes = layer_bytes * layers
        if size_bytes < self.block_bytes:
            raise ValueError(f"kv_store_size={format_bytes(size_bytes)} holds no page; one page of this model "
                             f"takes {format_bytes(self.block_bytes)} in the store")
        self.path = check_store_path(path, size_bytes)
        self.layer_bytes, self.layers = layer_bytes, layers
        self.blocks = size_bytes // self.block_bytes
        self.size_bytes = self.blocks * self.block_bytes
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._cleanup = weakref.finalize(self, _remove, self.fd, self.path)
        try:
            os.posix_fallocate(self.fd, 0, self.size_bytes)
        except OSError as e:
            self.close()
            raise ValueError(f"kv_store={self.path!r}: could not reserve {format_bytes(self.size_bytes)} ({e}); "
                             "lower kv_store_size or choose another drive") from e
        self.mount = mount_of(self.path)
        # debug mode: crc32 of every (block, layer) written, checked on every read
        self.checksums: np.ndarray | None = np.zeros((self.blocks, layers), dtype=np.uint32) if checksums else None
        self.io_hook = io_hook
        self._zeros = memoryview(bytearray(layer_bytes))
        self.bytes_read = self.bytes_written = self.reads = self.writes = 0
        self.read_throughput: float | None = None  # bytes/s, from measure_read

    def offset(self, block: int, layer: int = 0) -> int:
        return (block * self.layers + layer) * self.layer_bytes

    def write_block(self, block: int, layers: Sequence[Sequence[memoryview]]) -> None:
        """Write one page: `layers[l]` are the buffers of layer l, in order (each layer's total <= layer_bytes)."""
        self._check(block, "write")
        iov = []
        for l, buffers in enumerate(layers):
            iov.extend(buffers)
            used = sum(b.nbytes for b in buffers)
            if used < self.layer_bytes:  # the padding up to the 4 KiB boundary
                iov.append(self._zeros[: self.layer_bytes - used])
            if self.checksums is not None:
                self.checksums[block, l] = _crc(buffers)
        self._io(os.pwritev, iov, self.offset(block), self.block_bytes, "write", block)
        self.bytes_written += self.block_bytes
        self.writes += 1

    def read_layer(self, block: int, layer: int, buffers: Sequence[memoryview]) -> None:
        """Read layer `layer` of one page into `buffers` (the same shapes it was written from)."""
        self._check(block, "read")
        want = sum(b.nbytes for b in buffers)
        self._io(os.preadv, list(buffers), self.offset(block, layer), want, "read", block)
        self.bytes_read += want
        self.reads += 1
        if self.checksums is not None and _crc(buffers) != self.checksums[block, layer]:
            raise StoreError(errno.EIO, f"page store {self.path}: block {block} layer {layer} read back differs "
                             "from what was written (checksum); the drive or file is corrupt")

    def read_layers(self, reads: Sequence[tuple[int, int, Sequence[memoryview]]]) -> None:
        """Several page-layers at once: [(block, layer, buffers)]. Why: one preadv waits for its read before the
        next starts (queue depth 1); asking the kernel for every range first (POSIX_FADV_WILLNEED starts their
        reads, not waiting) lets the drive serve them concurrently, and the preadvs then copy what arrived.
        Measured by `oval-edge store-check --tasks io` (tools/store_check/io_compare.py)."""
        if len(reads) > 1:
            for block, layer, buffers in reads:  # a hint: read_layer below checks the block and reports errors
                os.posix_fadvise(self.fd, self.offset(block, layer), sum(b.nbytes for b in buffers),
                                 os.POSIX_FADV_WILLNEED)
        for block, layer, buffers in reads:
            self.read_layer(block, layer, buffers)

    def _check(self, block: int, op: str) -> None:
        if not 0 <= block < self.blocks:
            raise IndexError(f"store block {block} out of range [0, {self.blocks})")
        if self.io_hook is not None:
            try:
                self.io_hook(op, block)
            except OSError as e:
                raise StoreError(e.errno or errno.EIO, f"page store {self.path}: {op} of block {block} failed: "
                                 f"{e.strerror or e}") from e

    def _io(self, call, iov, offset: int, want: int, op: str, block: int) -> None:
        try:
            done = call(self.fd, iov, offset)
        except OSError as e:
            raise StoreError(e.errno or errno.EIO, f"page store {self.path}: {op} of block {block} failed: "
                             f"{e.strerror or e}") from e
        if done < want:
            raise StoreError(errno.EIO, f"page store {self.path}: short {op} of block {block} ({done} of {want} "
                             "bytes)")

    def measure_read(self, nbytes: int = 32 << 20) -> float:
        """Read throughput of the drive in bytes/s: write `nbytes` (capped by the store), flush them out of the page
        cache, time reading them back in layer-sized reads. Run once at startup, before any page is stored."""
        n = min(nbytes, self.size_bytes) // self.layer_bytes * self.layer_bytes
        chunk = np.random.default_rng(0).integers(0, 255, size=self.layer_bytes, dtype=np.uint8)
        for off in range(0, n, self.layer_bytes):
            os.pwrite(self.fd, chunk, off)
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, n, os.POSIX_FADV_DONTNEED)  # read from the drive, not from RAM
        buf = bytearray(self.layer_bytes)
        start = time.perf_counter()
        for off in range(0, n, self.layer_bytes):
            os.preadv(self.fd, [buf], off)
        seconds = time.perf_counter() - start
        os.posix_fadvise(self.fd, 0, n, os.POSIX_FADV_DONTNEED)
        self.read_throughput = n / seconds if seconds > 0 else float("inf")
        return self.read_throughput

    def describe(self) -> str:
        point, fstype, source = self.mount
        return (f"{self.path} ({format_bytes(self.size_bytes)}, {self.blocks} pages of "
                f"{format_bytes(self.block_bytes)}; {fstype} on {source} at {point})")

    def close(self) -> None:
        """Close and remove the file (idempotent; also run at exit)."""
        self._cleanup()


def _crc(buffers: Sequence[memoryview]) -> int:
    crc = 0
    for b in buffers:
        crc = zlib.crc32(b, crc)
    return crc
