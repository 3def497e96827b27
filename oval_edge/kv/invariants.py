"""The page pool's bookkeeping invariants, checked by the tests after every operation (tests/test_pool.py, the
prefix-cache state machine): every page in exactly one state, refcounts equal to the tables holding each page."""

from __future__ import annotations

from collections import Counter


def check_pool_invariants(pool) -> None:
    """AssertionError naming the first broken invariant of a PagePool."""
    holders = Counter(p for t in pool._tables.values() for p in t)
    ledger = pool.ledger
    assert dict(holders) == ledger.refs, "refcounts differ from the tables holding each page"
    assert all(n >= 1 for n in ledger.refs.values()), "a refcount below one"
    for t in pool._tables.values():
        assert len(t) == len(set(t)), "a table holds a page twice"
    owned, free, cached = set(holders), set(pool._free), set(ledger.lru)
    assert not (owned & free or owned & cached or free & cached), "a page is in two states"
    assert len(owned) + len(free) + len(cached) == pool.num_pages, "pages were lost or duplicated"
    assert len(set(pool._free)) == len(pool._free), "free list holds a page twice"
    assert cached <= set(ledger.name_of), "a cached page without a name"
    assert all(ledger.page_of[n] == p for p, n in ledger.name_of.items()), "names and pages disagree"
    assert not set(ledger.name_of) & free, "a free page kept its name"
    for p in (p for p, n in holders.items() if n > 1):
        assert all(p in t[: pool._sealed[s]] for s, t in pool._tables.items() if p in t), \
            "a shared page is not sealed in every table holding it"
    for sid, table in pool._tables.items():
        assert pool._lengths[sid] <= len(table) * pool.page_size, f"{sid}: length beyond its pages"
        assert pool._sealed[sid] <= pool._lengths[sid] // pool.page_size, f"{sid}: sealed a page not full"
    if pool.rings is not None:
        pool.rings.check_invariants()
