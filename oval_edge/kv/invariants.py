"""The page pool's bookkeeping invariants, checked by the tests after every operation (tests/test_pool.py, the
prefix-cache state machine): every page in exactly one state, refcounts equal to the tables holding each page."""

from __future__ import annotations

from collections import Counter


def check_pool_invariants(pool) -> None:
    """AssertionError naming the first broken invariant of a PagePool."""
    tier = pool.store
    resident = (lambda p: True) if tier is None else (lambda p: not tier.is_stored(p))
    holders = Counter(p for t in pool.tables.tables.values() for p in t if resident(p))
    ledger = pool.ledger
    assert dict(holders) == ledger.refs, "refcounts differ from the tables holding each page"
    assert all(n >= 1 for n in ledger.refs.values()), "a refcount below one"
    for t in pool.tables.tables.values():
        assert len(t) == len(set(t)), "a table holds a page twice"
    owned, free, cached = set(holders), set(pool.tables.free), set(ledger.lru)
    assert not (owned & free or owned & cached or free & cached), "a page is in two states"
    assert len(owned) + len(free) + len(cached) == pool.num_pages, "pages were lost or duplicated"
    assert len(set(pool.tables.free)) == len(pool.tables.free), "free list holds a page twice"
    assert cached <= set(ledger.name_of), "a cached page without a name"
    assert all(ledger.page_of[n] == p for p, n in ledger.name_of.items()), "names and pages disagree"
    assert not set(ledger.name_of) & free, "a free page kept its name"
    for p in (p for p, n in holders.items() if n > 1):
        assert all(p in t[: pool.tables.sealed[s]] for s, t in pool.tables.tables.items() if p in t), \
            "a shared page is not sealed in every table holding it"
    for sid, table in pool.tables.tables.items():
        assert pool.tables.lengths[sid] <= len(table) * pool.page_size, f"{sid}: length beyond its pages"
        assert pool.tables.sealed[sid] <= pool.tables.lengths[sid] // pool.page_size, f"{sid}: sealed a page not full"
    if pool.rings is not None:
        pool.rings.check_invariants()
    if pool.states is not None:
        pool.states.check_invariants()
        assert pool.states.holders() == set(pool.tables.tables), "state slots and page tables name other sequences"
    pool.group_slots.check_invariants()
    if tier is not None:
        check_store_invariants(pool, tier)


def check_store_invariants(pool, tier) -> None:
    """Every block free or held by exactly one table; written blocks held; sealed pages never reservations; each
    layer's recall frames hold distinct written pages, and frame_of points at them."""
    held = [p - tier.base for t in pool.tables.tables.values() for p in t if tier.is_stored(p)]
    assert len(held) == len(set(held)), "a store block is held twice"
    assert not set(held) & set(tier.free_blocks), "a store block is free and held"
    assert len(held) + len(tier.free_blocks) == tier.blocks, "store blocks were lost"
    assert tier.written <= set(held), "a written block no table holds"
    for sid, table in pool.tables.tables.items():
        for page in table[: pool.tables.sealed[sid]]:
            assert not tier.is_stored(page) or page - tier.base in tier.written, f"{sid}: sealed page {page} unwritten"
    for row, lru in enumerate(tier.lru):
        assert len(set(lru.values())) == len(lru) <= tier.recall_pages, "a recall slot holds two pages"
        assert not set(lru.values()) & set(tier.free_slots[row]), "a recall slot is free and used"
        assert len(lru) + len(tier.free_slots[row]) == tier.recall_pages, "recall slots were lost"
        for page, slot in lru.items():
            assert page - tier.base in tier.written, "a recall of a block that holds nothing"
            assert int(tier.frame_of[row, page]) == tier.first_recall + slot, "frame_of disagrees with the LRU"
