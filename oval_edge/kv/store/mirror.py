"""The dense layers' K/V for every page id, in memory: what a dense layer reads when pages live on disk.

Why: a dense layer (OVAL's first `dense_layers`) reads every page of its context every step. With pages on disk
that is one read per stored page per dense layer per step (at 8k tokens on SmolLM2 ~400 reads, 9 MB, a step), and
copying them with the resident pages into one buffer each step costs as much again. So each mirrored layer keeps
its rows of every page id [R + C + S] here: written beside the pool's rows (`write_rows`), a stored page's rows
copied within the mirror when it is spilled (`spill`), and a dense layer reads the mirror with the page table's
ids as they are: no remapping, no copy, no disk. The sparse layers' rows of stored pages live only on disk.
Cost: the mirrored layers' share of the store's bytes (mirrored layers / layers), allocated once with the pool
and counted in the budget (runtime/engine/setup.py).
"""

from __future__ import annotations

import torch


class DenseMirror:
    """K/V (and int8 scales) of the first `layers` paged rows for `pages` page ids: [layers, pages, Hkv, P, D]."""

    def __init__(self, pool, layers: int, pages: int) -> None:
        self.layers = layers
        d = pool.geometry.head_dim
        self.k = torch.zeros((layers, pages) + tuple(pool.k.shape[2:]), dtype=pool.k.dtype)
        self.v = torch.zeros_like(self.k)
        self.k_rows = [self.k[i].view(-1, d) for i in range(layers)]  # [pages * Hkv * P, D] views, as the pool's
        self.v_rows = [self.v[i].view(-1, d) for i in range(layers)]
        self.k_scale = self.v_scale = None
        self.scale_rows = [None] * layers
        if pool.int8 is not None:  # per-row scales [layers, pages, Hkv, P] fp32
            shape = (layers, pages) + tuple(pool.int8.k_scale.shape[2:])
            self.k_scale = torch.zeros(shape, dtype=pool.int8.k_scale.dtype)
            self.v_scale = torch.zeros(shape, dtype=pool.int8.v_scale.dtype)
            self.scale_rows = [(self.k_scale[i].view(-1), self.v_scale[i].view(-1)) for i in range(layers)]

    @staticmethod
    def bytes_for(geometry, layers: int, pages: int) -> int:
        """What the mirror allocates (the budget counts it): layers x pages x one layer of a page's K/V (+scales)."""
        return layers * pages * (geometry.page_size * geometry.kv_bytes_per_token // geometry.paged_layers)

    def holds(self, row: int) -> bool:
        return 0 <= row < self.layers

    def nbytes(self) -> int:
        tensors = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.k_scale is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def wrote(self, pool, layer: int, row: int, slots: torch.Tensor) -> None:
        """The pool just wrote rows `slots` [n] of model layer `layer` (paged row `row`): the same rows here."""
        if not self.holds(row):
            return
        self.k_rows[row].index_copy_(0, slots, pool.k_rows[layer].index_select(0, slots))
        self.v_rows[row].index_copy_(0, slots, pool.v_rows[layer].index_select(0, slots))
        if self.k_scale is not None:
            for mine, theirs in zip(self.scale_rows[row], pool.scale_rows[layer]):
                mine.index_copy_(0, slots, theirs.index_select(0, slots))

    def spill(self, frame: int, page: int) -> None:
        """Frame `frame` leaves for the stored id `page`: its mirrored rows go with it (the frame is reused next)."""
        for t in (self.k, self.v) + ((self.k_scale, self.v_scale) if self.k_scale is not None else ()):
            t[:, page] = t[:, frame]

    def readable(self, row: int, flat: torch.Tensor):
        """(k_rows, v_rows, flat, scales) of paged row `row`: every id of `flat` [B, Hkv, T] read where it is."""
        return self.k_rows[row], self.v_rows[row], flat, self.scale_rows[row]
