"""store-check's io task (tools/store_check/io_compare.py): preadv and mmap read the same bytes, and the figures
come back for every method, cold and warm, with the file removed afterwards."""

from __future__ import annotations

import mmap
import os

import numpy as np

from oval_edge.kv.store.page_file import ALIGN, PageStore
from oval_edge.tools.store_check.io_compare import METHODS, _pass, compare


def test_every_method_copies_the_page_layer_preadv_reads(tmp_path):
    store = PageStore(str(tmp_path), 6 * 2 * ALIGN, ALIGN, 2)
    try:
        payloads = np.random.default_rng(1).integers(0, 255, size=(store.blocks, 2, ALIGN), dtype=np.uint8)
        for block in range(store.blocks):
            store.write_block(block, [[memoryview(payloads[block, layer])] for layer in range(2)])
        plan = [[(4, 1)], [(2, 0), (5, 1)]]
        mapped = mmap.mmap(store.fd, store.size_bytes, prot=mmap.PROT_READ)
        for method in METHODS:
            frame = np.zeros(ALIGN, dtype=np.uint8)
            seconds = _pass(store, method, plan, frame, None if method == "preadv" else mapped)
            assert len(seconds) == 2 and all(s > 0 for s in seconds)
            assert np.array_equal(frame, payloads[5, 1]), method  # the last read of the plan landed
        mapped.close()
    finally:
        store.close()


def test_compare_reports_every_method_cold_and_warm_and_removes_its_file(tmp_path):
    figures = compare(str(tmp_path), ALIGN, 3, blocks=16, batches=12, pages_per_batch=4)
    assert set(figures["methods"]) == set(METHODS)
    for sides in figures["methods"].values():
        assert set(sides) == {"cold", "warm"}
        for side in sides.values():
            assert side["gb_per_s"] > 0 and 0 < side["batch_us_p50"] <= side["batch_us_p90"]
    assert os.listdir(tmp_path) == []
