"""Prefix caching on sealed pages (oval_edge/kv/prefix_cache.py, [R-kinds-and-tiers]): the hash chain, the pool's
refcounts, the LRU of cached pages, a hypothesis state machine over the pool, and exactness through the engine (a
request's greedy tokens with a prefix hit equal those of the same request on a fresh engine)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from oval_edge.geometry import KVGeometry
from oval_edge.kv.records.group_record import group_record
from oval_edge.kv.pool import PagePool
from oval_edge.kv.prefix_cache import page_hashes

from test_static_step import engine_for, tiny_folder  # noqa: F401 (fixture)

P = 4
SALT = b"test-model|nf4"


def small_pool(pages: int = 12, salt: bytes | None = SALT, group_pages: int = 0) -> PagePool:
    return PagePool(KVGeometry(1, 1, 8, P, "float32", rank=P - 1, group_pages=group_pages), pages, prefix_salt=salt)


def fill(pool: PagePool, seq, tokens: list[int]) -> None:
    """Write (nothing but) the bookkeeping of a prefill of `tokens` past the sequence's current length."""
    start = pool.length(seq)
    pool.record_tokens(seq, tokens[start:])
    pool.advance([seq], [len(tokens)])


def test_hash_chain_names_full_pages_by_their_whole_prefix():
    a = page_hashes(list(range(10)), P, SALT)
    assert len(a) == 2  # the trailing partial page has no name
    assert page_hashes(list(range(8)), P, SALT) == a
    changed = page_hashes([99] + list(range(1, 10)), P, SALT)
    assert changed[0] != a[0] and changed[1] != a[1]  # a page's name covers every token before it
    assert page_hashes(list(range(10)), P, b"other model")[0] != a[0]
    assert page_hashes(list(range(4, 8)), P, SALT, parent=a[0]) == a[1:]


def test_hit_maps_pages_shares_them_and_leaves_the_open_page_and_a_token_to_compute():
    pool = small_pool()
    prompt = list(range(100, 114))  # 3 full pages + 2 tokens
    assert pool.allocate("a", 20, prompt) is not None
    fill(pool, "a", prompt)
    assert pool.length("a") == 14 and pool.sealed_pages("a") == 3
    assert pool.allocate("b", 20, prompt + [7, 8]) is not None  # shares a's 3 sealed pages while a runs
    assert pool.length("b") == 12 and pool.page_table("b")[:3] == pool.page_table("a")[:3]
    assert pool.page_table("b")[3] != pool.page_table("a")[3]  # the open page is a's own
    assert pool.ledger.refs[pool.page_table("a")[0]] == 2
    pool.check_invariants()
    pool.free("a")
    pool.free("b")
    assert pool.num_used == 0 and pool.num_cached == 3 and pool.num_free == pool.num_pages
    pool.check_invariants()
    exact = prompt[:12]  # exactly 3 pages: the last one is recomputed, so its logits exist
    assert pool.allocate("c", 16, exact) is not None and pool.length("c") == 8
    stats = pool.ledger.stats
    assert (stats.queries, stats.hit_tokens) == (3, 12 + 8)


def test_cached_pages_are_reclaimed_least_recently_used_first_only_when_needed():
    pool = small_pool(pages=4)
    first, second = list(range(8)), list(range(50, 58))
    for seq, tokens in (("a", first), ("b", second)):
        assert pool.allocate(seq, 8, tokens) is not None
        fill(pool, seq, tokens)
        pool.free(seq)  # 2 named pages each: all 4 pages cached
    assert pool.num_cached == 4 and pool.can_allocate(16)
    assert pool.allocate("c", 8, first + [1]) is not None  # hits both of a's pages (LRU refreshed)
    assert pool.length("c") == 8 and pool.ledger.stats.evictions == 0
    assert pool.grow("c", 16) and pool.ledger.stats.evictions == 2  # b's pages went, a's are held
    assert pool.allocate("d", 1) is None
    pool.check_invariants()


def test_off_without_a_salt_and_without_tokens():
    pool = small_pool(salt=None)
    prompt = list(range(12))
    pool.allocate("a", 12, prompt)
    fill(pool, "a", prompt)
    pool.free("a")
    assert pool.num_cached == 0 and pool.allocate("b", 12, prompt) is not None and pool.length("b") == 0
    on = small_pool()
    on.allocate("a", 12)  # no tokens given: its pages are never named
    fill(on, "a", prompt)
    on.free("a")
    assert on.num_cached == 0


