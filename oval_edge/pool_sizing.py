"""How many pages a memory budget buys ([R-pool]): the pool-sizing arithmetic over a KVGeometry.

No torch at import time: the planner (`oval-edge plan`) uses this without loading any model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .geometry import KVGeometry
from .units import format_bytes


@dataclass(frozen=True)
class PoolSizing:
    """How many pages a budget buys, with the arithmetic kept for the startup report and /metrics."""

    budget_bytes: int
    weight_bytes: int
    workspace_bytes: int
    reserve_bytes: int
    bytes_per_page: int
    pages: int
    ring_bytes: int = 0  # the sliding layers' rings (oval_edge/kv/ring.py), fixed by the sequences they serve
    state_bytes: int = 0  # hybrid models' conv and recurrent states (oval_edge/kv/state.py), likewise

    @property
    def pool_bytes(self) -> int:
        return self.pages * self.bytes_per_page + self.ring_bytes + self.state_bytes

    def explain(self) -> str:
        left = (self.budget_bytes - self.weight_bytes - self.workspace_bytes - self.reserve_bytes - self.ring_bytes
                - self.state_bytes)
        rings = f" - sliding-layer rings {format_bytes(self.ring_bytes)}" if self.ring_bytes else ""
        rings += f" - layer states {format_bytes(self.state_bytes)}" if self.state_bytes else ""
        return (
            f"pages = floor((budget {format_bytes(self.budget_bytes)} - weights {format_bytes(self.weight_bytes)}"
            f" - workspace {format_bytes(self.workspace_bytes)} - reserve {format_bytes(self.reserve_bytes)}{rings})"
            f" / {self.bytes_per_page} B per page) = floor({left} / {self.bytes_per_page}) = {self.pages}"
            f" -> pool {format_bytes(self.pool_bytes)}"
        )


def size_pool(
    budget_bytes: int,
    weight_bytes: int,
    geometry: KVGeometry,
    workspace_bytes: int = 0,
    reserve_bytes: int = 0,
    ring_sequences: int = 0,
    state_snapshots: int = 0,
    ring_snapshots: int = 0,
) -> PoolSizing:
    """pages = floor((budget - weights - workspace - reserve - rings - states) / bytes_per_page), where the sliding
    layers' rings and the state layers' states cost geometry.sequence_bytes for each of `ring_sequences` sequences
    (the engine's max_batch: each running sequence holds one), plus `state_snapshots` more states and
    `ring_snapshots` more rings for prefix caching (oval_edge/kv/state.py, ring.py).

    Raises ValueError with the minimum budget when not even one page fits, so the user knows what to set.
    """
    ring_bytes = (ring_sequences + ring_snapshots) * geometry.ring_bytes_per_sequence
    state_bytes = (ring_sequences + state_snapshots) * geometry.state_bytes_per_sequence
    reserve_bytes += ring_bytes + state_bytes  # spent before any page, like the reserve (split out again below)
    left = budget_bytes - weight_bytes - workspace_bytes - reserve_bytes
    pages = left // geometry.bytes_per_page if left > 0 else 0
    if pages < 1:
        minimum = weight_bytes + workspace_bytes + reserve_bytes + geometry.bytes_per_page
        raise ValueError(
            f"memory_budget={format_bytes(budget_bytes)} leaves no room for the KV pool: weights "
            f"{format_bytes(weight_bytes)} + workspace {format_bytes(workspace_bytes)} + reserve "
            f"{format_bytes(reserve_bytes)} already take {format_bytes(budget_bytes - left)}; "
            f"the minimum for one page is {format_bytes(minimum)} ({minimum} bytes)"
        )
    return PoolSizing(budget_bytes, weight_bytes, workspace_bytes, reserve_bytes - ring_bytes - state_bytes,
                      geometry.bytes_per_page, int(pages), ring_bytes, state_bytes)
