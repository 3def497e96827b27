"""The static decode step's page selection in six ops per layer (DecodePlan.select with a fixed window).

Why: the general selection builds each layer's slots from the picked pages with arithmetic (page positions,
their bound, the pool index of each slot), assembles them, then merges in the short rows' dense slots with two
`torch.where`s: 12 kernel launches per sparse layer, 336 of a 30-layer step. Everything but the picked pages is the
same in every layer of a step, so it is tabulated once per step here:

    keep, fill  [B, 1, Np]      where a layer's scores stand (selectable pages of long rows), and what replaces them
                                elsewhere: -inf, or for a short row a descending ramp over pages sink.. so that top-k
                                lists exactly pages sink .. sink+k-1 in order, the short row's own dense slots
    page_flat   [B, Hkv, Np, P] the pool index of every slot of every listed page (the dense layers' table)
    page_valid  [B, 1, Np, P]   whether a slot of that page is attended: below the window start on a selectable
                                page (long rows), below the row's length past the sink pages (short rows)
    sink, win   [B, Hkv, S]     the sink and window slots' indices and validity, short rows' dense slots merged in

and a layer runs: where (scores or fill), top-k, two gathers of the picked pages' rows, two concatenations. Same
slots, in the same order, as DecodePlan.select's general path (tests/test_static_select.py compares them).
"""

from __future__ import annotations

import torch


class StaticSelector:
    """Per-step tables of one static DecodePlan (fixed window, page table given, Np >= sink + top_k pages)."""

    def __init__(self, plan) -> None:
        config = plan.config
        P, sink, k = config.page_size, config.sink_pages, config.top_k
        b, hkv, n = plan.batch, plan.kv_heads, plan.num_pages
        dev = plan.lengths.device
        self.k, self.shape = k, (b, hkv, n, P)
        short = plan.dense_rows[:, None, None]  # [B, 1, 1]: rows attended densely over their first T positions
        pages = torch.arange(n, device=dev)
        self.keep = plan.selectable & ~short  # [B, 1, Np]
        self.fill = torch.where(short & (pages >= sink), -pages.float(), float("-inf"))  # [B, 1, Np]
        # A short row reads below its length, a long one below its window start: [B, 1, 1]
        bound = torch.where(short, plan.lengths[:, None, None], plan.start)
        positions = plan.page_start[:, None] + plan.offsets  # [Np, P]
        readable = torch.where(short, pages >= sink, plan.selectable)  # [B, 1, Np]
        self.page_valid = readable[..., None] & (positions < bound[..., None])  # [B, 1, Np, P]
        self.page_flat = plan.full_dense().flat.view(b, hkv, n, P)
        window = plan.win_flat.shape[-1]
        self.sink_flat = plan.sink_flat
        self.sink_valid = plan.sink_pos < bound
        self.win_flat = torch.where(short, plan.short.flat[..., -window:], plan.win_flat)
        self.win_valid = torch.where(short, plan.short.valid[..., -window:], plan.win_valid)

    @staticmethod
    def applies(plan) -> bool:
        config = plan.config
        return (plan.static and plan.fixed_window and plan.page_table is not None
                and plan.num_pages >= config.sink_pages + config.top_k)

    def select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores [B, Hkv, Np] -> (flat [B, Hkv, T] pool indices, valid [B, Hkv, T]) of one layer."""
        masked = torch.where(self.keep, scores, self.fill)  # fp32 (fill is fp32)
        picked = masked.topk(self.k, dim=-1).indices  # [B, Hkv, k], best first
        b, hkv, _, page = self.shape
        index = picked[..., None].expand(b, hkv, self.k, page)
        flat = self.page_flat.gather(2, index).flatten(-2)  # [B, Hkv, k * P]
        valid = self.page_valid.expand(self.shape).gather(2, index).flatten(-2)
        return (torch.cat([self.sink_flat, flat, self.win_flat], dim=-1),
                torch.cat([self.sink_valid, valid, self.win_valid], dim=-1))
