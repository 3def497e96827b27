"""Which token positions each KV head attends to at a decode step ([R-candidates, R-top-k, R-window]).

Every row of the batch gets the same number T of slots per KV head, so the gathered buffer has a static shape:

    T = (sink_pages + top_k) * page_size + window_slots,   window_slots = max(window_max, page_size)

laid out as [sink pages | top-k selected pages | last `window_slots` positions]. A `valid` mask marks the slots
that are really attended. No position is attended twice: page slots count only below the window start `ws`,
window slots only at or above it. Rows whose whole sequence fits in T attend densely (positions 0..L-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oval_edge.config import OvalConfig

from .static_select import StaticSelector


@dataclass
class Selection:
    positions: torch.Tensor | None  # [B, Hkv, T] absolute positions (0 where invalid); None: select(detail=False)
    valid: torch.Tensor  # [B, Hkv, T] bool
    pages: torch.Tensor | None  # [B, Hkv, k] logical pages chosen (-1: none / dense row); None for dense layers
    # (and for select(detail=False))
    window: torch.Tensor | None  # [B, Hkv] entropy window length in tokens; meaningful only where sparse_rows
    sparse_rows: torch.Tensor  # [B] bool: the row used page selection
    flat: torch.Tensor | None = None  # [B, Hkv, T] indices into a layer's [pages*Hkv*P, D] view (plan-built)

    @property
    def slots(self) -> int:
        return self.valid.shape[-1]


def window_slots(config: OvalConfig) -> int:
    # The window must also cover the open (unsealed) page, which has no summary and cannot be selected.
    return max(config.window_max, config.page_size)


def slots_per_step(config: OvalConfig) -> int:
    """T: token slots gathered per KV head at a sparse decode step (one definition: config.token_budget)."""
    return config.token_budget


def dense_selection(lengths: torch.Tensor, kv_heads: int, width: int, detail: bool = True) -> Selection:
    """Attend to every position 0..L-1 (dense layers, short sequences). width >= max(lengths).
    detail=False: positions None (the static step reads only flat and valid; at 32k materializing them was a
    [B, Hkv, 32768] int64 product, ~0.15 ms a step)."""
    pos = torch.arange(width, device=lengths.device)
    valid = (pos[None, :] < lengths[:, None])[:, None, :].expand(-1, kv_heads, -1)
    positions = pos * valid if detail else None  # 0 where invalid, as the Selection contract says: [B, Hkv, width]
    return Selection(positions, valid, None, None, torch.zeros_like(lengths, dtype=torch.bool))


def adaptive_window(scores: torch.Tensor, candidates: torch.Tensor, config: OvalConfig) -> torch.Tensor:
    """Window length [B, Hkv] from the normalised entropy of softmax(candidate scores).

    Peaked scores (attention concentrated on few pages) -> window_min; flat scores -> window_max.
    scores [B, Hkv, Np] (-inf on non-candidates); candidates [B, Np] bool.
    """
    lo, hi = config.window_min, config.window_max
    if lo == hi:
        return torch.full(scores.shape[:2], lo, dtype=torch.long, device=scores.device)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without candidates -> all zero
    entropy = torch.special.entr(probs).sum(-1)  # [B, Hkv]
    count = candidates.sum(-1, keepdim=True).clamp_min(2).float()  # [B, 1]
    normalised = (entropy / torch.log(count)).clamp(0.0, 1.0)
    return (lo + torch.round(normalised * (hi - lo))).long()


def select_positions(
    config: OvalConfig,
    scores: torch.Tensor,
    lengths: torch.Tensor,
    sealed: torch.Tensor,
) -> Selection:
    """Sink + top-k pages + adaptive window, as static-shape position slots.

    scores [B, Hkv, Np] page scores over each row's page table (logical page j covers positions j*P..j*P+P-1);
    lengths [B] tokens after this step; sealed [B] pages that have summaries.
    """
    return DecodePlan(config, lengths, sealed, scores.shape[-1], scores.shape[1]).select(scores)


class DecodePlan:
    """The parts of a decode step's selection that do not depend on the layer's query, built once per step.

    A step runs every layer with the same lengths, sealed counts and page tables, so candidate masks, sink and
    window slots (and, with a fixed window, their validity) are computed here once instead of once per layer.
    With `page_table` [B, Np] the plan also yields flat pool indices, so the gather needs no extra work.

    static=True (the static decode step, runtime/engine/forward/static_step.py): nothing is decided on the host. Rows that fit
    the token budget are always merged in with `torch.where` (never a `bool()` of a device value), so the ops and
    shapes depend only on B, Np and the config; the eager path instead skips selection when every row is short.
    """

    def __init__(self, config: OvalConfig, lengths: torch.Tensor, sealed: torch.Tensor, num_pages: int,
                 kv_heads: int, page_table: torch.Tensor | None = None, static: bool = False) -> None:
        P, sink = config.page_size, config.sink_pages
        dev = lengths.device
        self.config, self.lengths, self.page_table, self.static = config, lengths, page_table, static
        self.batch, self.kv_heads, self.num_pages = lengths.shape[0], kv_heads, num_pages
        self.slots = slots_per_step(config)
        self.offsets = torch.arange(P, device=dev)
        self.heads = torch.arange(kv_heads, device=dev)[None, :, None]  # [1, Hkv, 1]
        length = lengths[:, None]  # [B, 1]
        self.page_start = torch.arange(num_pages, device=dev) * P  # [Np]
        # Candidates: sealed, not a sink page, and starting before the earliest possible window start.
        self.candidates = (
            (self.page_start >= sink * P) & (self.page_start < (sealed * P)[:, None])
            & (self.page_start < length - config.window_min)
        )  # [B, Np]
        self.sealed_end = (sealed * P)[:, None]  # [B, 1]: the window starts no later than the first unsealed page
        self.fixed_window = config.window_min == config.window_max
        b = self.batch
        w_slots = window_slots(config)
        self.sink_pos = torch.arange(sink * P, device=dev).expand(b, kv_heads, -1)
        self.win_pos = (length - w_slots + torch.arange(w_slots, device=dev))[:, None, :].expand(-1, kv_heads, -1)
        if self.fixed_window:
            self.window = torch.full((b, kv_heads), config.window_min, dtype=torch.long, device=dev)
            self.start = torch.minimum(length - config.window_min, self.sealed_end)[:, :, None]  # [B, 1, 1]
            self.selectable = (self.candidates[:, None, :] & (self.page_start < self.start))  # [B, 1, Np]
            self.unselectable = ~self.selectable  # negated once per step, not once per layer
            self.sink_valid, self.win_valid = self._edge_valid(self.start)
        self.dense_rows = lengths <= self.slots
        self.sparse_rows = ~self.dense_rows
        self.all_dense = False if static else bool(self.dense_rows.all())
        self.any_dense = True if static else bool(self.dense_rows.any())
        edges = (self.sink_pos, self.win_pos.clamp_min(0))
        if self.any_dense:
            self.short = dense_selection(lengths, kv_heads, self.slots)
            self.short.pages = torch.full((b, kv_heads, config.top_k), -1, dtype=torch.long, device=dev)
            self.sink_flat, self.win_flat, self.short.flat = self._flats(*edges, self.short.positions)
        else:
            self.sink_flat, self.win_flat = self._flats(*edges)
        # Flat pool index of slot j of physical page p for KV head h: p * Hkv * P + (h * P + j) -> [1, Hkv, 1, P]
        self.head_slots = (self.heads * P)[..., None] + self.offsets
        self._full: Selection | None = None
        self._static: StaticSelector | None = None  # built on the first select(detail=False) that it applies to

    def _edge_valid(self, start: torch.Tensor):
        # Sink slots count below the window start, window slots at or above it (and not before position 0).
        return self.sink_pos < start, (self.win_pos >= start) & (self.win_pos >= 0)

    def _flats(self, *positions: torch.Tensor) -> tuple:
        """_flat of several [B, Hkv, n_i] position tensors (broadcastable) in one pass: views of one [B, Hkv, sum n_i]
        result. Why: _flat is eight ops; the sink, window and short-row slots of every step took 24, now 9."""
        if self.page_table is None:
            return (None,) * len(positions)
        shape = (self.batch, self.kv_heads, -1)
        flat = self._flat(torch.cat([p.expand(shape) for p in positions], dim=-1))
        return flat.split([p.shape[-1] for p in positions], dim=-1)

    def _flat(self, positions: torch.Tensor) -> torch.Tensor | None:
        if self.page_table is None:
            return None
        P = self.config.page_size
        logical = (positions // P).clamp(max=self.page_table.shape[1] - 1)
        page = self.page_table.gather(1, logical.reshape(self.batch, -1)).view_as(positions)
        return (page * self.kv_heads + self.heads) * P + positions % P

    def full_dense(self) -> Selection:
        """Every cached position (dense layers, dense mode); shared by all layers of the step."""
        if self._full is None:
            # static: the step reads flat and valid only (positions None)
            self._full = dense_selection(self.lengths, self.kv_heads, self.num_pages * self.config.page_size,
                                         detail=not self.static)
            if self.page_table is not None:
                # Every slot of every listed page, in order: slot j of logical page n is at flat
                # (page_table[b, n] * Hkv + h) * P + j -> [B, Hkv, Np * P]. One broadcast instead of _flat's
                # divisions and gather over all positions (~0.2 ms per step at 8k). Slots past a row's length point
                # into its own (or 0-padded) pages: in bounds, and `valid` is False there.
                table = self.page_table[:, None, :, None] * self.kv_heads  # [B, 1, Np, 1]
                self._full.flat = ((table + self.heads[..., None]) * self.config.page_size + self.offsets).flatten(2)
        return self._full

    def select(self, scores: torch.Tensor, window: torch.Tensor | None = None, detail: bool = True) -> Selection:
        """Top-k pages of `scores` [B, Hkv, Np] plus sink and window for the rows longer than T.

        window [B, Hkv]: lengths chosen by the caller (the output-aware module), clamped to [window_min,
        window_max]; the window still ends at the newest token and covers the open page. None: the entropy rule.
        detail=False: only what attention reads (flat, valid, window; positions and pages None), ~10 ops fewer per
        layer, for the static decode step.
        """
        if self.all_dense:
            return self.short
        if not detail and StaticSelector.applies(self):  # a fixed window: a caller's window is the same one
            if self._static is None:
                self._static = StaticSelector(self)
            flat, valid = self._static.select(scores)
            return Selection(None, valid, None, self.window, self.sparse_rows, flat)
        config, P, k = self.config, self.config.page_size, self.config.top_k
        neg = float("-inf")
        scores = scores if scores.dtype == torch.float32 else scores.float()
        if self.fixed_window:  # a caller's window is clamped to [window_min, window_max]: the same fixed one
            window, start = self.window, self.start
            masked = scores.masked_fill(self.unselectable, neg)
            sink_valid, win_valid = self.sink_valid, self.win_valid
        else:
            masked = scores.masked_fill(~self.candidates[:, None, :], neg)
            if window is None:
                window = adaptive_window(masked, self.candidates, config)  # [B, Hkv]
            else:
                window = window.to(self.lengths.device, torch.long).clamp(config.window_min, config.window_max)
            start = torch.minimum(self.lengths[:, None] - window, self.sealed_end)[..., None]  # [B, Hkv, 1]
            masked = masked.masked_fill(self.page_start >= start, neg)
            sink_valid, win_valid = self._edge_valid(start)
        take = min(k, self.num_pages)
        top_scores, top_pages = masked.topk(take, dim=-1)
        chosen = top_scores > neg  # [B, Hkv, take]
        if take < k:  # fewer pages than k in the table: pad with empty picks to keep T fixed
            pad = torch.zeros(self.batch, self.kv_heads, k - take, dtype=torch.long, device=scores.device)
            top_pages = torch.cat([top_pages, pad], dim=-1)
            chosen = torch.cat([chosen, pad.bool()], dim=-1)
        page_pos = torch.add(self.offsets, top_pages[..., None], alpha=P)  # [B, Hkv, k, P]
        # A slot of a picked page counts below the window start; positions are >= 0, so an unpicked page's bound 0
        # rejects all its slots: (pos < start) & chosen in one comparison.
        page_valid = (page_pos < (start * chosen)[..., None]).flatten(-2)  # [B, Hkv, k*P]
        valid = torch.cat([sink_valid, page_valid, win_valid], dim=-1)
        flat = None
        if self.page_table is not None:
            picked = self.page_table.gather(1, top_pages.reshape(self.batch, -1)).view_as(top_pages)
            page_flat = torch.add(self.head_slots, picked[..., None], alpha=self.kv_heads * P).flatten(-2)
            flat = torch.cat([self.sink_flat, page_flat, self.win_flat], dim=-1)  # [B, Hkv, T]
        rows = self.dense_rows[:, None, None] if self.any_dense else None
        if rows is not None:  # rows short enough to fit in T slots attend densely: exact, no selection
            valid = torch.where(rows, self.short.valid, valid)
            flat = torch.where(rows, self.short.flat, flat) if flat is not None else None
        if not detail:
            return Selection(None, valid, None, window, self.sparse_rows, flat)
        positions = torch.cat([self.sink_pos, page_pos.flatten(-2), self.win_pos], dim=-1)
        if rows is not None:
            positions = torch.where(rows, self.short.positions, positions)
            chosen = chosen & ~rows  # dense rows read no selected page: stats count only real picks
        # Sparse rows are longer than T, so every slot position is >= 0; dense rows took the short positions.
        positions = positions * valid
        pages = top_pages.masked_fill(~chosen, -1)
        return Selection(positions, valid, pages, window, self.sparse_rows, flat)
