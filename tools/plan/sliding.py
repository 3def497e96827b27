"""The KV cache of sliding-window layers: a ring of pages per running sequence, sized once (issue 21, item 2).

The rule (the pool side points at these functions so plan and serve size the same thing):
- full layers keep pages as every layer did before: the pool's bytes_per_page counts K, V and the summaries of the
  FULL layers only;
- each sliding layer keeps, per running sequence, a ring of R = ceil((W - 1) / P) + 1 pages of K/V only (no
  summaries, never scored): a query at position t reads positions t - W + 1 .. t, which span at most
  ceil((W - 1) / P) + 1 pages of P tokens wherever t falls in its page;
- the rings are allocated once for max_batch sequences and taken from the budget before the full pages are sized:
  ring bytes = max_batch * R * P * 2 (K and V) * L_sliding * Hkv * D * dtype_bytes.
"""

from __future__ import annotations

import math

from .model import ModelShape


def ring_pages(window: int, page_size: int) -> int:
    """R = ceil((W - 1) / P) + 1: the pages a window of W tokens can touch."""
    if window < 1 or page_size < 1:
        raise ValueError(f"a sliding ring needs window >= 1 and page_size >= 1, got window={window}, "
                         f"page_size={page_size}")
    return math.ceil((window - 1) / page_size) + 1


def sliding_ring_bytes(shape: ModelShape, page_size: int, max_batch: int, dtype_bytes: int) -> int:
    """Bytes of every sliding layer's rings for `max_batch` sequences (0 for a model without sliding layers)."""
    if shape.sliding_layers == 0:
        return 0
    ring = ring_pages(shape.sliding_window, page_size) * page_size  # token slots per sequence and layer
    return max_batch * ring * 2 * shape.sliding_layers * shape.kv_heads * shape.head_dim * dtype_bytes
