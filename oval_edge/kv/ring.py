"""The sliding-window layers' K/V: a ring of pages per sequence, allocated once with the pool (Gemma 2/3).

A sliding layer's query at position t reads only positions (t - W, t] (W = the window, transformers'
`kv_idx > q_idx - sliding_window`). Those span at most R = ceil((W - 1) / P) + 1 pages, so each sequence gets R
pages per sliding layer and logical page j lives in ring page j mod R: writing page j overwrites page j - R, which
no query from then on can reach. The rings have no summaries and are never scored; the pool's paged tensors hold
only the full layers, so a model with 5 of 6 layers sliding (Gemma 3) spends a page of budget on 1/6 of the bytes.

Tensors: k, v [sliding layers, sequences * R, kv_heads, page_size, D] (D: geometry.ring_dim, Gemma 4's 256 beside
its paged layers' 512); ring r owns pages r*R .. r*R + R - 1.
`sequences` is how many sequences may hold pages at once (the engine's max_batch): a sequence that finds no free
ring waits like one that finds no free page.

Prefix caching (`snapshots` > 0): a cached page chain gives back the full layers' K/V, but the sliding layers'
window before it is gone from the rings, so where a step ends on a page boundary the sequence's R ring pages of
every sliding layer are copied into one of `snapshots` more rings (snapshots.py names them), and a prompt that maps
cached pages up to such a boundary starts its rings from a copy. Ring page j holds logical page lp with lp = j mod
R in every ring, so a ring copied whole keeps each position where a later step looks for it.
"""

from __future__ import annotations

from typing import Hashable

import torch

from oval_edge.geometry import KVGeometry

from .snapshots import SnapshotNames


def ring_row(geometry: KVGeometry, base, position):
    """Head-0 row of `position` in a sequence's ring that starts at ring page `base`, in a sliding layer's
    [pages * Hkv * P, D] view (head h is P rows further). Ints or tensors alike (the static step passes tensors)."""
    g = geometry
    return (base + (position // g.page_size) % g.ring_pages) * g.kv_heads * g.page_size + position % g.page_size


class SlidingRings:
    def __init__(self, geometry: KVGeometry, sequences: int, dtype: torch.dtype, device: torch.device,
                 snapshots: int = 0) -> None:
        if sequences < 1 or snapshots < 0:
            raise ValueError(f"ring sequences={sequences} must be >= 1 (how many sequences hold pages at once) and "
                             f"snapshots={snapshots} >= 0")
        g = geometry
        self.geometry, self.sequences, self.ring_pages, self.snapshots = g, sequences, g.ring_pages, snapshots
        self.index = {layer: i for i, layer in enumerate(g.ring_layers)}  # model layer -> row of k / v
        # rings 0 .. sequences - 1 run; snapshot j is ring sequences + j
        shape = (len(g.ring_layers), (sequences + snapshots) * self.ring_pages, g.kv_heads, g.page_size, g.ring_dim)
        # The only allocations the rings ever make.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_rows = [self.k[i].view(-1, g.ring_dim) for i in range(shape[0])]  # [pages * Hkv * P, D] views
        self.v_rows = [self.v[i].view(-1, g.ring_dim) for i in range(shape[0])]
        self._free: list[int] = list(range(sequences - 1, -1, -1))
        self._owner: dict[Hashable, int] = {}
        self.names = SnapshotNames(snapshots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def take(self, seq_id: Hashable) -> bool:
        """Give the sequence a ring; False (nothing taken) when every ring is held."""
        if not self._free:
            return False
        self._owner[seq_id] = self._free.pop()
        return True

    def release(self, seq_id: Hashable) -> None:
        ring = self._owner.pop(seq_id, None)
        if ring is not None:
            self._free.append(ring)
        self.names.forget(seq_id)

    # ---- snapshots (prefix caching) -----------------------------------------------------------------------
    def has_snapshot(self, name: bytes) -> bool:
        return self.names.has(name)

    def snapshot(self, seq_id: Hashable, name: bytes, kind: str) -> bool:
        """Copy the sequence's rings (it just ended a step on the page boundary `name` names) into a snapshot ring;
        False when none can be had (nothing is copied)."""
        target, fresh = self.names.place(seq_id, name, kind)
        if target is None:
            return False
        if fresh:
            self._copy(self._owner[seq_id], self.sequences + target)
        return True

    def restore(self, seq_id: Hashable, name: bytes) -> None:
        """Start the sequence's rings (it holds one) from the snapshot `name`."""
        self._copy(self.sequences + self.names.use(name), self._owner[seq_id])

    def _copy(self, source: int, target: int) -> None:
        """Ring `source`'s R pages of every sliding layer, K and V, over ring `target`'s."""
        R = self.ring_pages
        for tensor in (self.k, self.v):
            tensor[:, target * R : (target + 1) * R].copy_(tensor[:, source * R : (source + 1) * R])

    def base(self, seq_id: Hashable) -> int:
        """The first ring page of the sequence's ring."""
        return self._owner[seq_id] * self.ring_pages

    def write_plan(self, seq_ids, new_tokens, lengths_after) -> tuple[list[int], list[int]]:
        """(token indices into the step's N new tokens, their head-0 flat slots) that the step writes to the rings.

        A chunk longer than the ring keeps only its tail: the tokens of its last R pages, so no slot is written
        twice in one step (index_copy_ with repeated indices keeps an arbitrary one)."""
        g, R = self.geometry, self.ring_pages
        tokens, slots, offset = [], [], 0
        for sid, n, end in zip(seq_ids, new_tokens, lengths_after):
            start = end - n
            first = max(start, ((end - 1) // g.page_size - R + 1) * g.page_size)
            base = self.base(sid)
            for position in range(first, end):
                tokens.append(offset + position - start)
                slots.append(ring_row(g, base, position))
            offset += n
        return tokens, slots

    def check_invariants(self) -> None:
        owned = list(self._owner.values())
        assert len(set(owned)) == len(owned), "a ring held by two sequences"
        assert not set(owned) & set(self._free), "a ring both held and free"
        assert len(owned) + len(self._free) == self.sequences, "rings were lost or duplicated"
        self.names.check_invariants()
