"""Hybrid models' per-sequence layer states, allocated once with the pool ([R-kinds-and-tiers]).

A state layer (oval_edge/state_layout.py: Qwen3.5's Gated DeltaNet, LFM2's short conv) keeps no K/V: each sequence
owns one slot of fixed-size tensors that the layer reads and updates in place at every step,

    conv[i]       [slots, conv_channels, kernel - 1]   the last inputs of the layer's causal conv (activations dtype)
    recurrent[i]  [slots, heads, key_dim, value_dim]   the delta rule's matrix (fp32; linear attention only)

`slots` is how many sequences may run at once (the engine's max_batch): a sequence that finds no free slot waits
like one that finds no free page. A slot is zeroed when a sequence takes it (a fresh sequence's state is zero;
a preempted one recomputes from its prompt).

Prefix caching: `snapshots` more slots (allocated with the rest) keep copies of states taken where a step ended
on a page boundary (snapshots.py: which slot holds which boundary); a request whose prompt maps cached pages maps
only as far as the last page with a snapshot, and starts from a copy of it (restore).
"""

from __future__ import annotations

from typing import Hashable

import torch

from oval_edge.state_layout import StateLayout

from .snapshots import SnapshotNames


class SequenceStates:
    def __init__(self, layout: StateLayout, slots: int, dtype: torch.dtype, device: torch.device,
                 snapshots: int = 0) -> None:
        if slots < 1 or snapshots < 0:
            raise ValueError(f"state slots={slots} must be >= 1 (how many sequences run at once) and "
                             f"snapshots={snapshots} >= 0")
        self.layout, self.slots, self.snapshots = layout, slots, snapshots
        self.index = {s.layer: i for i, s in enumerate(layout.layers)}  # model layer -> its conv / recurrent entry
        total = slots + snapshots  # running slots 0 .. slots - 1, then the snapshots
        # The only allocations the states ever make.
        self.conv = [torch.zeros((total, s.conv_channels, s.conv_width), dtype=dtype, device=device)
                     for s in layout.layers]
        self.recurrent = [torch.zeros((total, s.heads, s.key_dim, s.value_dim), dtype=torch.float32, device=device)
                          if s.kind == "linear_attention" else None for s in layout.layers]
        self._free: list[int] = list(range(slots - 1, -1, -1))
        self._owner: dict[Hashable, int] = {}
        self.names = SnapshotNames(snapshots)  # snapshot j lives in slot slots + j

    @property
    def num_free(self) -> int:
        return len(self._free)

    def tensors(self) -> list[torch.Tensor]:
        return self.conv + [t for t in self.recurrent if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def take(self, seq_id: Hashable) -> bool:
        """Give the sequence a zeroed slot; False (nothing taken) when every slot is held."""
        if not self._free:
            return False
        slot = self._owner[seq_id] = self._free.pop()
        for tensor in self.tensors():
            tensor[slot].zero_()
        return True

    def release(self, seq_id: Hashable) -> None:
        slot = self._owner.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
        self.names.forget(seq_id)

    # ---- snapshots (prefix caching) -----------------------------------------------------------------------
    def has_snapshot(self, name: bytes) -> bool:
        return self.names.has(name)

    def snapshot(self, seq_id: Hashable, name: bytes, kind: str) -> bool:
        """Copy the sequence's state (it just ended a step on the page boundary `name` names) into a snapshot slot
        (SnapshotNames.place picks it). False when none can be had (nothing is copied)."""
        target, fresh = self.names.place(seq_id, name, kind)
        if target is None:
            return False
        if fresh:
            source = self._owner[seq_id]
            for tensor in self.tensors():
                tensor[self.slots + target].copy_(tensor[source])
        return True

    def restore(self, seq_id: Hashable, name: bytes) -> None:
        """Start the sequence (holding a slot) from the snapshot `name`."""
        source, target = self.slots + self.names.use(name), self._owner[seq_id]
        for tensor in self.tensors():
            tensor[target].copy_(tensor[source])

    def holders(self) -> set:
        """The sequences holding a slot."""
        return set(self._owner)

    def slot(self, seq_id: Hashable) -> int:
        return self._owner[seq_id]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(conv [slots, C, K - 1], recurrent [slots, H, dk, dv] or None) of model layer `layer`."""
        i = self.index[layer]
        return self.conv[i], self.recurrent[i]

    def check_invariants(self) -> None:
        owned = list(self._owner.values())
        assert len(set(owned)) == len(owned), "a state slot held by two sequences"
        assert not set(owned) & set(self._free), "a state slot both held and free"
        assert len(owned) + len(self._free) == self.slots, "state slots were lost or duplicated"
        self.names.check_invariants()
