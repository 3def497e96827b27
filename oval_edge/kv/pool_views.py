"""`PoolViews`: the page pool's read-only questions (sizes, tables, storage), split from pool.py's verbs."""

from __future__ import annotations

from typing import Hashable

import torch

from .invariants import check_pool_invariants


class PoolViews:
    """Mixed into PagePool: what it holds, never a change to it."""

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def num_free(self) -> int:
        """Frames an allocation can take now: the free list and the cached pages it may reclaim."""
        return len(self._free) + len(self.ledger.lru)

    @property
    def num_takeable(self) -> int:
        """Pages an allocation can take now: num_free and the page store's free blocks (store/tier.py)."""
        return self.num_free + (len(self.store.free_blocks) if self.store is not None else 0)

    @property
    def num_cached(self) -> int:
        """Pages no sequence holds that keep their contents for a later prefix hit (part of num_free)."""
        return len(self.ledger.lru)

    @property
    def num_used(self) -> int:
        """Pages some sequence holds (a shared prefix page counts once)."""
        return len(self.ledger.refs)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds, its page store included."""
        return (self.num_pages + (self.store.blocks if self.store else 0)) * self.page_size

    def capacity_note(self) -> str:
        """' (in memory N tokens, page store M)' with a page store, else '': what a refusal message adds."""
        if self.store is None:
            return ""
        stored = self.store.blocks * self.page_size
        return f" (the in-memory pool holds {self.resident_tokens} tokens, the page store {stored})"

    @property
    def resident_tokens(self) -> int:
        """Tokens the in-memory frames hold (capacity_tokens without a store)."""
        return self.num_pages * self.page_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        rings = [self.rings.k, self.rings.v] if self.rings is not None else []
        return [self.k, self.v, *self.summaries.values(), *rings, *(self.int8.tensors() if self.int8 else [])]

    def owns(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def page_table(self, seq_id: Hashable) -> list[int]:
        return list(self._tables[seq_id])

    def length(self, seq_id: Hashable) -> int:
        return self._lengths[seq_id]

    def sealed_pages(self, seq_id: Hashable) -> int:
        return self._sealed[seq_id]

    def sequences(self) -> list:
        return list(self._tables)

    def storage_pointers(self) -> tuple[int, ...]:
        """Data pointers of every pool tensor: equal across calls proves nothing was reallocated."""
        return tuple(t.data_ptr() for t in self._tensors())

    def check_invariants(self) -> None:
        """AssertionError if a page (or ring) is lost, in two states, shared without its refcount, or a table is
        inconsistent (used by tests; invariants.py). Free + cached + owned = all pages."""
        check_pool_invariants(self)
