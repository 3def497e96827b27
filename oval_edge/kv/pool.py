"""The KV page pool: allocated once from the budget, never grown (DESIGN §3).

Tensors (per model):
    K, V     [layers, pages, kv_heads, page_size, head_dim]
    quest    kmin, kmax [layers, pages, kv_heads, head_dim]
    oval     U^T [layers, pages, kv_heads, r, head_dim], C [layers, pages, kv_heads, page_size, r]

A logical page holds the same `page_size` token positions in every layer. Sequences own page tables
(logical page -> physical page). Verbs follow nano-vllm's block manager / vLLM's block pool: few of them, and
"does not fit" is an answer (False / None), never an exception from inside torch.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from oval_edge.geometry import KVGeometry, PoolSizing, seal_chunk_pages

from .step_index import StepIndex
from .summaries import oval_summary, quest_summary

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PagePool:
    def __init__(
        self,
        geometry: KVGeometry,
        num_pages: int,
        device: str | torch.device = "cpu",
        eta: float = 0.5,
        sizing: PoolSizing | None = None,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        self.geometry = geometry
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.eta = float(eta)
        self.sizing = sizing
        self.seal_chunk = seal_chunk_pages(geometry)  # pages summarised per batch (bounded transient memory)
        g = geometry
        dtype = TORCH_DTYPES[g.dtype]
        shape = (g.layers, num_pages, g.kv_heads, g.page_size, g.head_dim)
        # The only allocations the pool ever makes: everything below is written in place.
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        # Per-layer [pages * kv_heads * page_size, head_dim] views (no copy): the rows decode writes and gathers.
        self.k_rows = [self.k[layer].view(-1, g.head_dim) for layer in range(g.layers)]
        self.v_rows = [self.v[layer].view(-1, g.head_dim) for layer in range(g.layers)]
        self.summaries: dict[str, torch.Tensor] = {}
        if "quest" in g.summary_kinds:
            self.summaries["kmin"] = torch.zeros(shape[:3] + (g.head_dim,), dtype=dtype, device=self.device)
            self.summaries["kmax"] = torch.zeros(shape[:3] + (g.head_dim,), dtype=dtype, device=self.device)
        if "oval" in g.summary_kinds:
            # Head-major [layers, kv_heads, pages, ...] and rank first: U^T [r, D] and C^T [r, P] per head and page.
            # Scoring gathers a sequence's pages per KV head as contiguous blocks (one index_select), multiplies the
            # query with all [r, D] blocks in one matmul and combines the r coordinate rows with page_size-long
            # inner loops (scoring.oval_scores): no transpose at decode time.
            head_major = (g.layers, g.kv_heads, num_pages)
            self.summaries["basis"] = torch.zeros(head_major + (g.rank, g.head_dim), dtype=dtype, device=self.device)
            self.summaries["coords"] = torch.zeros(head_major + (g.rank, g.page_size), dtype=dtype, device=self.device)
        # Free list as a stack: recently freed pages are reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._sealed: dict[Hashable, int] = {}

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, *self.summaries.values()))

    # ---- allocation --------------------------------------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        """Whether allocate(seq, num_tokens) would succeed now (a new sequence always takes >= 1 page)."""
        return self.pages_needed(max(num_tokens, 1)) <= len(self._free)

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Reserve pages for `num_tokens` positions of a new sequence; None if they do not fit now."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already owns pages; free it first or use grow()")
        need = self.pages_needed(max(num_tokens, 1))
        if need > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(need)]
        self._tables[seq_id] = pages
        self._lengths[seq_id] = 0
        self._sealed[seq_id] = 0
        return list(pages)

    def grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Make room for `num_tokens` positions in total; False (and nothing taken) if the pool is short."""
        table = self._tables[seq_id]
        need = self.pages_needed(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        table.extend(self._free.pop() for _ in range(need))
        return True

    def free(self, seq_id: Hashable) -> int:
        """Return every page of the sequence to the free list; returns how many. Unknown ids free nothing."""
        pages = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        self._sealed.pop(seq_id, None)
        if not pages:
            return 0
        self._free.extend(reversed(pages))
        return len(pages)

    def owns(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def page_table(self, seq_id: Hashable) -> list[int]:
        return list(self._tables[seq_id])

    def length(self, seq_id: Hashable) -> int:
        return self._lengths[seq_id]

    def sealed_pages(self, seq_id: Hashable) -> int:
        return self._sealed[seq_id]

    def sequences(self) -> list:
        return list(self._tables)

    # ---- one forward step --------------------------------------------------------------------------------
    def prepare(self, seq_ids: Sequence[Hashable], new_tokens: Sequence[int]) -> StepIndex:
        """Index where `new_tokens[b]` tokens of each sequence go. Pages must already be reserved."""
        P = self.page_size
        H = self.geometry.kv_heads
        positions, rows, bases, lengths, sealed = [], [], [], [], []
        for row, (sid, n) in enumerate(zip(seq_ids, new_tokens)):
            table = self._tables[sid]
            start = self._lengths[sid]
            end = start + n
            if self.pages_needed(end) > len(table):
                raise ValueError(
                    f"sequence {sid!r} needs {self.pages_needed(end)} pages for {end} tokens but owns {len(table)}; "
                    "grow() it first"
                )
            pos = range(start, end)
            positions.extend(pos)
            rows.extend([row] * n)
            bases.extend(table[p // P] * H * P + p % P for p in pos)
            lengths.append(end)
            sealed.append(self._sealed[sid])
        width = max(self.pages_needed(n) for n in lengths) if lengths else 0
        table = torch.zeros((len(seq_ids), max(width, 1)), dtype=torch.long)
        for row, sid in enumerate(seq_ids):
            used = self._tables[sid][: self.pages_needed(lengths[row])]
            table[row, : len(used)] = torch.tensor(used, dtype=torch.long)
        dev = self.device
        return StepIndex(
            seq_ids=list(seq_ids),
            new_tokens=list(new_tokens),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            token_row=torch.tensor(rows, dtype=torch.long, device=dev),
            write_base=torch.tensor(bases, dtype=torch.long, device=dev),
            page_table=table.to(dev),
            lengths=torch.tensor(lengths, dtype=torch.long, device=dev),
            sealed=torch.tensor(sealed, dtype=torch.long, device=dev),
            lengths_list=lengths,
        )

    def write(self, layer: int, step: StepIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this layer's new keys/values. k, v [N, kv_heads, head_dim] (keys already rotated)."""
        g = self.geometry
        if step.write_slots is None:  # same for every layer of the step: compute once
            heads = torch.arange(g.kv_heads, device=self.device) * g.page_size
            step.write_slots = (step.write_base[:, None] + heads[None, :]).reshape(-1)  # [N * kv_heads]
        self.write_rows(layer, step.write_slots, k, v)

    def write_rows(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, kv_heads, head_dim] into the layer's rows `slots` [N * kv_heads] (of its [pages*Hkv*P, D] view).
        A cast only where the dtypes differ: a same-dtype .to() is still a dispatched op, twice per layer per step."""
        d = self.geometry.head_dim
        k, v = k.reshape(-1, d), v.reshape(-1, d)
        self.k_rows[layer].index_copy_(0, slots, k if k.dtype == self.k.dtype else k.to(self.k.dtype))
        self.v_rows[layer].index_copy_(0, slots, v if v.dtype == self.v.dtype else v.to(self.v.dtype))

    def commit(self, step: StepIndex) -> int:
        """Advance lengths after every layer wrote, then seal full pages. Returns pages sealed."""
        return self.advance(step.seq_ids, step.lengths_list)

    def advance(self, seq_ids: Sequence[Hashable], lengths: Sequence[int]) -> int:
        """Set each sequence's length after a step wrote its tokens, then seal the pages it filled, all in one batch
        (outside the step: sealing is eigh/QR work that syncs a GPU). Returns pages sealed."""
        to_seal: list[int] = []
        for sid, length in zip(seq_ids, lengths):
            if sid not in self._tables:  # cancelled while the step ran
                continue
            self._lengths[sid] = length
            full = length // self.page_size
            to_seal.extend(self._tables[sid][self._sealed[sid] : full])
            self._sealed[sid] = full
        if to_seal:
            self.seal(to_seal)
        return len(to_seal)

    @torch.no_grad()
    def seal(self, pages: Sequence[int], eta: float | None = None, kinds: Sequence[str] | None = None) -> None:
        """Build the summaries of full physical pages, for every layer and KV head at once.

        eta: the oval basis's output-aware mix for these pages (default: the pool's); kinds: which of the pool's
        summaries to build (default: all of them). `oval-edge eval` seals each row's pages with its own.
        """
        g = self.geometry
        chunk = self.seal_chunk
        eta = self.eta if eta is None else float(eta)
        quest = "kmin" in self.summaries and (kinds is None or "quest" in kinds)
        oval = "basis" in self.summaries and (kinds is None or "oval" in kinds)
        for i in range(0, len(pages), chunk):
            idx = torch.tensor(pages[i : i + chunk], dtype=torch.long, device=self.device)
            keys = self.k.index_select(1, idx)  # [layers, n, kv_heads, P, D]
            flat = keys.reshape(-1, g.page_size, g.head_dim)
            lead = keys.shape[:3]
            if quest:
                kmin, kmax = quest_summary(flat)
                self.summaries["kmin"].index_copy_(1, idx, kmin.view(*lead, g.head_dim))
                self.summaries["kmax"].index_copy_(1, idx, kmax.view(*lead, g.head_dim))
            if oval:
                values = self.v.index_select(1, idx).reshape(-1, g.page_size, g.head_dim)
                basis, coords = oval_summary(flat, values, g.rank, eta)
                basis_t = basis.transpose(1, 2).reshape(*lead, g.rank, g.head_dim).transpose(1, 2)  # [L, Hkv, n, r, D]
                coords_t = coords.transpose(1, 2).reshape(*lead, g.rank, g.page_size).transpose(1, 2)  # [L, Hkv, n, r, P]
                self.summaries["basis"].index_copy_(2, idx, basis_t)
                self.summaries["coords"].index_copy_(2, idx, coords_t)

    def storage_pointers(self) -> tuple[int, ...]:
        """Data pointers of every pool tensor: equal across calls proves nothing was reallocated."""
        return tuple(t.data_ptr() for t in (self.k, self.v, *self.summaries.values()))

    def check_invariants(self) -> None:
        """Raise AssertionError if a page is owned twice, lost, or a table is inconsistent (used by tests)."""
        owned = [p for t in self._tables.values() for p in t]
        assert len(owned) == len(set(owned)), "a page is owned by two sequences"
        assert not set(owned) & set(self._free), "a page is both owned and free"
        assert len(owned) + len(self._free) == self.num_pages, "pages were lost or duplicated"
        assert len(set(self._free)) == len(self._free), "free list holds a page twice"
        for sid, table in self._tables.items():
            assert self._lengths[sid] <= len(table) * self.page_size, f"{sid}: length beyond its pages"
            assert self._sealed[sid] <= self._lengths[sid] // self.page_size, f"{sid}: sealed a page not full"
