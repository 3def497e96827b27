"""What the pool keeps in memory beside a page store: recall frames, the pages each sequence keeps resident, and
the dense layers' mirror (mirror.py). Built by the engine (runtime/engine/setup.py) from the OVAL config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoreLayout:
    """recall_pages: frames per paged layer that stored pages are recalled into (a sparse selection's pages).
    sink_pages / window_pages: each sequence's first and last pages, kept resident (every step reads them).
    mirrored_layers: the first paged layers whose stored pages are also kept in memory (the dense layers: they read
    every page every step, so a disk read per page per step would cost more than the memory saved; 0: none)."""

    recall_pages: int = 1
    sink_pages: int = 1
    window_pages: int = 3
    mirrored_layers: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.recall_pages, int) or self.recall_pages < 1:
            raise ValueError(f"recall_pages={self.recall_pages!r} must be an integer >= 1 (frames a layer recalls "
                             "stored pages into)")
        for name in ("sink_pages", "window_pages", "mirrored_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0")
