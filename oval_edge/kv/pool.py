"""The KV page pool: allocated once from the budget, never grown ([R-pool]).

Tensors (per model):
    K, V     [layers, pages, kv_heads, page_size, head_dim]   (kv_int8: int8 codes; `int8` holds their scales
             and the staging of open pages' keys: int8.py)
    quest    kmin, kmax [layers, pages, kv_heads, head_dim]
    oval     mean, basis, coords (+ scales) [paged layers, kv_heads, pages, ...]: page_record.py; group_record.py
With a page store (store/tier.py) K/V hold the resident and recall frames, the summaries every page's record.

A logical page holds the same `page_size` token positions in every layer. Sequences own page tables
(logical page -> physical page), kept with the free list and the prefix cache's refcounts in `tables`
(page_tables.py: bookkeeping, no tensors); this class holds the tensors and does the tensor work its verbs imply,
sealing through `sealer` (summaries.py). Verbs follow nano-vllm's block manager / vLLM's block pool: few of them,
and "does not fit" is an answer (False / None), never an exception from inside torch.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from oval_edge.geometry import KVGeometry, seal_chunk_pages
from oval_edge.pool_sizing import PoolSizing

from .huge_pages import pool_tensor
from .int8 import Int8Pages
from .invariants import check_pool_invariants
from .page_tables import PageTables
from .ring import SlidingRings
from .state import SequenceStates
from .store.page_file import PageStore
from .store.layout import StoreLayout
from .store.tier import StoreTier
from .step_index import StepIndex, build_step_index
from .records.group_record import completed_groups, seal_groups
from .records.group_slots import GroupSlots
from .records.summaries import PageSealer, allocate_summaries, stack_output_metric

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PagePool:
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
        state_snapshots: int = 0,
    ) -> None:
        """store: the page store (store/page_file.py) for pages beyond the num_pages frames; store_layout: its recall
        frames, the pages each sequence keeps resident and the mirrored dense layers (store/layout.py). state_snapshots:
        a hybrid model's state copies kept for prefix caching (state.py; 0 without a prefix cache)."""
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        self.geometry = geometry
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.eta = float(eta)
        self.sizing = sizing
        self.seal_chunk = seal_chunk_pages(geometry)  # pages summarised per batch (bounded transient memory)
        g = geometry
        if store is not None and (g.group_pages or g.ring_layers or g.states):
            raise ValueError("the page store does not yet take two-level scoring (group_pages), sliding-window "
                             "layers or a hybrid model's state layers; set group_pages=0 or leave kv_store unset")
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
        # With prefix caching and state_snapshots > 0 they keep that many window copies too (ring.py).
        self.rings = SlidingRings(g, ring_sequences or num_pages, dtype, self.device,
                                  state_snapshots if prefix_salt is not None else 0) if g.ring_layers else None
        # Hybrid models' state layers keep a slot per running sequence (state.py); the same count as the rings.
        self.states = SequenceStates(g.states, ring_sequences or 8, TORCH_DTYPES[g.states.dtype], self.device,
                                     state_snapshots if prefix_salt is not None else 0) if g.states else None
        # Model layer -> its row of k / v / summaries (-1: in the rings or a state layer), and its [rows, head_dim]
        # views (no copy; None for a state layer, which has no K/V).
        # A layer sharing an earlier layer's K/V (Gemma 4) gets its source's row and views: it reads, never writes.
        self.paged_index = [-1 if g.kv_source(layer) in g.ring_layers or layer in g.state_layers
                            else g.paged_index(layer) for layer in range(g.layers)]
        self.k_rows = [self._rows(self.k, self.rings and self.rings.k_rows, layer, i)
                       for layer, i in enumerate(self.paged_index)]
        self.v_rows = [self._rows(self.v, self.rings and self.rings.v_rows, layer, i)
                       for layer, i in enumerate(self.paged_index)]
        # layer -> (k, v scales [rows]) of an int8 layer, else None: what attention dequantizes the rows with
        self.scale_rows = [self.int8.scale_rows[i] if self.int8 and i >= 0 else None for i in self.paged_index]
        self.group_slots = GroupSlots.for_pool(g, records, self.device)  # two-level scoring's coarse record slots
        self.summaries = allocate_summaries(g, records, dtype, self.device, self.group_slots)
        self.output_metric: torch.Tensor | None = None  # G^{1/2} [paged layers, Hkv, D, D] for eta > 0
        # What cached pages do not give back (layer states, sliding windows), restored from boundary copies
        # (snapshots.py); prefix caching needs copies of each, else it is off
        self.keepers = [k for k in (self.states, self.rings) if k is not None]
        sharable = all(k.snapshots for k in self.keepers)
        self.tables = PageTables(num_pages, g.page_size, prefix_salt if sharable else None)
        self.sealer = PageSealer(self.eta)  # a public hook: eval seals each row's pages with that row's eta
        self.store = None if store is None else StoreTier(self, store, store_layout)

    def _rows(self, paged: torch.Tensor, ring_rows, layer: int, index: int) -> torch.Tensor | None:
        """A layer's [rows, head_dim] view of its K or V: its pages, its rings, or None (a state layer)."""
        if index >= 0:
            return paged[index].view(-1, self.geometry.head_dim)
        if layer in self.geometry.state_layers:
            return None
        return ring_rows[self.rings.index[self.geometry.kv_source(layer)]]

    # ---- questions ----------------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def ledger(self):
        """The prefix cache's refcounts, names and LRU (prefix_cache.PrefixLedger)."""
        return self.tables.ledger

    @property
    def unsummarized(self) -> set[int]:
        """Sealed pages left without summaries by unscored sequences (allocate(scored=False))."""
        return self.tables.unsummarized

    @property
    def num_free(self) -> int:
        return self.tables.num_free

    @property
    def num_takeable(self) -> int:
        """Pages an allocation can take now: num_free and the page store's free blocks (store/tier.py)."""
        return self.num_free + (len(self.store.free_blocks) if self.store is not None else 0)

    @property
    def num_cached(self) -> int:
        """Pages no sequence holds that keep their contents for a later prefix hit (part of num_free)."""
        return len(self.ledger.lru)

    @property
    def num_used(self) -> int:
        """Pages some sequence holds (a shared prefix page counts once)."""
        return len(self.ledger.refs)

    def pages_needed(self, num_tokens: int) -> int:
        return self.tables.pages_needed(num_tokens)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds, its page store included."""
        return (self.num_pages + (self.store.blocks if self.store else 0)) * self.page_size

    def capacity_note(self) -> str:
        """' (in memory N tokens, page store M)' with a page store, else '': what a refusal message adds."""
        if self.store is None:
            return ""
        return (f" (the in-memory pool holds {self.resident_tokens} tokens, the page store "
                f"{self.store.blocks * self.page_size})")

    @property
    def resident_tokens(self) -> int:
        """Tokens the in-memory frames hold (capacity_tokens without a store)."""
        return self.num_pages * self.page_size

    def owns(self, seq_id: Hashable) -> bool:
        return self.tables.owns(seq_id)

    def page_table(self, seq_id: Hashable) -> list[int]:
        return list(self.tables.tables[seq_id])

    def length(self, seq_id: Hashable) -> int:
        return self.tables.lengths[seq_id]

    def sealed_pages(self, seq_id: Hashable) -> int:
        return self.tables.sealed[seq_id]

    def sequences(self) -> list:
        return list(self.tables.tables)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool allocated (once, at construction)."""
        rings = [self.rings.k, self.rings.v] if self.rings is not None else []
        states = self.states.tensors() if self.states is not None else []
        return [self.k, self.v, *self.summaries.values(), *rings, *states,
                *(self.int8.tensors() if self.int8 else [])]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def storage_pointers(self) -> tuple[int, ...]:
        """Data pointers of every pool tensor: equal across calls proves nothing was reallocated."""
        return tuple(t.data_ptr() for t in self.tensors())

    def check_invariants(self) -> None:
        """AssertionError if a page (or ring) is lost, in two states, shared without its refcount, or a table is
        inconsistent (used by tests; invariants.py). Free + cached + owned = all pages."""
        check_pool_invariants(self)

    # ---- allocation --------------------------------------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        """Whether allocate(seq, num_tokens) would succeed now without a prefix hit (>= 1 page per sequence)."""
        rings_free = self.rings is None or self.rings.num_free > 0
        states_free = self.states is None or self.states.num_free > 0
        return rings_free and states_free and self.pages_needed(max(num_tokens, 1)) <= self.num_takeable

    def allocate(self, seq_id: Hashable, num_tokens: int, tokens: Sequence[int] | None = None,
                 scored: bool = True) -> list[int] | None:
        """Reserve pages for `num_tokens` positions of a new sequence; None if they do not fit now.

        tokens: the prompt's ids. With prefix caching on, the longest run of its full pages already in the pool is
        mapped (not copied) and the sequence starts at that length (`length(seq_id)`): only the rest is prefilled.
        At least one prompt token is left to compute (its logits start the answer); the open page is never shared.
        scored=False: the sequence never grows past the token budget, so no decode step scores its pages, and the
        pages it seals get no summaries (the eigh work is skipped) unless a scored sequence maps them later."""
        if self.tables.owns(seq_id):
            raise ValueError(f"sequence {seq_id!r} already owns pages; free it first or use grow()")
        hits, names = self.tables.prefix_hits(tokens)
        if self.keepers:  # cached pages only up to a page whose layer states and ring windows were kept
            hits = hits[: next((j for j in range(len(hits), 0, -1)
                                if all(k.has_snapshot(names[j - 1]) for k in self.keepers)), 0)]
        need = self.pages_needed(max(num_tokens, 1)) - len(hits)
        if need > self.num_takeable - self.ledger.cached_among(hits):
            return None
        if self.rings is not None and not self.rings.take(seq_id):
            return None
        if self.states is not None and not self.states.take(seq_id):
            if self.rings is not None:
                self.rings.release(seq_id)
            return None
        for keeper in self.keepers if hits else ():
            keeper.restore(seq_id, names[len(hits) - 1])
        for page in hits:
            self.ledger.take(page)
        missing = [p for p in hits if p in self.unsummarized] if scored else []
        if missing:  # deferred summaries (advance), needed now
            self.unsummarized.difference_update(missing)
            self.seal(missing)
        if scored:  # groups never built (sealed unscored) or whose record slot went to another group
            seal_groups(self, self.group_slots.lacking(completed_groups(hits, 0, len(hits), self.geometry.group_pages)))
        pages = hits + [self._take() for _ in range(need)]
        self.tables.open(seq_id, pages, hits, names, tokens, scored)
        return list(pages)

    def score(self, seq_id: Hashable) -> int:
        """Seal this sequence's pages with summaries from now on, and build the ones its sealed pages lack: a sequence
        allocated unscored (its own length never asked for page selection) whose decode steps now select pages (it
        shares a step with a longer row). Returns the pages sealed now."""
        if seq_id not in self.tables.unscored:
            return 0
        self.tables.unscored.discard(seq_id)
        sealed = self.tables.tables[seq_id][: self.tables.sealed[seq_id]]
        missing = [p for p in sealed if p in self.unsummarized]
        if missing:
            self.unsummarized.difference_update(missing)
            self.seal(missing)
        seal_groups(self, self.group_slots.lacking(completed_groups(sealed, 0, len(sealed), self.geometry.group_pages)))
        return len(missing)

    def _take(self) -> int:
        """One page: from the free list, else a store reservation (a frame comes when it is written:
        make_resident), else the least recently used cached page. Callers checked num_takeable."""
        if not self.tables.free and self.store is not None and self.store.free_blocks:
            return self.store.reserve()
        page = self.tables.take_frame()
        self.group_slots.release(page)  # a group record keyed by it is rewritten with it
        return page

    def grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Room for `num_tokens` positions in total; False (and nothing taken) if the pool is short."""
        table = self.tables.tables[seq_id]
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
        pages = self.tables.close(seq_id)
        if self.int8 is not None and pages:
            self.int8.staging.release(pages)
        if self.rings is not None:
            self.rings.release(seq_id)
        if self.states is not None:
            self.states.release(seq_id)
        if not pages:
            return 0
        held = len(pages)
        if self.store is not None:  # stored ids: their blocks go back (never shared: no refcount)
            pages = self.store.release_stored(pages)
        self.tables.release(pages)
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
        self.tables.record_tokens(seq_id, token_ids)

    # ---- one forward step --------------------------------------------------------------------------------
    def prepare(self, seq_ids: Sequence[Hashable], new_tokens: Sequence[int]) -> StepIndex:
        """Index where `new_tokens[b]` tokens of each sequence go. Pages must already be reserved."""
        t = self.tables
        step = build_step_index(seq_ids, new_tokens, t.tables, t.lengths, t.sealed, self.page_size,
                                self.geometry.kv_heads, self.device,
                                resident=None if self.store is None else self.store.base)
        if self.rings is not None:
            step.attach_rings(self.rings, self.device)
        for sid, n in zip(seq_ids, new_tokens) if self.int8 is not None else ():
            self.int8.stage(t.tables[sid], t.lengths[sid], n, self.page_size)
        return step

    def write(self, layer: int, step: StepIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this layer's new keys/values k, v [N, kv_heads, head_dim] (rotated); a sliding layer's in rings."""
        g = self.geometry
        if g.kv_source(layer) != layer:
            raise ValueError(f"layer {layer} reads layer {g.kv_source(layer)}'s K/V (shared): it stores none")
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
        d = self.k_rows[layer].shape[1]  # head_dim; a ring's may differ (geometry.ring_dim)
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
            if not self.tables.owns(sid):  # cancelled while the step ran
                continue
            written = length - self.tables.lengths[sid]
            before, sealed_now = self.tables.advance(sid, length)
            if self.keepers and sealed_now and length % self.page_size == 0 \
                    and self.tables.parent.get(sid) is not None:  # the step ended on a named page boundary
                for keeper in self.keepers:
                    keeper.snapshot(sid, self.tables.parent[sid], "decode" if written == 1 else "prefill")
            if sid in self.tables.unscored:
                if self.int8 is not None:  # no summaries now; a later seal reads the dequantized keys
                    self.int8.staging.release(sealed_now)
            else:
                to_seal.extend(sealed_now)
                groups += completed_groups(self.tables.tables[sid], before, length // self.page_size,
                                           self.geometry.group_pages)
        if to_seal and self.geometry.paged_layers:  # no paged layer (all sliding): nothing to summarise
            self.seal(to_seal)
            seal_groups(self, groups)
        if self.store is not None:
            self.store.end_step()
        return len(to_seal)

    def seal(self, pages: Sequence[int], eta: float | None = None, kinds: Sequence[str] | None = None) -> None:
        """Build the summaries of full physical pages, every layer and KV head at once (summaries.seal_pages). eta:
        the oval record's output-aware mix (default: the pool's); kinds: which summaries (default: all)."""
        self.sealer(self, pages, eta, kinds)
        if self.int8 is not None:
            self.int8.staging.release(pages)

    def set_output_metric(self, per_layer: Sequence[torch.Tensor]) -> None:
        """G^{1/2} [Hkv, D, D] of each paged layer (summaries.output_metric_sqrt), which records with eta > 0 need."""
        self.output_metric = stack_output_metric(per_layer, self.geometry, self.device)
