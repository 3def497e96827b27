"""The KV page pool: allocated once from the budget, never grown ([R-pool]).

Tensors (per model):
    K, V     [layers, pages, kv_heads, page_size, head_dim]   (kv_int8: int8 codes; `int8` holds their scales
             and the staging of open pages' keys: int8.py)
    quest    kmin, kmax [layers, pages, kv_heads, head_dim]
    oval     mean, basis, coords (+ scales) [paged layers, kv_heads, pages, ...]: page_record.py; group_record.py
With a page store (store/tier.py) K/V hold the resident and recall frames, the summaries every page's record.

A logical page holds the same `page_size` token positions in every layer. Sequences own page tables
(logical page -> physical page). Verbs follow nano-vllm's block manager / vLLM's block pool: few of them, and
"does not fit" is an answer (False / None), never an exception from inside torch.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from oval_edge.geometry import KVGeometry, seal_chunk_pages
from oval_edge.pool_sizing import PoolSizing

from .huge_pages import pool_tensor
from .int8 import Int8Pages
from .prefix_cache import PrefixLedger, page_hashes
from .ring import SlidingRings
from .store.page_file import PageStore
from .store.layout import StoreLayout
from .store.tier import StoreTier
from .pool_views import PoolViews
from .step_index import StepIndex, build_step_index
from .group_record import completed_groups, seal_groups
from .group_slots import GroupSlots
from .summaries import allocate_summaries, seal_pages, stack_output_metric

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PagePool(PoolViews):
    def __init__(
        self,
        geometry: KVGeometry,
        num_pages: int,
        device: str | torch.device = "cpu",
        eta: float = 0.0,
        sizing: PoolSizing | None = None,
        prefix_salt: bytes | None = None,
        ring_sequences: int | None = None,
        stage_pages: int | None = None,
        store: PageStore | None = None,
        store_layout: StoreLayout = StoreLayout(),
    ) -> None:
        """store: the page store (store/page_file.py) for pages beyond the num_pages frames; store_layout: its recall
        frames, the pages each sequence keeps resident and the mirrored dense layers (store/layout.py)."""
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        self.geometry = geometry
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.eta = float(eta)
        self.sizing = sizing
        self.seal_chunk = seal_chunk_pages(geometry)  # pages summarised per batch (bounded transient memory)
        g = geometry
        if store is not None and (g.group_pages or g.ring_layers):
            raise ValueError("the page store does not yet take two-level scoring (group_pages) or sliding-window "
                             "layers; set group_pages=0 or leave kv_store unset")
        dtype = TORCH_DTYPES[g.dtype]
        frames = num_pages + (store_layout.recall_pages if store is not None else 0)
        records = frames + (store.blocks if store is not None else 0)  # every page's record, stored ones too
        shape = (g.paged_layers, frames, g.kv_heads, g.page_size, g.head_dim)
        # The only allocations the pool ever makes: everything below is written in place.
        self.k = pool_tensor(shape, torch.int8 if g.kv_int8 else dtype, self.device)
        self.v = pool_tensor(shape, self.k.dtype, self.device)
        # int8: scales and open pages' keys (int8.py); stage_pages: the engine's need, else 2 x sequences + 8.
        self.int8 = Int8Pages(g, frames, stage_pages or 2 * (ring_sequences or 8) + 8, dtype,
                              self.device) if g.kv_int8 else None
        # Sliding layers keep a ring per sequence (ring.py) for at most ring_sequences (default: pages) sequences.
        self.rings = SlidingRings(g, ring_sequences or num_pages, dtype, self.device) if g.ring_layers else None
        # Model layer -> its row of k / v / summaries (-1: in the rings), and its [rows, head_dim] views (no copy).
        self.paged_index = [-1 if layer in g.ring_layers else g.paged_index(layer) for layer in range(g.layers)]
        self.k_rows = [self.k[i].view(-1, g.head_dim) if i >= 0 else self.rings.k_rows[self.rings.index[layer]]
                       for layer, i in enumerate(self.paged_index)]
        self.v_rows = [self.v[i].view(-1, g.head_dim) if i >= 0 else self.rings.v_rows[self.rings.index[layer]]
                       for layer, i in enumerate(self.paged_index)]
        # layer -> (k, v scales [rows]) of an int8 layer, else None: what attention dequantizes the rows with
        self.scale_rows = [self.int8.scale_rows[i] if self.int8 and i >= 0 else None for i in self.paged_index]
        self.group_slots = GroupSlots.for_pool(g, records, self.device)  # two-level scoring's coarse record slots
        self.summaries = allocate_summaries(g, records, dtype, self.device, self.group_slots)
        self.output_metric: torch.Tensor | None = None  # G^{1/2} [paged layers, Hkv, D, D] for eta > 0
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: recently freed pages first (warm)
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._sealed: dict[Hashable, int] = {}
        # Prefix caching (prefix_cache.py): refcounts, page names, the LRU of cached pages. prefix_salt None: off.
        # Off with sliding layers: a cached page's positions are long gone from the rings.
        self.ledger = PrefixLedger(None if self.rings is not None else prefix_salt)
        self._tail: dict[Hashable, list[int]] = {}  # token ids written past the last named page (None: unknown)
        self._parent: dict[Hashable, bytes | None] = {}  # name of the sequence's last named page
        # Sequences no decode step will score (allocate(scored=False)), and the sealed pages they left without
        # summaries: built only if a scored sequence maps them from the prefix cache (allocate).
        self._unscored: set[Hashable] = set()
        self.unsummarized: set[int] = set()
        self.store = None if store is None else StoreTier(self, store, store_layout)

    # ---- allocation --------------------------------------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        """Whether allocate(seq, num_tokens) would succeed now without a prefix hit (>= 1 page per sequence)."""
        rings_free = self.rings is None or self.rings.num_free > 0
        return rings_free and self.pages_needed(max(num_tokens, 1)) <= self.num_takeable

    def allocate(self, seq_id: Hashable, num_tokens: int, tokens: Sequence[int] | None = None,
                 scored: bool = True) -> list[int] | None:
        """Reserve pages for `num_tokens` positions of a new sequence; None if they do not fit now.

        tokens: the prompt's ids. With prefix caching on, the longest run of its full pages already in the pool is
        mapped (not copied) and the sequence starts at that length (`length(seq_id)`): only the rest is prefilled.
        At least one prompt token is left to compute (its logits start the answer); the open page is never shared.
        scored=False: the sequence never grows past the token budget, so no decode step scores its pages, and the
        pages it seals get no summaries (the eigh work is skipped) unless a scored sequence maps them later."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already owns pages; free it first or use grow()")
        hits: list[int] = []
        names: list[bytes] = []
        if tokens is not None and self.ledger.enabled:
            names = page_hashes(tokens, self.page_size, self.ledger.salt)[: (len(tokens) - 1) // self.page_size]
            hits = self.ledger.lookup(names)
        need = self.pages_needed(max(num_tokens, 1)) - len(hits)
        if need > self.num_takeable - self.ledger.cached_among(hits):
            return None
        if self.rings is not None and not self.rings.take(seq_id):
            return None
        for page in hits:
            self.ledger.take(page)
        missing = [p for p in hits if p in self.unsummarized] if scored else []
        if missing:  # deferred summaries (advance), needed now
            self.unsummarized.difference_update(missing)
            self.seal(missing)
        if scored:  # groups never built (sealed unscored) or whose record slot went to another group
            seal_groups(self, self.group_slots.lacking(completed_groups(hits, 0, len(hits), self.geometry.group_pages)))
        if not scored:
            self._unscored.add(seq_id)
        pages = hits + [self._take() for _ in range(need)]
        self._tables[seq_id] = pages
        self._lengths[seq_id] = self._sealed[seq_id] = 0
        naming = tokens is not None and self.ledger.enabled  # else no id is kept for this sequence
        self._tail[seq_id], self._parent[seq_id] = ([] if naming else None), None
        if hits:
            self._lengths[seq_id], self._sealed[seq_id] = len(hits) * self.page_size, len(hits)
            self._parent[seq_id] = names[len(hits) - 1]
        if naming:
            self.ledger.stats.count(len(tokens), len(hits) * self.page_size)
        return list(pages)

    def _take(self) -> int:
        """One page: from the free list, else a store reservation (a frame comes when it is written:
        make_resident), else the least recently used cached page. Callers checked num_takeable."""
        if not self._free and self.store is not None and self.store.free_blocks:
            return self.store.reserve()
        page = self._free.pop() if self._free else self.ledger.reclaim()
        self.ledger.take(page)
        self.unsummarized.discard(page)  # rewritten by its new sequence, sealed again when full
        self.group_slots.release(page)  # so is any group record keyed by it
        return page

    def grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Room for `num_tokens` positions in total; False (and nothing taken) if the pool is short."""
        table = self._tables[seq_id]
        need = self.pages_needed(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_takeable:
            return False
        table.extend(self._take() for _ in range(need))
        return True

    def free(self, seq_id: Hashable) -> int:
        """Release every page of the sequence; returns how many it held. Unknown ids free nothing. A page goes back
        to the free list when no other sequence holds it, or to the cached LRU if it is named (prefix caching)."""
        pages = self._tables.pop(seq_id, None)
        for per_sequence in (self._lengths, self._sealed, self._tail, self._parent):
            per_sequence.pop(seq_id, None)
        self._unscored.discard(seq_id)
        if self.int8 is not None and pages:
            self.int8.staging.release(pages)
        if self.rings is not None:
            self.rings.release(seq_id)
        if not pages:
            return 0
        held = len(pages)
        if self.store is not None:  # stored ids: their blocks go back (never shared: no refcount)
            pages = self.store.release_stored(pages)
        self._free.extend(p for p in reversed(pages) if self.ledger.release(p))
        return held

    def make_resident(self, seq_id: Hashable, end_tokens: int) -> bool:
        """Frames for the pages a step writes up to `end_tokens` (page store: older pages may leave); False: none."""
        return self.store is None or self.store.make_resident(seq_id, end_tokens)

    def readable(self, layer: int, flat: torch.Tensor, valid: torch.Tensor | None = None):
        """(k_rows, v_rows, flat, scales) to read the slots `flat` [B, Hkv, T] of `layer` with (store/tier.py)."""
        if self.store is None:
            return self.k_rows[layer], self.v_rows[layer], flat, self.scale_rows[layer]
        return self.store.readable(layer, self.paged_index[layer], flat, valid)

    def record_tokens(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """The ids of the tokens the next step writes for this sequence, in order (they name its sealed pages)."""
        tail = self._tail.get(seq_id)
        if tail is not None:  # a step that failed and is run again recorded its ids already: drop them first
            del tail[self._lengths[seq_id] - self._sealed[seq_id] * self.page_size :]
            tail.extend(int(t) for t in token_ids)

    # ---- one forward step --------------------------------------------------------------------------------
    def prepare(self, seq_ids: Sequence[Hashable], new_tokens: Sequence[int]) -> StepIndex:
        """Index where `new_tokens[b]` tokens of each sequence go. Pages must already be reserved."""
        step = build_step_index(seq_ids, new_tokens, self._tables, self._lengths, self._sealed, self.page_size,
                                self.geometry.kv_heads, self.device,
                                resident=None if self.store is None else self.store.base)
        if self.rings is not None:
            step.attach_rings(self.rings, self.device)
        for sid, n in zip(seq_ids, new_tokens) if self.int8 is not None else ():
            self.int8.stage(self._tables[sid], self._lengths[sid], n, self.page_size)
        return step

    def write(self, layer: int, step: StepIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this layer's new keys/values k, v [N, kv_heads, head_dim] (rotated); a sliding layer's in rings."""
        g = self.geometry
        if self.paged_index[layer] < 0:  # the tokens a ring keeps [M] (None: all), at their rows [M * kv_heads]
            tokens, slots = step.ring_writes
            return self.write_rows(layer, slots, *((k, v) if tokens is None else (k[tokens], v[tokens])))
        if step.write_slots is None:  # same for every layer of the step: compute once
            heads = torch.arange(g.kv_heads, device=self.device) * g.page_size
            step.write_slots = (step.write_base[:, None] + heads[None, :]).reshape(-1)  # [N * kv_heads]
        self.write_rows(layer, step.write_slots, k, v)

    def write_rows(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, kv_heads, head_dim] into the layer's rows `slots` [N * kv_heads] (of its [pages*Hkv*P, D] view);
        a cast only where the dtypes differ (a same-dtype .to() is still a dispatched op)."""
        d = self.geometry.head_dim
        k, v = k.reshape(-1, d), v.reshape(-1, d)
        if self.scale_rows[layer] is not None:  # int8: codes + scales, and the keys staged for sealing
            self.int8.write(self.paged_index[layer], self.k_rows[layer], self.v_rows[layer], slots, k, v)
        else:
            self.k_rows[layer].index_copy_(0, slots, k if k.dtype == self.k.dtype else k.to(self.k.dtype))
            self.v_rows[layer].index_copy_(0, slots, v if v.dtype == self.v.dtype else v.to(self.v.dtype))
        if self.store is not None:  # a dense layer's copy of every page id (store/mirror.py)
            self.store.mirror.wrote(self, layer, self.paged_index[layer], slots)

    def commit(self, step: StepIndex) -> int:
        """Advance lengths after every layer wrote, then seal full pages. Returns pages sealed."""
        return self.advance(step.seq_ids, step.lengths_list)

    def advance(self, seq_ids: Sequence[Hashable], lengths: Sequence[int]) -> int:
        """Set each sequence's length after a step wrote its tokens, then seal the pages it filled, all in one batch
        (outside the step: sealing is eigh/QR work that syncs a GPU). Returns pages sealed."""
        to_seal: list[int] = []
        groups: list[list[int]] = []  # groups whose last page sealed now (two-level scoring)
        for sid, length in zip(seq_ids, lengths):
            if sid not in self._tables:  # cancelled while the step ran
                continue
            self._lengths[sid] = length
            full = length // self.page_size
            sealed_now = self._tables[sid][self._sealed[sid] : full]
            if sid in self._unscored:
                self.unsummarized.update(sealed_now)
                if self.int8 is not None:  # no summaries now; a later seal reads the dequantized keys
                    self.int8.staging.release(sealed_now)
            else:
                to_seal.extend(sealed_now)
                groups += completed_groups(self._tables[sid], self._sealed[sid], full, self.geometry.group_pages)
            self._sealed[sid] = full
            self._name_pages(sid, sealed_now)
        if to_seal and self.geometry.paged_layers:  # no paged layer (all sliding): nothing to summarise
            self.seal(to_seal)
            seal_groups(self, groups)
        if self.store is not None:
            self.store.end_step()
        return len(to_seal)

    def _name_pages(self, seq_id: Hashable, pages: Sequence[int]) -> None:
        """Name the pages a step sealed for this sequence from the token ids recorded for them (prefix caching)."""
        tail = self._tail.get(seq_id)
        if pages and tail is not None:
            parent = self.ledger.name_run(pages, tail, self.page_size, self._parent[seq_id])
            self._tail[seq_id], self._parent[seq_id] = (tail, parent) if parent is not None else (None, None)

    def seal(self, pages: Sequence[int], eta: float | None = None, kinds: Sequence[str] | None = None) -> None:
        """Build the summaries of full physical pages, every layer and KV head at once (summaries.seal_pages). eta:
        the oval record's output-aware mix (default: the pool's); kinds: which summaries (default: all)."""
        seal_pages(self, pages, self.eta if eta is None else float(eta), kinds)
        if self.int8 is not None:
            self.int8.staging.release(pages)

    def set_output_metric(self, per_layer: Sequence[torch.Tensor]) -> None:
        """G^{1/2} [Hkv, D, D] of each paged layer (summaries.output_metric_sqrt), which records with eta > 0 need."""
        self.output_metric = stack_output_metric(per_layer, self.geometry, self.device)
