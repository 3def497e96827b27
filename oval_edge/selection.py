"""Which token positions each KV head attends to at a decode step (DESIGN §4.2, §4.4, §4.5).

Every row of the batch gets the same number T of slots per KV head, so the gathered buffer has a static shape:

    T = (sink_pages + top_k) * page_size + window_slots,   window_slots = max(window_max, page_size)

laid out as [sink pages | top-k selected pages | last `window_slots` positions]. A `valid` mask marks the slots
that are really attended. No position is attended twice: page slots count only below the window start `ws`,
window slots only at or above it. Rows whose whole sequence fits in T attend densely (positions 0..L-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import OvalConfig


@dataclass
class Selection:
    positions: torch.Tensor  # [B, Hkv, T] absolute positions (0 where invalid, so the gather stays in bounds)
    valid: torch.Tensor  # [B, Hkv, T] bool
    pages: torch.Tensor | None  # [B, Hkv, k] logical pages chosen (-1: none / dense row); None for dense layers
    window: torch.Tensor | None  # [B, Hkv] entropy window length in tokens; meaningful only where sparse_rows
    sparse_rows: torch.Tensor  # [B] bool: the row used page selection

    @property
    def slots(self) -> int:
        return self.positions.shape[-1]


def window_slots(config: OvalConfig) -> int:
    # The window must also cover the open (unsealed) page, which has no summary and cannot be selected.
    return max(config.window_max, config.page_size)


def slots_per_step(config: OvalConfig) -> int:
    """T: token slots gathered per KV head at a sparse decode step (= config.token_budget, one definition)."""
    return (config.sink_pages + config.top_k) * config.page_size + window_slots(config)


def dense_selection(lengths: torch.Tensor, kv_heads: int, width: int) -> Selection:
    """Attend to every position 0..L-1 (dense layers, short sequences). width >= max(lengths)."""
    pos = torch.arange(width, device=lengths.device)
    valid = (pos[None, :] < lengths[:, None])[:, None, :].expand(-1, kv_heads, -1)
    positions = pos * valid  # 0 where invalid, as the Selection contract says: [B, Hkv, width]
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
    P, sink, k = config.page_size, config.sink_pages, config.top_k
    b, kv_heads, num_pages = scores.shape
    dev = scores.device
    page_idx = torch.arange(num_pages, device=dev)
    length = lengths[:, None]  # [B, 1]
    # Candidates: sealed, not a sink page, and starting before the earliest possible window start.
    candidates = (page_idx >= sink) & (page_idx < sealed[:, None]) & (page_idx * P < length - config.window_min)
    masked = scores.float().masked_fill(~candidates[:, None, :], float("-inf"))
    window = adaptive_window(masked, candidates, config)  # [B, Hkv]
    # The window also starts no later than the first unsealed page, so every position is reachable.
    start = torch.minimum(length - window, (sealed * P)[:, None])  # [B, Hkv]
    masked = masked.masked_fill(page_idx * P >= start[..., None], float("-inf"))

    take = min(k, num_pages)
    top_scores, top_pages = masked.topk(take, dim=-1) if take else (masked[..., :0], masked[..., :0].long())
    chosen = top_scores > float("-inf")  # [B, Hkv, take]
    if take < k:  # fewer pages than k in the table: pad with empty picks to keep T fixed
        pad = torch.zeros(b, kv_heads, k - take, dtype=torch.long, device=dev)
        top_pages = torch.cat([top_pages, pad], dim=-1)
        chosen = torch.cat([chosen, pad.bool()], dim=-1)

    offsets = torch.arange(P, device=dev)
    sink_pos = torch.arange(sink * P, device=dev).expand(b, kv_heads, -1)
    page_pos = (top_pages[..., None] * P + offsets).flatten(-2)  # [B, Hkv, k*P]
    page_ok = chosen.repeat_interleave(P, dim=-1)
    w_slots = window_slots(config)
    win_pos = (length - w_slots + torch.arange(w_slots, device=dev))[:, None, :].expand(-1, kv_heads, -1)

    before_window = start[..., None]
    positions = torch.cat([sink_pos, page_pos, win_pos], dim=-1)
    valid = torch.cat(
        [sink_pos < before_window, page_ok & (page_pos < before_window), (win_pos >= before_window) & (win_pos >= 0)],
        dim=-1,
    )
    # Rows short enough to fit in T slots attend densely: exact, and no selection is needed.
    slots = positions.shape[-1]
    dense_rows = lengths <= slots
    if bool(dense_rows.any()):
        dense = dense_selection(lengths, kv_heads, slots)
        positions = torch.where(dense_rows[:, None, None], dense.positions, positions)
        valid = torch.where(dense_rows[:, None, None], dense.valid, valid)
    positions = positions.clamp_min(0) * valid
    # Dense rows read no selected page: report none, so selection statistics count only real picks.
    chosen = chosen & ~dense_rows[:, None, None]
    pages = torch.where(chosen, top_pages, torch.full_like(top_pages, -1))
    return Selection(positions, valid, pages, window, ~dense_rows)

