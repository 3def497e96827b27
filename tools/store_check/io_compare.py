"""`oval-edge store-check --tasks io`: how the page store should read a recall: preadv (what tier.py does) or an
mmap of the store file with madvise, measured on the same file, the same drive and the same page-layers.

A step's recall of one layer reads the pages its selection named that are not in the layer's recall frames: a few
page-layers of `layer_bytes` at random blocks. Each method copies the same sequence of such batches into one frame
buffer, cold (the file dropped from the page cache first, so the drive answers) and warm (a second pass):
    preadv          one os.preadv per page-layer into the frame (PageStore.read_layer alone)
    preadv+willneed POSIX_FADV_WILLNEED over the batch's ranges first, then the preadvs (PageStore.read_layers)
    mmap            MADV_RANDOM on a read-only mapping, then a memcpy per page-layer from it (page faults)
    mmap+willneed   MADV_WILLNEED over the batch's ranges first (the kernel starts every read), then the memcpys
Reported per batch: median and p90 microseconds, and GB/s over the whole pass.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time

import numpy as np

from oval_edge.kv.store.page_file import PageStore

METHODS = ("preadv", "preadv+willneed", "mmap", "mmap+willneed")


def _drop_cache(fd: int, size: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)


def _pass(store: PageStore, method: str, batches: list[list[tuple[int, int]]], frame: np.ndarray,
          mapped: mmap.mmap | None) -> list[float]:
    """Seconds per batch of one method over all batches."""
    view = np.frombuffer(mapped, dtype=np.uint8) if mapped is not None else None
    n, seconds = store.layer_bytes, []
    for batch in batches:
        began = time.perf_counter()
        if method == "preadv":
            for block, layer in batch:
                store.read_layer(block, layer, [memoryview(frame)])
        elif method == "preadv+willneed":
            store.read_layers([(block, layer, [memoryview(frame)]) for block, layer in batch])
        else:
            if method == "mmap+willneed":
                for block, layer in batch:
                    mapped.madvise(mmap.MADV_WILLNEED, store.offset(block, layer), n)
            for block, layer in batch:
                start = store.offset(block, layer)
                np.copyto(frame, view[start: start + n])
        seconds.append(time.perf_counter() - began)
    del view
    return seconds


def compare(folder: str, layer_bytes: int, layers: int, blocks: int, batches: int, pages_per_batch: int,
            seed: int = 0) -> dict:
    """Figures of every method, cold and warm, on one store file of `blocks` pages (removed afterwards)."""
    path = os.path.join(folder, f"oval-edge-io-compare-{os.getpid()}.store")  # beside a running store's file
    store = PageStore(path, blocks * layers * layer_bytes, layer_bytes, layers)
    try:
        rng = np.random.default_rng(seed)
        payload = rng.integers(0, 255, size=layers * layer_bytes, dtype=np.uint8)
        for block in range(store.blocks):
            store.write_block(block, [[memoryview(payload[l * layer_bytes:(l + 1) * layer_bytes])]
                                      for l in range(layers)])
        plan = [[(int(b), int(l)) for b, l in zip(rng.integers(0, store.blocks, pages_per_batch),
                                                   rng.integers(0, layers, pages_per_batch))]
                for _ in range(batches)]
        frame = np.empty(layer_bytes, dtype=np.uint8)
        rows = {}
        for method in METHODS:
            _drop_cache(store.fd, store.size_bytes)
            mapped = None
            if method.startswith("mmap"):
                mapped = mmap.mmap(store.fd, store.size_bytes, prot=mmap.PROT_READ)
                mapped.madvise(mmap.MADV_RANDOM)  # no read-around: a page-layer is all a recall wants
            try:
                cold = _pass(store, method, plan, frame, mapped)
                warm = _pass(store, method, plan, frame, mapped)
            finally:
                if mapped is not None:
                    mapped.close()
            moved = batches * pages_per_batch * layer_bytes
            rows[method] = {name: {"batch_us_p50": 1e6 * statistics.median(s),
                                   "batch_us_p90": 1e6 * statistics.quantiles(s, n=10)[-1],
                                   "gb_per_s": moved / sum(s) / 1e9}
                            for name, s in (("cold", cold), ("warm", warm))}
        return {"store": store.describe(), "layer_bytes": layer_bytes, "batches": batches,
                "pages_per_batch": pages_per_batch, "methods": rows}
    finally:
        store.close()


def report(figures: dict) -> str:
    lines = [f"io-compare on {figures['store']}: {figures['batches']} batches of {figures['pages_per_batch']} "
             f"page-layers of {figures['layer_bytes']} bytes at random blocks"]
    for method, sides in figures["methods"].items():
        lines.append(f"  {method:<16}" + "  ".join(
            f"{side} p50 {s['batch_us_p50']:8.1f} us p90 {s['batch_us_p90']:8.1f} us {s['gb_per_s']:6.2f} GB/s"
            for side, s in sides.items()))
    return "\n".join(lines)
