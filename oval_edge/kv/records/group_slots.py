"""Which slot holds the coarse record of a page group (two-level scoring; group_record.py, grouped.py).

A group's record is keyed by its last physical page (a page's prefix-cache name hashes every page before it, so a
shared last page means a shared group), but only one page in G is a group's last: a record slot for every page
would spend ~G times the bytes the coarse level needs (at G = 16 that was ~7% of a page's budget). The pool holds
SLOTS_PER_GROUP * pages / G slots and this map:

    slot_of [pages] int64 (device): the slot of the record whose group ends at that physical page, -1 if none.

-1 also covers a shortfall: more live groups than slots. Without prefix sharing a pool of N pages holds at most
N / G complete groups; sharing adds at most one group per sequence whose prefix ends inside a group, and cached
pages keep their records until a new sequence takes the page, so a pool of many short sequences sharing a long
prefix can run out. A group without a record then counts as having an unbounded mass (grouped.py): it is always
among the groups scored finely, never silently dropped. Slots are taken first from the free list, then from the
record of a page no sequence holds (a cached prefix page), and only then does a group go without.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from oval_edge.geometry import SLOTS_PER_GROUP  # slots per G pages: the pages' groups + one per diverging sequence


def group_slot_count(pages: int, group_pages: int) -> int:
    """Coarse record slots of a pool of `pages` pages (0 without two-level scoring)."""
    return SLOTS_PER_GROUP * pages // group_pages if group_pages else 0


class GroupSlots:
    """The page -> coarse record slot map and its free list (host bookkeeping, one device tensor)."""

    def __init__(self, pages: int, slots: int, device: torch.device) -> None:
        self.count = slots
        self.slot_of = torch.full((pages,), -1, dtype=torch.int64, device=device)
        self._slot: dict[int, int] = {}  # page -> slot (mirrors slot_of on the host)
        self._free = list(range(slots - 1, -1, -1))  # a stack, lowest slot first
        self.shortfalls = 0  # groups sealed without a slot (scored finely every step instead)

    @classmethod
    def for_pool(cls, geometry, pages: int, device: torch.device) -> GroupSlots:
        """A pool's slots: group_slot_count of its pages with two-level oval scoring, else none."""
        oval = "oval" in geometry.summary_kinds
        return cls(pages, group_slot_count(pages, geometry.group_pages) if oval else 0, device)

    def has(self, page: int) -> bool:
        return page in self._slot

    @property
    def used(self) -> int:
        return len(self._slot)

    def assign(self, pages: Sequence[int], spare: Callable[[int], bool]) -> list[int]:
        """A slot for each group-last page in `pages` (its own if it has one); -1 where none is left. spare(page):
        whether a page's record may be given up (no sequence holds the page)."""
        slots, moved = [], []
        for page in pages:
            slot = self._slot.get(page)
            if slot is None:
                slot = self._free.pop() if self._free else self._steal(spare, pages)
                if slot < 0:
                    self.shortfalls += 1  # slot_of already says -1
                else:
                    self._slot[page] = slot
                    moved.append((page, slot))
            slots.append(slot)
        if moved:
            index, value = zip(*moved)
            self.slot_of.index_copy_(0, torch.tensor(index, device=self.slot_of.device),
                                     torch.tensor(value, dtype=torch.int64, device=self.slot_of.device))
        return slots

    def _steal(self, spare: Callable[[int], bool], keep: Sequence[int]) -> int:
        """The slot of a page no sequence holds (its group can be rebuilt if the page is mapped again), or -1."""
        for page in self._slot:
            if spare(page) and page not in keep:
                self.release(page)
                return self._free.pop()
        return -1

    def release(self, page: int) -> None:
        """The page's record is gone (the page is rewritten by a new sequence, or its slot went to another group)."""
        slot = self._slot.pop(page, None)
        if slot is not None:
            self._free.append(slot)
            self.slot_of[page] = -1

    def lacking(self, groups: Sequence[Sequence[int]]) -> list[Sequence[int]]:
        """The groups (physical pages in logical order) whose last page has no record."""
        return [group for group in groups if group[-1] not in self._slot]

    def check_invariants(self) -> None:
        """AssertionError unless every slot is free or held by one page, and slot_of mirrors the host map."""
        held = list(self._slot.values())
        assert len(set(held)) == len(held), "a coarse record slot is held by two pages"
        assert not set(held) & set(self._free) and len(held) + len(self._free) == self.count, "slots were lost"
        want = torch.full_like(self.slot_of, -1)
        for page, slot in self._slot.items():
            want[page] = slot
        assert torch.equal(self.slot_of, want), "slot_of disagrees with the slots held"
