"""A hypothesis state machine over the page store's pages (oval_edge/kv/store/tier.py): sequences are allocated
(with prefix hits), written, read back, and freed through a pool of few frames, few recall slots and a small store
(layer 0 mirrored in memory as a dense layer is, layer 1 only on disk), so pages keep moving between resident, stored and recalled. Every K/V row read equals the row written for that token
at that position (never lost, never stale), every sealed page's quest summary equals the min/max of its keys wherever
the page lives, and the pool's and the store's bookkeeping invariants hold after every rule."""

from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from oval_edge.geometry import KVGeometry
from oval_edge.kv.pool import PagePool
from oval_edge.kv.store.layout import StoreLayout
from oval_edge.sparse.attention import flat_slots

from test_kv_store import _store

PAGE, LAYERS, HEADS, DIM = 4, 2, 2, 8
GEOMETRY = KVGeometry(LAYERS, HEADS, DIM, PAGE, summary_kinds=("quest",))
VOCAB = 3  # few token ids: prompts share prefixes often


def row_values(tokens: list[int], positions: list[int], layer: int, which: int) -> torch.Tensor:
    """The K (which=0) or V (1) rows [n, Hkv, D] a token at a position has in a layer: a function of those alone,
    as real K/V are, so pages shared by prefix must hold the same rows."""
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    p = torch.tensor(positions, dtype=torch.float32)[:, None, None]
    h = torch.arange(HEADS, dtype=torch.float32)[None, :, None]
    d = torch.arange(DIM, dtype=torch.float32)[None, None, :]
    return torch.sin(t * 1.7 + p * 0.31 + h * 2.3 + d * 0.7 + layer * 1.1 + which * 0.5)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = tempfile.mkdtemp(prefix="oval-store-")
        self.pool = PagePool(GEOMETRY, 10, prefix_salt=b"machine", store=_store(self.folder, GEOMETRY, 30),
                             store_layout=StoreLayout(recall_pages=3, sink_pages=1, window_pages=1,
                                                      mirrored_layers=1))  # layer 0 mirrored, layer 1 on disk only
        self.tokens: dict[int, list[int]] = {}  # sequence -> the token ids written so far
        self.next_id = 0

    def teardown(self) -> None:
        for sid in list(self.tokens):
            self.pool.free(sid)
        self.pool.check_invariants()
        assert self.pool.store.stored_pages() == 0 and self.pool.num_used == 0
        self.pool.store.store.close()
        shutil.rmtree(self.folder)  # one folder per example: hypothesis runs hundreds

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    def allocate(self, prompt):
        sid, self.next_id = self.next_id, self.next_id + 1
        if self.pool.allocate(sid, len(prompt), prompt) is None:
            return
        self.tokens[sid] = prompt[: self.pool.length(sid)]  # a prefix hit starts past its mapped pages
        self._write(sid, prompt[self.pool.length(sid):])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.integers(1, 9))
    def write(self, data, count):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self._write(sid, data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=count, max_size=count)))

    def _write(self, sid, new: list[int]) -> None:
        pool, start = self.pool, self.pool.length(sid)
        end = start + len(new)
        if not new or not pool.grow(sid, end) or not pool.make_resident(sid, end):
            return  # no room now: nothing was written, nothing may have changed for the sequence
        pool.record_tokens(sid, new)
        step = pool.prepare([sid], [len(new)])
        positions = list(range(start, end))
        for layer in range(LAYERS):
            pool.write(layer, step, row_values(new, positions, layer, 0), row_values(new, positions, layer, 1))
        pool.commit(step)
        self.tokens[sid] = self.tokens[sid] + new

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), many=st.booleans())
    def read(self, data, many):
        """Read some positions (few pages: the recall frames; many: a transient read) and check every row."""
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[sid]
        if not tokens:
            return
        positions = sorted(data.draw(st.lists(st.integers(0, len(tokens) - 1), min_size=1, max_size=2 * PAGE)))
        if many:  # every position: more stored pages than recall frames, a transient read
            positions = list(range(len(tokens)))
        else:  # at most 3 distinct pages: what the recall frames hold
            pages = sorted({p // PAGE for p in positions})[:3]
            positions = [p for p in positions if p // PAGE in pages]
        table = torch.tensor([self.pool.page_table(sid)])
        pos = torch.tensor(positions)[None, None, :].expand(1, HEADS, -1)
        flat = flat_slots(table, pos, HEADS, PAGE)
        layer = data.draw(st.integers(0, LAYERS - 1))
        k_rows, v_rows, remapped, _ = self.pool.readable(layer, flat)
        ids = [tokens[p] for p in positions]
        for which, rows in enumerate((k_rows, v_rows)):
            got = rows.index_select(0, remapped.reshape(-1)).view(HEADS, len(positions), DIM).transpose(0, 1)
            assert torch.equal(got, row_values(ids, positions, layer, which)), "a row read back differs"

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.free(sid)
        del self.tokens[sid]

    @invariant()
    def bookkeeping_and_summaries(self):
        self.pool.check_invariants()
        for sid, tokens in self.tokens.items():
            table = self.pool.page_table(sid)
            for logical in range(self.pool.sealed_pages(sid)):
                page = table[logical]
                positions = list(range(logical * PAGE, (logical + 1) * PAGE))
                keys = row_values(tokens[logical * PAGE:(logical + 1) * PAGE], positions, 1, 0)  # layer 1
                assert torch.equal(self.pool.summaries["kmin"][1, page], keys.amin(0)), "a stale summary"
                assert torch.equal(self.pool.summaries["kmax"][1, page], keys.amax(0))


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_machine_moves_pages_through_every_state():
    """The machine is not vacuous: a fixed run spills pages, recalls them, and reads some transiently."""
    machine = StoreMachine()
    try:
        for i in range(12):
            machine.allocate([i % VOCAB] * 3 + [(i + 1) % VOCAB] * 20)
            machine.write(_Data([sorted(machine.tokens)[-1]] + [[1] * 9]), 9)
        stats = machine.pool.store.stats
        assert stats.spills > 0
        sid = sorted(machine.tokens)[0]
        machine.read(_Data([sid, list(range(len(machine.tokens[sid]))), 0]), True)
        machine.read(_Data([sid, list(range(len(machine.tokens[sid]))), 1]), True)
        machine.read(_Data([sid, list(range(6)), 1]), False)
        machine.bookkeeping_and_summaries()
        assert stats.mirror_reads > 0 and stats.transient_reads > 0  # layer 0 from memory, layer 1 from disk
    finally:
        machine.teardown()


class _Data:
    """A stand-in for hypothesis' data object: draws the given values in order."""

    def __init__(self, values):
        self.values = list(values)

    def draw(self, _strategy):
        return self.values.pop(0)
