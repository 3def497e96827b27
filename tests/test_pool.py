"""The page pool ([R-pool]): a rule-based property test of allocate / grow / append / seal / free, plus the budget
arithmetic that sizes it.

The state machine keeps its own model of every sequence (the tokens it wrote, in order) and after every rule
checks the pool against it independently of `check_invariants`: ownership, free count, page tables vs lengths,
sealed counts, K/V read back at their positions through `gather_kv`, quest summaries of sealed pages, and that
no pool tensor was ever reallocated.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from oval_edge import KVGeometry, PagePool, size_pool
from oval_edge.sparse.attention import gather_kv

LAYERS, HEADS, DIM, PAGE, PAGES = 2, 2, 8, 16, 12


class PoolMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16), first=st.lists(st.integers(0, 60), min_size=1, max_size=3))
    def start(self, seed, first):
        geometry = KVGeometry(LAYERS, HEADS, DIM, PAGE, "float32", ("oval", "quest"), rank=2)
        self.pool = PagePool(geometry, PAGES)
        self.pointers = self.pool.storage_pointers()
        self.gen = torch.Generator().manual_seed(seed)
        self.model: dict[int, dict] = {}  # seq -> {"k": [L, layers, heads, D], "v": ..., "reserved": tokens}
        self.next_id = 0
        for tokens in first:  # start with a few sequences so every rule has something to act on
            self.allocate(tokens)

    # ---- rules -------------------------------------------------------------------------------------------
    @rule(tokens=st.integers(0, 120))
    def allocate(self, tokens):
        free_before, sid = self.pool.num_free, self.next_id
        need = max(1, math.ceil(tokens / PAGE))
        assert self.pool.can_allocate(tokens) == (need <= free_before)
        pages = self.pool.allocate(sid, tokens)
        if need > free_before:  # does not fit: an answer, and nothing taken
            event("allocate refused")
            assert pages is None and self.pool.num_free == free_before and not self.pool.owns(sid)
            return
        assert pages is not None and len(pages) == need and self.pool.num_free == free_before - need
        self.model[sid] = {"k": torch.zeros(0, LAYERS, HEADS, DIM), "v": torch.zeros(0, LAYERS, HEADS, DIM)}
        self.next_id += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data(), extra=st.integers(0, 80))
    def grow(self, data, extra):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        table_before, free_before = self.pool.page_table(sid), self.pool.num_free
        total = self.pool.length(sid) + extra
        need = max(0, math.ceil(total / PAGE) - len(table_before))
        ok = self.pool.grow(sid, total)
        assert ok == (need <= free_before)
        if ok:
            assert self.pool.page_table(sid)[: len(table_before)] == table_before  # existing pages never move
            assert self.pool.num_free == free_before - need
        else:
            event("grow refused")
            assert self.pool.page_table(sid) == table_before and self.pool.num_free == free_before

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def append(self, data):
        """One forward step: 1..40 new tokens for several sequences at once, written per layer, then commit."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        counts = data.draw(st.lists(st.integers(1, 40), min_size=len(ids), max_size=len(ids)))
        rows = [(s, n) for s, n in zip(ids, counts) if self.pool.grow(s, self.pool.length(s) + n)]
        if not rows:
            return
        ids, counts = [s for s, _ in rows], [n for _, n in rows]
        sealed_before = sum(self.pool.sealed_pages(s) for s in ids)
        step = self.pool.prepare(ids, counts)
        n_total = sum(counts)
        new_k = torch.randn(n_total, LAYERS, HEADS, DIM, generator=self.gen)
        new_v = torch.randn(n_total, LAYERS, HEADS, DIM, generator=self.gen)
        for layer in range(LAYERS):
            self.pool.write(layer, step, new_k[:, layer], new_v[:, layer])
        sealed_now = self.pool.commit(step)
        offset = 0
        for sid, n in zip(ids, counts):
            entry = self.model[sid]
            entry["k"] = torch.cat([entry["k"], new_k[offset : offset + n]])
            entry["v"] = torch.cat([entry["v"], new_v[offset : offset + n]])
            offset += n
        assert sealed_now == sum(self.pool.sealed_pages(s) for s in ids) - sealed_before
        event(f"append to {len(ids)} sequence(s), sealed pages: {'yes' if sealed_now else 'no'}")

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        owned, free_before = len(self.pool.page_table(sid)), self.pool.num_free
        assert self.pool.free(sid) == owned
        assert self.pool.num_free == free_before + owned and not self.pool.owns(sid)
        assert self.pool.free(sid) == 0  # freeing twice returns nothing more
        del self.model[sid]

    @rule()
    def allocation_that_can_never_fit(self):
        free_before = self.pool.num_free
        assert self.pool.allocate("huge", PAGES * PAGE + 1) is None
        assert self.pool.num_free == free_before and not self.pool.owns("huge")

    # ---- invariants, checked after every rule -----------------------------------------------------------
    @invariant()
    def pool_matches_model(self):
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_invariants()
        assert pool.storage_pointers() == self.pointers, "a pool tensor was reallocated"
        assert sorted(pool.sequences()) == sorted(self.model)
        owned = [p for sid in self.model for p in pool.page_table(sid)]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert all(0 <= p < PAGES for p in owned)
        assert pool.num_free + len(owned) == PAGES
        for sid, entry in self.model.items():
            length, table = entry["k"].shape[0], pool.page_table(sid)
            assert pool.length(sid) == length
            assert len(table) >= max(1, math.ceil(length / PAGE))  # room for every written token
            assert pool.sealed_pages(sid) == length // PAGE  # every full page is sealed, the open one is not
            if length:
                self._check_contents(sid, entry, table, length)

    def _check_contents(self, sid, entry, table, length):
        """What this sequence wrote reads back at its positions, whatever happened to other sequences."""
        page_table = torch.tensor([table])
        positions = torch.arange(length).expand(1, HEADS, length)
        for layer in range(LAYERS):
            k, v = gather_kv(self.pool, layer, page_table, positions)  # [1, heads, L, D]
            assert torch.equal(k[0], entry["k"][:, layer].transpose(0, 1))
            assert torch.equal(v[0], entry["v"][:, layer].transpose(0, 1))
            for logical in range(length // PAGE):  # sealed pages carry the summary of their own keys
                keys = entry["k"][logical * PAGE : (logical + 1) * PAGE, layer]  # [P, heads, D]
                assert torch.equal(self.pool.summaries["kmin"][layer, table[logical]], keys.amin(0))
                assert torch.equal(self.pool.summaries["kmax"][layer, table[logical]], keys.amax(0))

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for sid in list(self.model):
            self.pool.free(sid)
        assert self.pool.num_free == PAGES, "freeing every sequence must restore every page"
        self.pool.check_invariants()


TestPoolStateMachine = PoolMachine.TestCase
TestPoolStateMachine.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,  # deterministic: the same examples on every run
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- budget arithmetic ([R-pool]) -------------------------------------------------------------------------
@pytest.mark.parametrize("kinds", [("oval",), ("quest",), ("oval", "quest")])
@pytest.mark.parametrize("dtype, nbytes", [("float32", 4), ("float16", 2)])
def test_bytes_per_page_counts_kv_and_summaries(kinds, dtype, nbytes):
    layers, heads, dim, page, rank = 30, 3, 64, 32, 4
    geometry = KVGeometry(layers, heads, dim, page, dtype, kinds, rank)
    kv = 2 * layers * heads * page * dim * nbytes
    # quest: per-channel min and max; oval: the mean, the basis and the coordinates (dim + (dim + page) * rank)
    summary = layers * heads * nbytes * (("quest" in kinds) * 2 * dim + ("oval" in kinds) * (dim + (dim + page) * rank))
    assert geometry.bytes_per_page == kv + summary


def test_size_pool_arithmetic_and_pool_allocation_agree():
    geometry = KVGeometry(2, 3, 64, 16, "float32", ("oval", "quest"), rank=4)
    per_page = geometry.bytes_per_page
    for budget, weights, workspace, reserve in [(10**7, 10**6, 2 * 10**5, 10**5), (per_page * 7 + 5, 0, 0, 0)]:
        sizing = size_pool(budget, weights, geometry, workspace_bytes=workspace, reserve_bytes=reserve)
        assert sizing.pages == (budget - weights - workspace - reserve) // per_page
        assert sizing.bytes_per_page == per_page and sizing.pool_bytes == sizing.pages * per_page
        assert f"= {sizing.pages} ->" in sizing.explain()
    # What the pool really allocates is what the arithmetic charged for.
    pool = PagePool(geometry, 7)
    assert pool.nbytes() == 7 * per_page


def test_size_pool_refuses_a_budget_without_one_page():
    geometry = KVGeometry(2, 3, 64, 16, "float32", ("oval",), rank=4)
    minimum = 1000 + 200 + 100 + geometry.bytes_per_page
    with pytest.raises(ValueError, match=rf"minimum for one page is .* \({minimum} bytes\)"):
        size_pool(minimum - 1, 1000, geometry, workspace_bytes=200, reserve_bytes=100)
    with pytest.raises(ValueError, match="leaves no room for the KV pool"):
        size_pool(500, 1000, geometry)  # weights alone exceed the budget
    assert size_pool(minimum, 1000, geometry, workspace_bytes=200, reserve_bytes=100).pages == 1


def test_prepare_without_room_is_a_clear_error():
    pool = PagePool(KVGeometry(1, 1, 8, 16), 4)
    pool.allocate("s", 16)
    with pytest.raises(ValueError, match="needs 2 pages for 17 tokens but owns 1; grow"):
        pool.prepare(["s"], [17])
    with pytest.raises(ValueError, match="already owns pages"):
        pool.allocate("s", 1)


def test_the_bookkeeping_holds_no_tensors():
    # page_tables.py (and the prefix ledger it keeps) is the pool's bookkeeping: plain ints and dicts, no torch, so
    # what can lose a page is tested apart from device memory ([R-pool]).
    import ast
    from pathlib import Path

    import oval_edge.kv.page_tables as tables_module

    kv = Path(tables_module.__file__).parent
    for name in ("page_tables.py", "prefix_cache.py"):
        tree = ast.parse((kv / name).read_text(encoding="utf-8"))
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "torch" not in imported, name
