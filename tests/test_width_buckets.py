"""Where the static step reads every listed page (the torch ops: no native CPU kernels, CUDA without Triton), it is
built per page-table width bucket too, and a batch takes the narrowest width holding its longest row (chosen on
the host before the step runs): short batches do not pay for max_model_len. Results stay the eager forward's."""

from __future__ import annotations

import pytest
from test_static_step import engine_for, prefill, static_equals_eager, tiny_folder  # noqa: F401  (a fixture)

from oval_edge.kernels.cpu import NATIVE_ENV
from oval_edge.runtime.engine.forward.static_step import width_buckets


def test_width_buckets_double_from_the_narrowest_to_the_widest():
    assert width_buckets(256, 7) == (8, 16, 32, 64, 128, 256)
    assert width_buckets(88, 8) == (8, 16, 32, 64, 88)
    assert width_buckets(6, 7) == (6,)


def test_a_batch_takes_the_narrowest_width_and_decodes_as_the_eager_forward(tiny_folder, monkeypatch):  # noqa: F811
    monkeypatch.setenv(NATIVE_ENV, "0")  # the torch ops read every listed page
    static, eager = engine_for(tiny_folder), engine_for(tiny_folder)
    assert static.static.widths == (8, 16, 32, 64, 88)  # 16-token pages, 1,400 tokens at most
    seq_ids = ["short", "long"]
    for engine in (static, eager):
        for seq_id, length in zip(seq_ids, (20, 120)):
            prefill(engine, seq_id, length, seed=length)
    step = static.static.load(seq_ids, [5, 6])
    assert step.width == 8 and tuple(step.page_table.shape) == (2, 8)  # 121 tokens: 8 pages
    static_equals_eager(static, eager, seq_ids, 12)  # the long row passes 128 tokens: the 16-page step
    assert static.static.width_for(seq_ids) == 16 and static.static.load(seq_ids, [5, 6]).width == 16


def test_kernels_that_read_each_rows_own_pages_keep_one_width(tiny_folder, monkeypatch):  # noqa: F811
    from oval_edge.kernels.cpu import cpu_kernels

    monkeypatch.delenv(NATIVE_ENV, raising=False)
    if cpu_kernels() is None:
        pytest.skip("native CPU kernels unavailable here")
    assert engine_for(tiny_folder).static.widths == (88,)
