"""Which snapshot slot holds which page boundary's copy, for prefix caching past what pages give back.

A cached page chain gives back K/V, not what a sequence keeps beside its pages: a hybrid's layer states
(state.py) or the sliding layers' windows in their rings (ring.py). Where a step ends on a page boundary the owner
copies that into one of a fixed number of snapshot slots, named by the boundary page's prefix-cache name (the hash
of every token before it). Each running sequence keeps at most one name per kind: its latest boundary in prefill
(the scheduler ends a chunk at the prompt's last full page, so that is the prompt's) and its latest in decode; when
it ends they stay, evicted least recently used first. A request whose prompt maps cached pages maps only as far as
the last page with a snapshot, and starts from a copy of it. This class is the bookkeeping only; the owners copy.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class SnapshotNames:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # page name -> snapshot slot, least recent first
        self._free: list[int] = list(range(slots - 1, -1, -1))
        self._kept: dict[Hashable, dict[str, bytes]] = {}  # a running sequence's snapshots: kind -> name

    def has(self, name: bytes) -> bool:
        return name in self._cached

    def place(self, seq_id: Hashable, name: bytes, kind: str) -> tuple[int | None, bool]:
        """(slot, fresh) for the sequence's snapshot at boundary `name` ("prefill" / "decode" kind): the slot
        already holding `name` (fresh False: nothing to copy), else the one its previous snapshot of this kind used,
        a free one, or the least recently used one no running sequence keeps (fresh True: copy into it). (None,
        False) when none can be had."""
        kept = self._kept.setdefault(seq_id, {})
        if name in self._cached:
            self._cached.move_to_end(name)
            kept[kind] = name
            return self._cached[name], False
        previous = kept.get(kind)
        # names another sequence (or this one's other kind) keeps: never overwritten or evicted
        held = {n for sid, names in self._kept.items() for k, n in names.items() if (sid, k) != (seq_id, kind)}
        if previous is not None and previous not in held and previous in self._cached:
            target = self._cached.pop(previous)
        elif self._free:
            target = self._free.pop()
        else:
            victim = next((n for n in self._cached if n not in held and n != previous), None)
            if victim is None:
                return None, False
            target = self._cached.pop(victim)
        self._cached[name] = target
        kept[kind] = name
        return target, True

    def use(self, name: bytes) -> int:
        """The slot holding boundary `name` (a restore: it becomes the most recently used)."""
        self._cached.move_to_end(name)
        return self._cached[name]

    def forget(self, seq_id: Hashable) -> None:
        """The sequence ended: its snapshots stay cached, evictable now."""
        self._kept.pop(seq_id, None)

    def check_invariants(self) -> None:
        cached = list(self._cached.values())
        assert len(set(cached)) == len(cached) and not set(cached) & set(self._free), \
            "a snapshot slot holds two names or is both free and used"
        assert len(cached) + len(self._free) == self.slots, "snapshot slots were lost"
        assert all(n in self._cached for names in self._kept.values() for n in names.values()), \
            "a running sequence keeps a snapshot that is gone"
