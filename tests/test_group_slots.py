"""Coarse record slots of two-level scoring (oval_edge/kv/records/group_slots.py): about 2 per G pages instead of one a page,
kept across prefix-cache hits, given up by pages no sequence holds, released when a page is rewritten, and a group
the pool has no slot for is scored finely every step rather than dropped."""

from __future__ import annotations

import torch

from oval_edge.geometry import KVGeometry
from oval_edge.kv.records.group_record import GROUP_NAMES, GROUP_SLOT, group_record
from oval_edge.kv.records.group_slots import GroupSlots
from oval_edge.kv.pool import PagePool
from oval_edge.kv.records.page_record import layer_records
from oval_edge.sparse.grouped import grouped_reference
from oval_edge.sparse.scoring import record_scores

PAGE, GROUP, LAYERS, HEADS, DIM = 4, 2, 2, 2, 8
GEOMETRY = KVGeometry(LAYERS, HEADS, DIM, PAGE, "float32", rank=2, group_pages=GROUP)


def _write(pool: PagePool, sid, tokens: list[int]) -> None:
    """Write the rows of `tokens` after what the sequence holds; a row is a function of (token, position), as real
    K/V are, so pages shared by prefix hold the same rows."""
    start = pool.length(sid)
    pool.record_tokens(sid, tokens)
    step = pool.prepare([sid], [len(tokens)])
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    p = torch.arange(start, start + len(tokens), dtype=torch.float32)[:, None, None]
    d = torch.arange(HEADS * DIM, dtype=torch.float32).view(1, HEADS, DIM)
    for layer in range(LAYERS):
        pool.write(layer, step, torch.sin(t * 1.3 + p * 0.7 + d + layer), torch.cos(t + p * 0.3 + d - layer))
    pool.commit(step)


def _start(pool: PagePool, sid, tokens: list[int]) -> None:
    assert pool.allocate(sid, len(tokens) + 1, tokens) is not None
    _write(pool, sid, tokens[pool.length(sid):])


def _record_of(pool: PagePool, group: list[int]) -> torch.Tensor:
    slot = int(pool.group_slots.slot_of[group[-1]])
    assert slot >= 0, "the group has no record"
    return pool.summaries["group_mean"][:, slot]


def test_slots_are_free_first_then_taken_from_spare_pages_then_short():
    slots = GroupSlots(pages=10, slots=2, device=torch.device("cpu"))
    assert slots.assign([3, 5], spare=lambda p: False) == [0, 1] and slots.assign([3], lambda p: False) == [0]
    assert slots.assign([7], spare=lambda p: p == 3) == [0] and not slots.has(3)  # page 3's record gave way
    assert slots.assign([8], spare=lambda p: False) == [-1] and slots.shortfalls == 1
    slots.release(5)
    assert slots.assign([8], spare=lambda p: False) == [1]
    assert slots.slot_of.tolist() == [-1] * 7 + [0, 1, -1]
    assert slots.lacking([[2, 3], [6, 7], [4, 8]]) == [[2, 3]]
    slots.check_invariants()


def test_a_prefix_hit_keeps_the_group_records_and_a_rewritten_page_loses_its_own():
    pool = PagePool(GEOMETRY, 12, prefix_salt=b"slots")
    assert pool.summaries["group_mean"].shape[1] == 2 * 12 // GROUP  # 12 slots for 12 pages, not 12 per page
    prompt = list(range(4 * PAGE + 1))  # 4 sealed pages: 2 complete groups
    _start(pool, "a", prompt)
    groups = [pool.page_table("a")[0:2], pool.page_table("a")[2:4]]
    before = [_record_of(pool, g).clone() for g in groups]
    keys = pool.k[:, groups[1]].permute(0, 2, 1, 3, 4).reshape(-1, GROUP * PAGE, DIM)
    torch.testing.assert_close(before[1].reshape(-1, DIM), group_record(keys, 2)[0], atol=1e-5, rtol=0)
    pool.free("a")  # its named pages stay cached with their records
    _start(pool, "b", prompt)  # maps all 4 sealed pages
    assert pool.page_table("b")[:4] == groups[0] + groups[1]
    for group, record in zip(groups, before):
        torch.testing.assert_close(_record_of(pool, group), record)
    pool.free("b")
    _start(pool, "c", [99] * (12 * PAGE - 1))  # takes every page: the cached ones are rewritten
    assert pool.group_slots.used == 5  # c's 5 complete groups; the old groups' records went with their pages
    pool.check_invariants()


def test_more_groups_than_slots_go_without_a_record_and_are_always_scored(kernels):
    """17 pages, groups of 8: 4 slots. Five sequences share 7 pages and close group 0 each with a page of their own
    (held, so no record can give way): the fifth group has none, and two-level scoring always keeps it."""
    geometry = KVGeometry(LAYERS, HEADS, DIM, PAGE, "float32", rank=2, group_pages=8)
    pool = PagePool(geometry, 17, prefix_salt=b"short")
    shared = list(range(7 * PAGE))
    for i in range(5):
        _start(pool, i, shared + [100 + i] * PAGE + [0])
    slots = pool.group_slots
    assert slots.count == 4 and slots.used == 4 and slots.shortfalls == 1
    lacking, kept = pool.page_table(4)[:8], pool.page_table(1)[:8]
    assert int(slots.slot_of[lacking[-1]]) == -1 and int(slots.slot_of[kept[-1]]) >= 0
    pool.check_invariants()
    q = torch.randn(1, HEADS, 1, DIM)
    table, sealed = torch.tensor([kept + lacking]), torch.tensor([16])
    for scorer in ("kernel", "torch"):
        if scorer == "torch":
            scores = grouped_reference(q, pool.summaries, 0, table, sealed, 0.5, 8, 1,
                                       lambda t, n: record_scores(q, layer_records(pool.summaries, 0), t, 0.5))
        else:  # group_kernels.c, called as grouped.grouped_scores calls it
            coarse = tuple(pool.summaries[name][0] for name in GROUP_NAMES) + (pool.summaries[GROUP_SLOT],)
            scores = kernels.grouped_scores(q, coarse, layer_records(pool.summaries, 0), table, sealed, 0.5, 8, 1)
        assert bool((scores[0, :, 8:] > float("-inf")).all()), scorer  # the group without a record
        assert not bool((scores[0, :, :8] > float("-inf")).any()), scorer
    for i in range(5):
        pool.free(i)
    _start(pool, 5, shared + [100 + 4] * PAGE + [0])  # the prefix hit builds the record it lacked
    assert slots.has(lacking[-1]) and pool.page_table(5)[:8] == lacking
    pool.check_invariants()