def fill_rows(pool: PagePool, seq, tokens: list[int]) -> None:
    """fill, writing K/V rows that are a function of (token, position), as real ones are: pages shared by prefix
    hold the same rows, so a group record built from any of them is the same."""
    start = pool.length(seq)
    pool.record_tokens(seq, tokens[start:])
    step = pool.prepare([seq], [len(tokens) - start])
    t = torch.tensor(tokens[start:], dtype=torch.float32)[:, None, None]
    p = torch.arange(start, len(tokens), dtype=torch.float32)[:, None, None]
    rows = torch.sin(t * 1.9 + p * 0.37 + torch.arange(8, dtype=torch.float32))  # [n, Hkv=1, D=8]
    pool.write(0, step, rows, rows.cos())
    pool.commit(step)


class PoolMachine(RuleBasedStateMachine):
    """Random sequences over a few shared prompt prefixes: allocate (with a hit or not), prefill, decode, free; with
    two-level scoring's group records (groups of 2 pages: 10 record slots for 10 pages, which no set of live
    groups can outnumber: each group-last page is distinct)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = small_pool(pages=10, group_pages=2)
        self.tokens: dict[int, list[int]] = {}  # live sequence -> the tokens written so far (or planned)
        self.limit: dict[int, int] = {}
        self.next_id = 0

    @rule(base=st.sampled_from([(1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (5, 5, 5, 5)]),
          suffix=st.lists(st.integers(0, 3), max_size=6), extra=st.integers(0, 6))
    def allocate(self, base, suffix, extra):
        prompt = list(base) + suffix
        sid, self.next_id = self.next_id, self.next_id + 1
        if self.pool.allocate(sid, len(prompt) + extra, prompt) is not None:
            assert self.pool.length(sid) % P == 0 and self.pool.length(sid) < len(prompt)
            fill_rows(self.pool, sid, prompt)
            self.tokens[sid], self.limit[sid] = prompt, len(prompt) + extra

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        if len(self.tokens[sid]) < self.limit[sid]:
            self.tokens[sid].append(token)
            fill_rows(self.pool, sid, self.tokens[sid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.free(sid)
        del self.tokens[sid], self.limit[sid]

    @invariant()
    def bookkeeping_holds(self):
        pool = self.pool
        pool.check_invariants()  # no page in two states, refcounts = holders >= 1, free + cached + used = total
        assert pool.num_used + pool.num_free == pool.num_pages
        for sid, tokens in self.tokens.items():  # a named page holds exactly the tokens its name says
            names = page_hashes(tokens, P, SALT)
            for index, page in enumerate(pool.page_table(sid)[: pool.sealed_pages(sid)]):
                name = pool.ledger.name_of.get(page)
                assert name is None or name == names[index]
            table = pool.page_table(sid)
            for j in range(pool.sealed_pages(sid) // 2):  # each complete group's record: its own group's
                group = table[2 * j : 2 * j + 2]
                slot = int(pool.group_slots.slot_of[group[-1]])
                assert slot >= 0, "a live group has no record"
                mean = group_record(pool.k[0, group].permute(1, 0, 2, 3).reshape(1, 2 * P, 8), P - 1)[0]
                torch.testing.assert_close(pool.summaries["group_mean"][0, slot], mean, atol=1e-5, rtol=0)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_greedy_tokens_with_a_prefix_hit_equal_a_fresh_engine(tiny_folder):
    from oval_edge.runtime import SamplingParams

    cached = engine_for(tiny_folder)
    history = [int(t) for t in torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(1))]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    turn1 = cached.generate(history, greedy)
    follow_up = history + turn1.output_ids + [int(t) for t in torch.randint(100, 40000, (120,))]
    turn2 = cached.generate(follow_up, greedy)
    assert turn2.cached_tokens >= 288 and turn2.cached_tokens % 16 == 0  # 18 of its pages mapped, not prefilled
    fresh = engine_for(tiny_folder, prefix_cache=False).generate(follow_up, greedy)
    assert fresh.cached_tokens == 0 and turn2.output_ids == fresh.output_ids
    pool = cached.pool
    pool.check_invariants()
    assert pool.num_used == 0 and pool.num_cached > 0 and pool.num_free == pool.num_pages


def test_serve_flag_turns_it_off():
    import argparse

    from oval_edge.runtime.server.options import add_engine_arguments, engine_spec

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_spec(parser.parse_args([])).engine_config().prefix_cache is True
    assert engine_spec(parser.parse_args(["--no-prefix-cache"])).engine_config().prefix_cache is False
    with pytest.raises(ValueError, match="prefix_cache"):
        from oval_edge.runtime import EngineConfig

        EngineConfig(prefix_cache=1)
