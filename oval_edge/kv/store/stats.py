"""What the page store counts, for /metrics and bench: spills, recalls (hits and misses of the recall frames),
bytes moved, reads per step and the latency of each layer's reads."""

from __future__ import annotations

from dataclasses import dataclass, field

# Latency buckets of one layer's recall (seconds), for /metrics' histogram.
RECALL_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


@dataclass
class StoreStats:
    spills: int = 0  # pages written to the store
    recall_hits: int = 0  # stored pages a layer's selection named that were already in its recall frames
    recall_misses: int = 0  # ... that had to be read
    transient_reads: int = 0  # stored page-layers read for one wide read (a prompt chunk over a long history)
    mirror_reads: int = 0  # dense-layer reads served by the in-memory mirror (mirror.py): no I/O, no copy
    bytes_read: int = 0
    bytes_written: int = 0
    steps: int = 0  # forward steps that read from the store
    reads_per_step: list[int] = field(default_factory=list)  # the last steps' page-layer reads (bounded)
    latency: list[float] = field(default_factory=lambda: [0.0] * (len(RECALL_BUCKETS) + 2))  # counts..., sum

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(RECALL_BUCKETS):
            if seconds <= bound:
                self.latency[i] += 1
                break
        else:
            self.latency[len(RECALL_BUCKETS)] += 1
        self.latency[-1] += seconds
