"""The static step's six-op page selection (oval_edge/sparse/static_select.py) picks the same slots, in the same
order, as DecodePlan.select's general path, for long rows, rows that fit the token budget, and rows whose sealed
pages are fewer than top_k (empty picks)."""

from __future__ import annotations

import pytest
import torch

from oval_edge import OvalConfig
from oval_edge.sparse.selection import DecodePlan
from oval_edge.sparse.static_select import StaticSelector


@pytest.mark.parametrize("sink", [0, 1, 2])
def test_static_selector_matches_the_general_selection(sink):
    config = OvalConfig(page_size=16, top_k=4, sink_pages=sink, window_min=40, window_max=40)
    generator = torch.Generator().manual_seed(sink)
    width, kv_heads = 24, 3
    # long rows, a row inside the token budget, a row just past it, one with few sealed pages, and the longest
    lengths = torch.tensor([300, config.token_budget - 5, config.token_budget + 1, 120, 24 * 16])
    sealed = (lengths - 1) // 16
    sealed[3] = sink + 2  # fewer selectable pages than top_k: empty picks
    table = torch.stack([torch.randperm(200, generator=generator)[:width] for _ in lengths])
    plan = DecodePlan(config, lengths, sealed, width, kv_heads, table, static=True)
    assert StaticSelector.applies(plan)
    for _ in range(3):
        scores = torch.randn(len(lengths), kv_heads, width, generator=generator)
        general = plan.select(scores, detail=True)
        fast = plan.select(scores, detail=False)
        assert torch.equal(fast.valid, general.valid)
        assert torch.equal(fast.flat[fast.valid], general.flat[general.valid])  # the slots attended, in order
        assert torch.equal(fast.flat, torch.where(general.valid, general.flat, fast.flat))


def test_static_selector_leaves_narrow_tables_and_adaptive_windows_to_the_general_path():
    lengths, sealed = torch.tensor([100]), torch.tensor([2])
    narrow = DecodePlan(OvalConfig(page_size=16, top_k=4), lengths, sealed, 4, 2, torch.arange(4)[None], static=True)
    adaptive = DecodePlan(OvalConfig(page_size=16, window_min=16, window_max=64), lengths, sealed, 16, 2,
                          torch.arange(16)[None], static=True)
    eager = DecodePlan(OvalConfig(page_size=16), lengths, sealed, 16, 2, torch.arange(16)[None])
    assert not any(StaticSelector.applies(plan) for plan in (narrow, adaptive, eager))
