"""The cache file: a safetensors file of raw storages (uint8), memory-mapped at load, each checked by its CRC32.

Layout (plain safetensors, readable by `safetensors.safe_open`): an 8-byte little-endian header length, the JSON
header padded with spaces so the data starts on a page (4096 bytes), then storage `s{i}` as a uint8 tensor padded
to a multiple of 64 bytes, so every tensor viewed into it starts 64-byte aligned as the CPU kernels' loads expect
(safetensors forbids holes between tensors, so the padding belongs to the tensor; the real size is in the
manifest). The header's `__metadata__` holds one string, `manifest`: JSON with the key, the module tree and, per
storage, its real size and CRC32.

Why CRC32 of each storage, checked at every load: a flipped or truncated byte must be caught, not served, and zlib's
CRC32 measured 0.42 s/GB on one core here (SHA-256 0.62, BLAKE2b 1.67); storages are checked on a thread pool (zlib
releases the GIL), so several cores share it. It guards against accidental damage only; a hostile file cannot run
code (no pickle, tree.py's allowlist) and anyone who can write it could also rewrite its checksums.

Loading maps the file copy-on-write (MAP_PRIVATE): the weights' pages are the page cache's, clean and reclaimable
under memory pressure (on a Jetson the GPU shares that memory), and nothing is read into anonymous memory.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

DATA_ALIGN = 4096  # the data section starts on a page
TENSOR_ALIGN = 64  # each storage starts on a cache line
HEADER_LIMIT = 64 << 20  # a manifest larger than this is not one this code wrote
WRITE_CHUNK = 64 << 20  # bytes copied from a GPU storage per step while writing


class CorruptEntry(ValueError):
    """The file is not a complete, intact cache entry; the message says what is wrong."""


def _padded(n: int, align: int) -> int:
    return -(-n // align) * align


def _host_bytes(storage: torch.UntypedStorage, start: int, stop: int) -> np.ndarray:
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # uint8 [nbytes], no copy
    return flat[start:stop].cpu().numpy()  # no copy on a CPU


def storage_crc32(storage: torch.UntypedStorage) -> int:
    crc = 0
    for start in range(0, storage.nbytes(), WRITE_CHUNK):
        crc = zlib.crc32(_host_bytes(storage, start, min(storage.nbytes(), start + WRITE_CHUNK)), crc)
    return crc


def write_file(path: str, storages: list[torch.UntypedStorage], manifest: dict) -> None:
    """Write the entry to `path` (the caller publishes it by rename). manifest gets each storage's size and CRC32."""
    manifest = dict(manifest, checksums=[storage_crc32(s) for s in storages])
    header: dict = {"__metadata__": {"manifest": json.dumps(manifest, separators=(",", ":"))}}
    offset = 0
    for index, storage in enumerate(storages):
        size = _padded(storage.nbytes(), TENSOR_ALIGN)
        header[f"s{index}"] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (_padded(8 + len(encoded), DATA_ALIGN) - 8 - len(encoded))
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for storage in storages:
            for start in range(0, storage.nbytes(), WRITE_CHUNK):
                handle.write(_host_bytes(storage, start, min(storage.nbytes(), start + WRITE_CHUNK)).data)
            handle.write(b"\0" * (_padded(storage.nbytes(), TENSOR_ALIGN) - storage.nbytes()))
        handle.flush()
        os.fsync(handle.fileno())  # the rename that publishes it must not precede the bytes on disk


def read_manifest(path: str) -> tuple[dict, dict, int]:
    """(manifest, safetensors header, data start) of the file at `path`; CorruptEntry if it is not well formed."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CorruptEntry(f"truncated: {size} bytes, shorter than a header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(HEADER_LIMIT, size - 8):
            raise CorruptEntry(f"truncated or corrupt: header length {length} with {size} bytes in the file")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
        manifest = json.loads(header["__metadata__"]["manifest"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntry(f"corrupt header ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict):
        raise CorruptEntry("corrupt header (the manifest is not an object)")
    return manifest, header, 8 + length


def map_storages(path: str, manifest: dict, header: dict, data_start: int, threads: int) -> list[torch.Tensor]:
    """The storages as uint8 tensors [nbytes] over a private mapping of the file, each CRC-checked."""
    try:
        sizes = [int(s["nbytes"]) for s in manifest["tree"]["storages"]]
        checksums = [int(c) for c in manifest["checksums"]]
        spans = [tuple(header[f"s{i}"]["data_offsets"]) for i in range(len(sizes))]
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptEntry(f"corrupt manifest ({type(exc).__name__}: {exc})") from None
    end = data_start + (spans[-1][1] if spans else 0)
    file_size = os.path.getsize(path)
    if file_size != end or len(checksums) != len(sizes):
        raise CorruptEntry(f"truncated: {file_size} bytes, the header describes {end}")
    if any(stop - start < size or start % TENSOR_ALIGN for (start, stop), size in zip(spans, sizes)):
        raise CorruptEntry("corrupt header (a storage's span does not hold its size)")
    if file_size == 0 or not sizes:
        raise CorruptEntry("an entry without storages")
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)  # private: a stray write stays ours

    def check(index: int) -> bool:
        start = data_start + spans[index][0]
        with memoryview(mapped) as view:
            return zlib.crc32(view[start:start + sizes[index]]) == checksums[index]

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        intact = list(pool.map(check, range(len(sizes))))
    if not all(intact):
        bad = intact.index(False)
        raise CorruptEntry(f"corrupt: storage s{bad} ({sizes[bad]} bytes) fails its CRC32")
    # torch.frombuffer keeps `mapped` alive as long as any tensor over it lives.
    return [torch.frombuffer(mapped, dtype=torch.uint8, count=size, offset=data_start + start) if size
            else torch.empty(0, dtype=torch.uint8) for (start, _), size in zip(spans, sizes)]
