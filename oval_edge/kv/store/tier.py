"""The pool's disk tier: which pages live in the store, spilling them, and recalling what selection names.

Page ids (what page tables hold and records are indexed by):
    [0, R)            resident frames, allocatable (the pool's num_pages)
    [R, R + C)        recall frames: per layer, frame R + i holds whichever stored page that layer recalled last
                      into slot i (they never appear in a table)
    [R + C, R + C + S) stored pages: id R + C + b lives in block b of the page store (page_file.py)
K/V tensors have R + C frames; records (summaries) have R + C + S slots, so every page is scored in memory.

Lifecycle: a table takes a store id as a *reservation* when no frame is free (nothing is written yet). Before a
step writes a page, `make_resident` gives it a frame: a free one, a cached one, or one taken from a sealed page that
leaves for the store in a swap: that page's K/V (every layer) is written to the reservation's block, its records
are copied to the block's id, and the two table entries trade places. The pages that stay are each sequence's sink
and window pages (what every step reads) unless nothing else can go. A stored page's name is dropped from the
prefix cache (it is no longer a frame to share).

Reads (`readable`): a step's flat slots [B, Hkv, T] that name stored pages are redirected. Up to C stored pages
per layer (a sparse selection) are recalled into the layer's recall frames, kept in an LRU across steps; more (a
prefill chunk over a long history) are read, with the resident pages they also need, into a transient buffer for
that one read. Dense layers read their in-memory mirror of every page id (mirror.py) instead. Either way attention
reads exactly the bytes the page held.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from .layout import StoreLayout
from .mirror import DenseMirror
from .page_file import PageStore, StoreError
from .stats import StoreStats

def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as a writable buffer (bf16 included: viewed as bytes)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class StoreTier:
    """The disk tier of one PagePool (built by it; owns the block free list and the recall frames' LRUs)."""

    def __init__(self, pool, store: PageStore, layout: StoreLayout) -> None:
        if pool.device.type != "cpu":
            raise ValueError("the page store reads into CPU memory; on CUDA (a Jetson's GPU shares the same DRAM) "
                             "it is not built yet: leave kv_store unset")
        layers = pool.geometry.paged_layers
        if layout.mirrored_layers > layers:
            raise ValueError(f"mirrored_layers={layout.mirrored_layers} exceeds the {layers} paged layers")
        self.pool, self.store = pool, store
        self.recall_pages = layout.recall_pages
        self.first_recall = pool.num_pages  # R
        self.base = pool.num_pages + layout.recall_pages  # R + C: the id of block 0
        self.keep_head, self.keep_tail = layout.sink_pages, layout.window_pages  # kept resident
        self.mirror = DenseMirror(pool, layout.mirrored_layers, self.base + store.blocks)
        self.free_blocks: list[int] = list(range(store.blocks - 1, -1, -1))
        self.written: set[int] = set()
        self.lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(layers)]  # id -> recall slot
        self.free_slots: list[list[int]] = [list(range(self.recall_pages - 1, -1, -1)) for _ in range(layers)]
        # id -> frame holding it, per layer (identity for resident ids; recalled stored ids point at their frame)
        self.frame_of = torch.arange(self.base + store.blocks).repeat(layers, 1)
        self.stats = StoreStats()
        self._step_reads = 0

    # ---- ids ---------------------------------------------------------------------------------------------
    @property
    def blocks(self) -> int:
        return self.store.blocks

    def is_stored(self, page: int) -> bool:
        return page >= self.base

    def reserve(self) -> int:
        """A store id for a table (unwritten until a swap fills it). Callers checked free_blocks."""
        return self.base + self.free_blocks.pop()

    def release(self, page: int) -> None:
        """A stored id leaves its table: its block is free, and no layer may read its old recall again."""
        block = page - self.base
        self.written.discard(block)
        self.forget_recalls(page)
        self.free_blocks.append(block)

    def release_stored(self, pages: list[int]) -> list[int]:
        """Release the stored ids among a freed table's pages; the resident ones, for the pool to free."""
        for page in [p for p in pages if self.is_stored(p)]:
            self.release(page)
        return [p for p in pages if not self.is_stored(p)]

    def forget_recalls(self, page: int) -> None:
        for layer, lru in enumerate(self.lru):
            slot = lru.pop(page, None)
            if slot is not None:
                self.free_slots[layer].append(slot)
                self.frame_of[layer, page] = page

    # ---- residency ---------------------------------------------------------------------------------------
    def make_resident(self, seq_id, end_tokens: int) -> bool:
        """Give frames to the pages the sequence's next tokens (up to `end_tokens`) are written into; False if
        no frame can be found (every resident page is open, shared, or a kept sink/window page)."""
        pool = self.pool
        table = pool.tables.tables[seq_id]
        P = pool.page_size
        for logical in range(pool.tables.lengths[seq_id] // P, min(pool.pages_needed(end_tokens), len(table))):
            page = table[logical]
            if page < self.base:
                continue
            frame = self._frame_for(seq_id, page)
            if frame is None:
                return False
            table[logical] = frame
        return True

    def _frame_for(self, seq_id, page: int) -> int | None:
        """A frame for the reservation `page` of seq_id: free or cached (the block goes back), else a swap."""
        pool = self.pool
        if pool.tables.free or pool.ledger.lru:
            frame = pool.tables.free.pop() if pool.tables.free else pool.ledger.reclaim()
            pool.ledger.take(frame)
            pool.unsummarized.discard(frame)
            self.release(page)
            return frame
        victim = self._victim(seq_id)
        if victim is None:
            return None
        owner, logical = victim
        frame = pool.tables.tables[owner][logical]
        try:
            self.spill(frame, page)
        except StoreError as exc:  # nothing moved: the victim keeps its frame; the caller's request fails
            exc.seq_id = seq_id
            raise
        pool.tables.tables[owner][logical] = page
        name = pool.ledger.name_of.pop(frame, None)  # a frame's name; the stored copy is not shared
        if name is not None:
            del pool.ledger.page_of[name]
        return frame  # refs[frame] stays 1: the reservation's table holds it now

    def _victim(self, seq_id) -> tuple[object, int] | None:
        """(sequence, logical page) of the page to store: the oldest sealed, unshared, resident page outside the
        kept sink and window, of seq_id first, then of the sequence holding the most frames."""
        pool = self.pool
        order = [seq_id] + sorted((s for s in pool.tables.tables if s != seq_id and s not in pool.tables.unscored),
                                  key=lambda s: -sum(p < self.base for p in pool.tables.tables[s]))
        for sid in order:
            table, sealed = pool.tables.tables[sid], pool.tables.sealed[sid]
            last_kept = (pool.tables.lengths[sid] - 1) // pool.page_size - self.keep_tail  # pages above it stay
            for logical in range(self.keep_head, min(sealed, last_kept + 1)):
                page = table[logical]
                if page < self.base and pool.ledger.refs.get(page) == 1 and page not in pool.unsummarized:
                    return sid, logical
        return None

    def spill(self, frame: int, page: int) -> None:
        """Write frame's K/V (every paged layer) to page's block and copy its records to page's slots."""
        pool = self.pool
        block = page - self.base
        self.store.write_block(block, [self._buffers(layer, frame) for layer in range(len(self.lru))])
        self.mirror.spill(frame, page)
        self.written.add(block)
        self.forget_recalls(page)  # a recall of the block's previous contents is stale now
        for name, tensor in pool.summaries.items():
            dim = 1 if name in ("kmin", "kmax") else 2  # quest [L, pages, ...]; oval records [L, Hkv, pages, ...]
            tensor.index_copy_(dim, torch.tensor([page]), tensor.index_select(dim, torch.tensor([frame])))
        self.stats.spills += 1
        self.stats.bytes_written += self.store.block_bytes

    def _buffers(self, layer: int, frame: int) -> list[memoryview]:
        """Layer `layer` of frame `frame` as the store lays it out: K, V (+ int8 K and V scales)."""
        pool = self.pool
        out = [_bytes(pool.k[layer, frame]), _bytes(pool.v[layer, frame])]
        if pool.int8 is not None:
            out += [_bytes(pool.int8.k_scale[layer, frame]), _bytes(pool.int8.v_scale[layer, frame])]
        return out

    # ---- reads -------------------------------------------------------------------------------------------
    def readable(self, layer: int, row: int, flat: torch.Tensor, valid: torch.Tensor | None):
        """(k_rows, v_rows, flat, scales) to read the slots `flat` [B, Hkv, T] of model layer `layer` (paged row
        `row`) with: the pool's own rows when no valid slot names a stored page, else see the module docstring."""
        if self.mirror.holds(row):  # a dense layer: every page id's rows are in memory (mirror.py), no disk read
            self.stats.mirror_reads += 1
            return self.mirror.readable(row, flat)
        pool = self.pool
        g = pool.geometry
        span = g.kv_heads * g.page_size  # rows per page in a layer's view
        ids = torch.div(flat, span, rounding_mode="floor")
        stored = ids >= self.base
        if valid is not None:
            stored &= valid
        if not bool(stored.any()):
            return pool.k_rows[layer], pool.v_rows[layer], flat, pool.scale_rows[layer]
        wanted = torch.unique(ids[stored]).tolist()
        unwritten = [p for p in wanted if p - self.base not in self.written]
        if unwritten:
            raise RuntimeError(f"layer {layer} would read stored pages {unwritten[:4]} that hold nothing; "
                               "a page table names a reservation before it was written")
        try:
            return self._read(layer, row, wanted, ids, flat, valid, span, stored)
        except StoreError as exc:  # name the request whose page it was: only that one fails (engine._guarded)
            exc.seq_id = next((s for s, t in pool.tables.tables.items() if set(t) & set(wanted)), None)
            raise

    def _read(self, layer, row, wanted, ids, flat, valid, span, stored):
        pool = self.pool
        if len(wanted) <= self.recall_pages:
            self._recall(row, wanted)
            frames = self.frame_of[row].index_select(0, ids.reshape(-1)).view_as(ids)
            frames = frames.masked_fill(frames >= self.base, 0)  # invalid slots naming unread pages: any frame
            return pool.k_rows[layer], pool.v_rows[layer], flat + (frames - ids) * span, pool.scale_rows[layer]
        return self._transient(layer, row, ids, flat, valid, span)

    def _recall(self, row: int, wanted: list[int]) -> None:
        """Bring the stored pages `wanted` (at most recall_pages) of paged row `row` into its recall frames."""
        lru, free = self.lru[row], self.free_slots[row]
        misses = []
        for page in wanted:
            if page in lru:
                lru.move_to_end(page)
                self.stats.recall_hits += 1
            else:
                misses.append(page)
        if not misses:
            return
        keep = set(wanted)
        started = time.perf_counter()
        taken = []  # (page, slot): every miss gets a slot first, so all its reads can be asked for at once
        for page in misses:
            if free:
                slot = free.pop()
            else:  # the least recently used slot not needed now (hits moved to the end, so the front is free)
                old = next(p for p in lru if p not in keep)
                slot = lru.pop(old)
                self.frame_of[row, old] = old
            taken.append((page, slot))
        try:
            self.store.read_layers([(page - self.base, row, self._buffers(row, self.first_recall + slot))
                                    for page, slot in taken])
        except StoreError:
            free.extend(slot for _, slot in taken)  # none of them holds a page it can be trusted with now
            raise
        for page, slot in taken:
            lru[page] = slot
            self.frame_of[row, page] = self.first_recall + slot
        self._count_reads(len(misses), time.perf_counter() - started)
        self.stats.recall_misses += len(misses)

    def _transient(self, layer: int, row: int, ids: torch.Tensor, flat: torch.Tensor, valid, span: int):
        """Every page the slots name (resident and stored) copied or read into one buffer for this read."""
        pool = self.pool
        if valid is not None:  # invalid slots may name anything (reservations too): point them at frame 0
            ids = torch.where(valid, ids, 0)
        pages = torch.unique(ids)
        frames = pool.k.shape[1]
        local = pages < frames
        k = torch.empty((len(pages),) + pool.k.shape[2:], dtype=pool.k.dtype)
        v = torch.empty_like(k)
        scales = None
        resident = pages[local]
        k[local], v[local] = pool.k[row].index_select(0, resident), pool.v[row].index_select(0, resident)
        if pool.int8 is not None:
            scales = (torch.empty((len(pages),) + pool.int8.k_scale.shape[2:]), torch.empty((len(pages),)
                      + pool.int8.k_scale.shape[2:]))
            scales[0][local] = pool.int8.k_scale[row].index_select(0, resident)
            scales[1][local] = pool.int8.v_scale[row].index_select(0, resident)
        started = time.perf_counter()
        reads = []
        for i in torch.nonzero(~local).flatten().tolist():
            page = int(pages[i])
            if page < self.base:  # a recall frame never appears in a table
                raise RuntimeError(f"page id {page} is a recall frame")
            buffers = [_bytes(k[i]), _bytes(v[i])] + ([_bytes(scales[0][i]), _bytes(scales[1][i])] if scales else [])
            reads.append((page - self.base, row, buffers))
        self.store.read_layers(reads)
        self._count_reads(len(reads), time.perf_counter() - started)
        self.stats.transient_reads += len(reads)
        d = pool.geometry.head_dim
        index = torch.searchsorted(pages, ids).clamp(max=len(pages) - 1)
        rows = (k.view(-1, d), v.view(-1, d))
        return (*rows, index * span + flat % span, None if scales is None else (scales[0].view(-1), scales[1].view(-1)))

    def _count_reads(self, reads: int, seconds: float) -> None:
        self.stats.bytes_read += reads * self.store.layer_bytes
        self._step_reads += reads
        self.stats.observe(seconds)

    def end_step(self) -> None:
        """After a forward step: record how many page-layers it read from the store."""
        if self._step_reads:
            self.stats.steps += 1
            self.stats.reads_per_step = (self.stats.reads_per_step + [self._step_reads])[-256:]
        self._step_reads = 0

    # ---- views -------------------------------------------------------------------------------------------
    def stored_pages(self) -> int:
        return self.store.blocks - len(self.free_blocks)
