"""`PageTables`: the pool's bookkeeping, with no tensors: which physical pages each sequence holds, how far each
sequence is written and sealed, the free list, and the prefix cache's names and reference counts (prefix_cache.py).

Why apart from the tensors (pool.py): this is the part whose mistakes lose pages, and the part vLLM's BlockPool and
nano-vllm's block manager keep free of device memory; the rule-based property test (tests/test_pool.py) and
invariants.py check it through the pool. The pool asks it what to take, seal and name, and does the tensor work.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from .prefix_cache import PrefixLedger, page_hashes


class PageTables:
    """Physical pages 0..num_pages-1 of page_size tokens; prefix_salt None turns prefix caching off."""

    def __init__(self, num_pages: int, page_size: int, prefix_salt: bytes | None) -> None:
        self.page_size = page_size
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: recently freed pages first (warm)
        self.tables: dict[Hashable, list[int]] = {}  # logical page -> physical page, per sequence
        self.lengths: dict[Hashable, int] = {}  # tokens written
        self.sealed: dict[Hashable, int] = {}  # leading pages sealed (full, summarised or deferred)
        self.ledger = PrefixLedger(prefix_salt)  # refcounts, page names, the LRU of cached pages
        self.tail: dict[Hashable, list[int] | None] = {}  # token ids written past the last named page (None: unknown)
        self.parent: dict[Hashable, bytes | None] = {}  # name of the sequence's last named page
        # Sequences no decode step will score (allocate(scored=False)), and the sealed pages they left without
        # summaries: built only if a scored sequence maps them from the prefix cache.
        self.unscored: set[Hashable] = set()
        self.unsummarized: set[int] = set()

    # ---- questions ----------------------------------------------------------------------------------------
    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_free(self) -> int:
        """Frames an allocation can take now: the free list and the cached pages it may reclaim."""
        return len(self.free) + len(self.ledger.lru)

    def owns(self, seq_id: Hashable) -> bool:
        return seq_id in self.tables

    def prefix_hits(self, tokens: Sequence[int] | None) -> tuple[list[int], list[bytes]]:
        """(pages already holding the prompt's leading full pages, the names of its full pages): at least one prompt
        token is left to compute (its logits start the answer), so the open page is never shared."""
        if tokens is None or not self.ledger.enabled:
            return [], []
        names = page_hashes(tokens, self.page_size, self.ledger.salt)[: (len(tokens) - 1) // self.page_size]
        return self.ledger.lookup(names), names

    # ---- verbs --------------------------------------------------------------------------------------------
    def take_frame(self) -> int:
        """One page from the free list, else the least recently used cached page (callers checked num_free)."""
        page = self.free.pop() if self.free else self.ledger.reclaim()
        self.ledger.take(page)
        self.unsummarized.discard(page)  # rewritten by its new sequence, sealed again when full
        return page

    def open(self, seq_id: Hashable, pages: list[int], hits: list[int], names: list[bytes],
             tokens: Sequence[int] | None, scored: bool) -> None:
        """Record a new sequence holding `pages`, whose first len(hits) came from the prefix cache (already taken)."""
        if not scored:
            self.unscored.add(seq_id)
        self.tables[seq_id] = pages
        self.lengths[seq_id] = self.sealed[seq_id] = 0
        naming = tokens is not None and self.ledger.enabled  # else no id is kept for this sequence
        self.tail[seq_id], self.parent[seq_id] = ([] if naming else None), None
        if hits:
            self.lengths[seq_id], self.sealed[seq_id] = len(hits) * self.page_size, len(hits)
            self.parent[seq_id] = names[len(hits) - 1]
        if naming:
            self.ledger.stats.count(len(tokens), len(hits) * self.page_size)

    def close(self, seq_id: Hashable) -> list[int] | None:
        """Forget a sequence; returns the pages it held (None: unknown id). The caller hands them back (release)."""
        pages = self.tables.pop(seq_id, None)
        for per_sequence in (self.lengths, self.sealed, self.tail, self.parent):
            per_sequence.pop(seq_id, None)
        self.unscored.discard(seq_id)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Pages a sequence let go of: to the free list when no other sequence holds one, else (named) to the LRU."""
        self.free.extend(p for p in reversed(pages) if self.ledger.release(p))

    def record_tokens(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """The ids of the tokens the next step writes for this sequence, in order (they name its sealed pages)."""
        tail = self.tail.get(seq_id)
        if tail is not None:  # a step that failed and is run again recorded its ids already: drop them first
            del tail[self.lengths[seq_id] - self.sealed[seq_id] * self.page_size :]
            tail.extend(int(t) for t in token_ids)

    def advance(self, seq_id: Hashable, length: int) -> tuple[int, list[int]]:
        """The sequence now holds `length` tokens: returns (pages sealed before, the pages it filled now), names
        those pages (prefix caching) and, for an unscored sequence, defers their summaries (unsummarized)."""
        self.lengths[seq_id] = length
        before, full = self.sealed[seq_id], length // self.page_size
        sealed_now = self.tables[seq_id][before:full]
        if seq_id in self.unscored:
            self.unsummarized.update(sealed_now)
        self.sealed[seq_id] = full
        tail = self.tail.get(seq_id)
        if sealed_now and tail is not None:
            parent = self.ledger.name_run(sealed_now, tail, self.page_size, self.parent[seq_id])
            self.tail[seq_id], self.parent[seq_id] = (tail, parent) if parent is not None else (None, None)
        return before, sealed_now
