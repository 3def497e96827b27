"""Prefix caching on sealed pages ([R-kinds-and-tiers]): full pages are named by a hash chain over their token ids,
shared between sequences by reference count, and kept after their last owner ends until the pool needs the room.

Why: a chat client resends the whole conversation every turn, and N clients share one system prompt; without this
every request re-prefills what an earlier one already wrote. A sealed OVAL page is immutable (its K/V and its
summary were computed once from the same tokens at the same positions), so another request whose prompt starts
with the same tokens can map it and prefill only the rest. The open (last, partly filled) page is never shared.

Names (vLLM's block hash): hash(page i) = H(salt, hash(page i-1), the page's P token ids). The salt holds what
else decides the page's contents (the model, its quantization and dtypes, the page size), so a page can only be
found by a request that would have computed the very same K/V. blake2b-128: collisions are not a practical concern.

Page states, kept by PagePool with this ledger:
    free     on the pool's free list: no owner, no name
    owned    refs >= 1 (one per sequence whose table holds it); named if it is sealed and its tokens are known
    cached   refs == 0 but named: in the LRU, reusable by a later prefix hit, reclaimed (name dropped) only when the
             free list is empty — free + cached + owned = all pages
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def page_hashes(tokens: Sequence[int], page_size: int, salt: bytes, parent: bytes | None = None) -> list[bytes]:
    """The chained names of the full pages of `tokens` (a trailing partial page has none)."""
    names, previous = [], parent or b""
    ids = np.asarray(tokens[: len(tokens) // page_size * page_size], dtype=np.int64)
    for first in range(0, len(ids), page_size):
        digest = hashlib.blake2b(salt + previous + ids[first:first + page_size].tobytes(), digest_size=16).digest()
        names.append(digest)
        previous = digest
    return names


@dataclass
class PrefixStats:
    queries: int = 0  # requests whose prompt was looked up
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens served from cached pages (not prefilled)
    evictions: int = 0  # cached pages reclaimed for new allocations

    def count(self, query_tokens: int, hit_tokens: int) -> None:
        self.queries += 1
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens


class PrefixLedger:
    """Reference counts of owned pages, the names of sealed pages, and the LRU of cached ones (no tensors)."""

    def __init__(self, salt: bytes | None) -> None:
        self.salt = salt  # None: prefix caching off (pages are never named, so never cached)
        self.refs: dict[int, int] = {}  # owned page -> number of tables holding it
        self.page_of: dict[bytes, int] = {}  # name -> page
        self.name_of: dict[int, bytes] = {}  # page -> name
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self.stats = PrefixStats()

    @property
    def enabled(self) -> bool:
        return self.salt is not None

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """The pages of the longest chain of `names` that is cached or owned (in order)."""
        pages = []
        for name in names:
            page = self.page_of.get(name)
            if page is None:
                break
            pages.append(page)
        return pages

    def take(self, page: int) -> None:
        """One more table holds `page` (fresh from the free list, or a prefix hit, cached or owned)."""
        self.lru.pop(page, None)
        self.refs[page] = self.refs.get(page, 0) + 1

    def release(self, page: int) -> bool:
        """One table less holds `page`; True when nobody does and it has no name (back to the free list)."""
        left = self.refs[page] - 1
        if left > 0:
            self.refs[page] = left
            return False
        del self.refs[page]
        if page in self.name_of:
            self.lru[page] = None  # most recently used last
            return False
        return True

    def name(self, page: int, name: bytes) -> None:
        """Name a sealed, owned page; a name another page already has is left to that page (same K/V twice)."""
        if name not in self.page_of and page not in self.name_of:
            self.page_of[name] = page
            self.name_of[page] = name

    def name_run(self, pages: Sequence[int], tail: list[int], page_size: int, parent: bytes | None) -> bytes | None:
        """Name `pages` (just sealed, in order) from the first len(pages) x page_size ids of `tail`, which are
        consumed; returns the last name (the next page's parent), or None when the ids were not all recorded (the
        sequence's later pages then stay unnamed)."""
        used = len(pages) * page_size
        if len(tail) < used:
            return None
        names = page_hashes(tail[:used], page_size, self.salt, parent)
        for page, name in zip(pages, names):
            self.name(page, name)
        del tail[:used]
        return names[-1]

    def reclaim(self) -> int | None:
        """The least recently used cached page, its name dropped; None if nothing is cached."""
        if not self.lru:
            return None
        page, _ = self.lru.popitem(last=False)
        del self.page_of[self.name_of.pop(page)]
        self.stats.evictions += 1
        return page

    def cached_among(self, pages: Sequence[int]) -> int:
        return sum(1 for p in pages if p in self.lru)
