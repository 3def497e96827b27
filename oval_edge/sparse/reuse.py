"""Selection reuse ([R-reuse]): a row keeps a recent page selection in a layer when its queries barely moved.

Per sequence, layer and KV head a small LRU (`OvalConfig.reuse_slots` entries, default 8) keeps recent
selections: the unit query of the KV head's group (its G query heads flattened, [G*D]), and the top-k logical pages
and window that query chose. At a decode step a row *hits* in a layer when every KV head finds an entry whose
query has cosine >= tau with its current one; the row then takes those pages (its fresh scores are replaced). A
row with any miss is scored afresh (one scoring call serves all of a row's KV heads, so reusing some heads of a row
would save nothing) and each head's fresh selection replaces the least recently used entry. A hit only refreshes
an entry's recency, never its query: every reused selection stays within tau of the query that chose it, however
many steps it is reused for. An entry holding fewer than k pages is never reused.

A hit becomes page scores (0 at the cached pages, -inf elsewhere), so DecodePlan.select keeps every rule on
candidates, window, validity and flat indices. A logical page always holds the same positions of its sequence and
the window only moves forward, so a page chosen at an earlier step lies before the window now too.

State is tensors with one slot per sequence ([layers, slots, entries, kv_heads, ...]): a batch looks up every row
with a few ops per layer, and the layers' selections are written once per step, all layers together, when the next
step binds (on a CPU each tensor op costs microseconds of dispatch whatever its size, and a missed lookup is pure
overhead). A sequence's slot is freed by `drop` (the engine calls it when a request ends) or once the pool no
longer owns it, and cleared when its length is not its last one plus one: a sequence that takes over an id (or
pages) never sees another sequence's selections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from oval_edge.config import OvalConfig

from .scoring import score_pages
from .selection import Selection

# An identical query's cosine with its stored unit vector can round to 1 - 1e-7 in fp32: tau = 1.0 must still hit.
COSINE_SLACK = 1e-6


@dataclass
class ReuseCounts:
    """Cumulative counts (exported on /metrics). A lookup is one sparse row in one layer at one decode step."""

    lookups: int = 0
    hits: int = 0  # lookups where every KV head matched: the row reused its selection and was not scored
    head_lookups: int = 0  # lookups x KV heads
    head_hits: int = 0  # KV heads that matched on their own (a row reuses only when all of its heads do)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def head_hit_rate(self) -> float:
        return self.head_hits / self.head_lookups if self.head_lookups else 0.0


@dataclass
class Binding:
    """The rows of the step being decoded: their slots and which of them select pages."""

    step: object
    seq_ids: tuple
    slots: torch.Tensor  # [n]
    sparse: list[bool]  # rows longer than the token budget (short rows attend densely: no lookup, no count)


@dataclass
class Lookup:
    """One layer's lookup for the bound rows, kept until the layer's selection is recorded."""

    layer: int
    slots: torch.Tensor  # [n] the rows' state slots
    query: torch.Tensor  # [n, Hkv, G*D] this step's group queries
    norm: torch.Tensor  # [n, Hkv] their norms (clamped above 0)
    entry: torch.Tensor  # [n, Hkv] best matching entry of every head
    hit_rows: list[int]  # rows that reuse (every head matched)
    miss_rows: list[int]  # sparse rows without a hit: scored afresh; their selections enter the LRU


class SelectionReuse:
    """Every method that touches state runs in inference mode, as the decode step does: the state tensors are
    inference tensors (updated in place only in that mode, e.g. by `drop` from the engine between steps)."""

    @torch.inference_mode()
    def __init__(self, tau: float, entries: int, layers: int, kv_heads: int, group_dim: int, top_k: int,
                 device: str | torch.device = "cpu", capacity: int = 1) -> None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 < tau <= 1.0:
            raise ValueError(f"reuse_tau={tau!r} is out of range: allowed (0.0, 1.0]")
        for name, value in (("entries", entries), ("layers", layers), ("kv_heads", kv_heads),
                            ("group_dim", group_dim), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.tau, self.entries, self.layers, self.kv_heads, self.top_k = float(tau), entries, layers, kv_heads, top_k
        self.threshold = min(self.tau, 1.0 - COSINE_SLACK)  # > 0: an empty (zero) entry never matches
        self.group_dim, self.device = group_dim, torch.device(device)
        self.counts = ReuseCounts()
        self._slot: dict[Hashable, int] = {}  # sequence id -> slot
        self._length: dict[Hashable, int] = {}  # sequence id -> its length at its last step
        self._free: list[int] = []
        self._clock = 0  # recency stamp: one tick per step (a layer's LRU changes at most once per step)
        self._bound: Binding | None = None  # the rows of the step being decoded
        self._pending: list[tuple] = []  # (lookup, pages, window) of this step's layers, written by _flush
        self._heads = torch.arange(kv_heads, device=self.device)  # [Hkv]
        # Per layer, slot, entry and KV head: unit queries (zeros when empty: cosine 0 < tau never matches), pages,
        # windows and recency stamps (-1 = empty; the least recent stamp is evicted first).
        self.query = torch.zeros(layers, 0, entries, kv_heads, group_dim, device=self.device)
        self.pages = torch.zeros(layers, 0, entries, kv_heads, top_k, dtype=torch.long, device=self.device)
        self.window = torch.zeros(layers, 0, entries, kv_heads, dtype=torch.long, device=self.device)
        self.stamp = torch.zeros(layers, 0, entries, kv_heads, dtype=torch.long, device=self.device)
        self._grow(capacity)

    @classmethod
    def for_model(cls, config: OvalConfig, layers: int, q_heads: int, kv_heads: int, head_dim: int,
                  device, capacity: int = 1) -> "SelectionReuse | None":
        """The reuse state a config asks for (None when reuse_tau is None)."""
        if config.reuse_tau is None:
            return None
        return cls(config.reuse_tau, config.reuse_slots, layers, kv_heads, q_heads // kv_heads * head_dim,
                   config.top_k, device, capacity)

    # ---- sequences -------------------------------------------------------------------------------------------
    @property
    def sequences(self) -> list:
        return list(self._slot)

    @torch.inference_mode()
    def drop(self, seq_id: Hashable) -> None:
        """Forget a sequence (it ended); its slot is cleared and reused by the next new sequence."""
        self._flush()  # its last step's writes land before the clear, never in the slot's next owner
        slot = self._slot.pop(seq_id, None)
        self._length.pop(seq_id, None)
        if slot is not None:
            self._clear(slot)
            self._free.append(slot)
        self._bound = None

    @torch.inference_mode()
    def bind(self, step: object, seq_ids: Sequence[Hashable], lengths: Sequence[int], dense_rows: torch.Tensor,
             owns: Callable[[Hashable], bool] | None = None) -> Binding:
        """Bind the rows of a decode step (once per step object; later calls return the same binding).

        lengths: tokens of each row after this step; dense_rows [n] bool: rows that fit the token budget
        (DecodePlan.dense_rows). `owns(seq_id)`: whether the pool still holds a sequence; slots of sequences it no
        longer holds are freed here, so no state outlives the pool's view even if `drop` was never called.
        """
        ids = tuple(seq_ids)
        bound = self._bound
        if bound is not None and bound.step is step and bound.seq_ids == ids:
            return bound
        self._flush()
        self._clock += 1
        if owns is not None:
            for sid in [s for s in self._slot if s not in ids and not owns(s)]:
                self.drop(sid)
        slots = []
        for sid, length in zip(ids, lengths):
            slot = self._slot.get(sid)
            if slot is None:
                slot = self._take(sid)
            elif self._length[sid] + 1 != length:  # not the next step of the sequence we know: start over
                self._clear(slot)
            self._length[sid] = int(length)
            slots.append(slot)
        sparse = [not d for d in dense_rows.tolist()]
        self._bound = Binding(step, ids, torch.tensor(slots, dtype=torch.long, device=self.device), sparse)
        return self._bound

    def _take(self, seq_id: Hashable) -> int:
        if not self._free:
            self._grow(max(1, self.stamp.shape[1]))
        slot = self._free.pop()
        self._clear(slot)
        self._slot[seq_id] = slot
        return slot

    def _clear(self, slot: int) -> None:
        self.stamp[:, slot] = -1
        self.query[:, slot] = 0.0

    def _grow(self, more: int) -> None:
        old = self.stamp.shape[1]

        def extend(t: torch.Tensor, fill) -> torch.Tensor:
            return torch.cat([t, torch.full((t.shape[0], more, *t.shape[2:]), fill, dtype=t.dtype,
                                            device=t.device)], dim=1)

        self.query, self.pages = extend(self.query, 0.0), extend(self.pages, -1)
        self.window, self.stamp = extend(self.window, 0), extend(self.stamp, -1)
        self._free.extend(range(old + more - 1, old - 1, -1))

    # ---- one layer: lookup, then record what the layer selected ----------------------------------------------
    @torch.inference_mode()
    def lookup(self, layer: int, q: torch.Tensor) -> Lookup:
        """Match the bound rows' queries q [n, Hq, D] against their LRUs of `layer` (as few ops as possible)."""
        bound, n, h = self._bound, q.shape[0], self.kv_heads
        query = q.reshape(n, h, -1).float()  # [n, Hkv, G*D]
        norm = query.norm(dim=-1).clamp_min_(1e-12)  # [n, Hkv]
        stored = self.query[layer].index_select(0, bound.slots)  # [n, S, Hkv, G*D], unit vectors or zeros
        dots, entry = (stored * query[:, None]).sum(-1).max(1)  # cosine x norm [n, S, Hkv] -> best [n, Hkv]
        matched = (dots >= norm * self.threshold).sum(-1).tolist()  # [n] heads that matched
        hit_rows = [r for r in range(n) if bound.sparse[r] and matched[r] == h]
        miss_rows = [r for r in range(n) if bound.sparse[r] and matched[r] < h]
        counts = self.counts
        counts.lookups += len(hit_rows) + len(miss_rows)
        counts.hits += len(hit_rows)
        counts.head_lookups += (len(hit_rows) + len(miss_rows)) * h
        counts.head_hits += sum(matched[r] for r in range(n) if bound.sparse[r])
        return Lookup(layer, bound.slots, query, norm, entry, hit_rows, miss_rows)

    def cached(self, found: Lookup) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages [n, Hkv, k] and windows [n, Hkv] of every head's best entry (meaningful on hit rows)."""
        pick = found.entry[:, None, :]  # [n, 1, Hkv]
        pages = self.pages[found.layer].index_select(0, found.slots)  # [n, S, Hkv, k]
        pages = pages.gather(1, pick[..., None].expand(-1, -1, -1, pages.shape[-1])).squeeze(1)
        window = self.window[found.layer].index_select(0, found.slots).gather(1, pick).squeeze(1)
        return pages, window

    def scores(self, pages: torch.Tensor, num_pages: int) -> torch.Tensor:
        """Page scores [n, Hkv, Np] that make DecodePlan.select take exactly `pages` [n, Hkv, k] (0 there, -inf
        elsewhere: the plan's masks still apply, and no other page is picked to fill k)."""
        out = torch.full((*pages.shape[:2], num_pages), float("-inf"), device=pages.device)
        return out.scatter_(2, pages.clamp(0, num_pages - 1), 0.0)

    def record(self, found: Lookup, pages: torch.Tensor, window: torch.Tensor | None) -> None:
        """Keep what the layer selected (Selection.pages [n, Hkv, k], -1 = none; .window [n, Hkv] or None when it
        is the config's fixed one). Written with the other layers' records when the next step binds."""
        if found.hit_rows or found.miss_rows:
            self._pending.append((found, pages, window))

    @torch.inference_mode()
    def _flush(self) -> None:
        """Write the pending records of one step, all layers at once: hit entries become the most recent, scored
        heads replace their least recently used (or an empty) entry."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        n, clock = pending[0][0].entry.shape[0], self._clock
        status = [[1 if r in f.hit_rows else 2 if r in f.miss_rows else 0 for r in range(n)] for f, _, _ in pending]
        status = torch.tensor(status, device=self.device)[..., None]  # [L', n, 1]: 0 none, 1 hit, 2 scored
        layers = torch.tensor([f.layer for f, _, _ in pending], device=self.device)
        slots = pending[0][0].slots
        stamp = self.stamp.index_select(0, layers).index_select(1, slots)  # [L', n, S, Hkv]
        target = torch.where(status == 1, torch.stack([f.entry for f, _, _ in pending]), stamp.argmin(2))
        grid = torch.meshgrid(layers, slots, self._heads, indexing="ij")  # 3 x [L', n, Hkv]
        index = (grid[0], grid[1], target, grid[2])
        hit, miss = (status == 1).expand_as(target), (status == 2).expand_as(target)
        if bool(hit.any()):
            self.stamp.index_put_(tuple(i[hit] for i in index), torch.tensor(clock, device=self.device))
        if not bool(miss.any()):
            return
        at = tuple(i[miss] for i in index)
        pages = torch.stack([p for _, p, _ in pending])  # [L', n, Hkv, k]
        # An entry with fewer than k pages (chosen while fewer candidates existed) is stored empty: reusing it would
        # read fewer pages than a fresh selection now. Kept entries stay candidates: pages only seal and the window
        # only moves forward.
        complete = (pages >= 0).all(-1)  # [L', n, Hkv]
        unit = torch.stack([f.query / f.norm[..., None] for f, _, _ in pending]) * complete[..., None]
        self.query.index_put_(at, unit[miss])
        self.pages.index_put_(at, pages[miss])
        if all(w is not None for _, _, w in pending):
            self.window.index_put_(at, torch.stack([w for _, _, w in pending]).long()[miss])
        self.stamp.index_put_(at, torch.where(complete[miss], clock, -1))


class ReuseInput:
    """Selection reuse as inputs of the static decode step (runtime/engine/forward/step_policy.py), for the engine
    (`reuse_tau`) and for eval's reuse rows: `begin` binds a step's rows, `scores` gives a sparse layer's page scores
    (the config's scorer; the reused pages' in rows where every KV head's query matched), `selected` records what the
    layer then picked. Host code between the step's ops: such a step runs eager. A hit row is still scored (the
    step's shapes are fixed), so reuse changes which pages are read, not the step's work."""

    def __init__(self, state: SelectionReuse, pool, config: OvalConfig, scale: float) -> None:
        if config.window_min != config.window_max:
            raise ValueError(f"selection reuse (reuse_tau) needs a fixed window; got window_min={config.window_min}, "
                             f"window_max={config.window_max}: set them equal or leave reuse_tau unset")
        self.state, self.pool, self.config, self.scale = state, pool, config, scale
        self._found: dict[int, Lookup] = {}  # layer -> this step's lookup, until the layer's selection is made

    @property
    def counts(self) -> ReuseCounts:
        return self.state.counts

    @property
    def tau(self) -> float:
        return self.state.tau

    def drop(self, seq_id: Hashable) -> None:
        self.state.drop(seq_id)

    def begin(self, seq_ids: Sequence[Hashable], lengths: Sequence[int]) -> None:
        """Bind a step's rows (lengths after the step); rows that fit the token budget select nothing."""
        budget = self.config.token_budget
        dense_rows = torch.tensor([n <= budget for n in lengths], device=self.pool.device)
        self.state.bind(object(), list(seq_ids), list(lengths), dense_rows, self.pool.owns)
        self._found.clear()

    def scores(self, layer: int, grouped: torch.Tensor, page_table: torch.Tensor, sealed: torch.Tensor,
               lengths: torch.Tensor) -> torch.Tensor:
        """grouped [B, Hkv, G, D] -> page scores [B, Hkv, W]."""
        scores = score_pages(self.config.scorer, grouped, self.pool.summaries, self.pool.paged_index[layer],
                             page_table, self.scale, sealed=sealed).float()
        found = self.state.lookup(layer, grouped.reshape(grouped.shape[0], -1, grouped.shape[-1]))
        if found.hit_rows:
            rows = torch.tensor(found.hit_rows, dtype=torch.long, device=scores.device)
            reused = self.state.scores(self.state.cached(found)[0].index_select(0, rows), scores.shape[-1])
            scores = scores.index_copy(0, rows, reused)
        self._found[layer] = found
        return scores

    def selected(self, layer: int, q: torch.Tensor, selection: Selection) -> None:
        found = self._found.pop(layer, None)
        if found is not None:
            self.state.record(found, selection.pages, None)  # a fixed window: the config's
