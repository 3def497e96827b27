"""8-bit K/V pages (kv_dtype='int8'): the row quantizer, and the staging buffer of open pages' keys.

Format: each row of the pool (one token, one KV head: head_dim values) is stored as symmetric absmax int8,
    scale = max|x| / 127 (fp32; 1 for an all-zero row),  code = round(x / scale) in [-127, 127],
so x ~ code * scale with |error| <= scale / 2 per value. The scales live beside the codes in the pool,
[paged layers, pages, Hkv, P] fp32, allocated once with it; every attention path dequantizes only the rows it
reads (the CPU and Triton kernels in place, the torch paths on the gathered rows).

Why the staging buffer: page summaries (quest min/max, oval records) must come from the keys as the model made
them, not from their int8 round trip, or the 8-bit error would enter selection twice. Sealing happens after the
step that fills a page (PagePool.advance, all layers at once), when the forward's keys are gone. So while a page is
open, its keys are also written, in the pool's float dtype (geometry.dtype: the keys a bfloat16 pool would hold,
so the records equal that pool's), into one of `slots` staging pages, [paged layers, slots + 1, Hkv, P, D],
allocated once with the pool. A device table page -> slot (num_pages entries) lets every writer, the CUDA-graph
static step included, find the staging rows of the rows it writes with tensor ops. Slots are taken when a step is
about to write a page (PagePool.prepare, StaticStep.load) and given back when the page is sealed or freed. Slot
`slots` is an overflow page: a page that finds no free slot writes its keys there (garbage) and is sealed from
its dequantized int8 keys instead (counted in `misses`; the engine sizes `slots` so that it does not happen:
2 x max_batch + the step's tokens / page_size). Values enter only the eta > 0 record's output weighting; they are
read dequantized.
"""

from __future__ import annotations

from typing import Sequence

import torch

INT8_MAX = 127.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] float -> (codes [N, D] int8, scales [N] fp32) with x ~ codes * scales[:, None]."""
    x = x.float()
    scales = x.abs().amax(dim=-1) / INT8_MAX  # [N]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(x / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., D] int8, scales [...] fp32 -> [..., D] in dtype."""
    return (codes.float() * scales[..., None]).to(dtype)


class Int8Pages:
    """What kv_int8 adds to a pool: the scales k_scale, v_scale [paged layers, pages, Hkv, P] fp32 beside the codes,
    their per-layer [rows] views, and the KeyStaging of open pages. All allocated once, with the pool."""

    def __init__(self, geometry, num_pages: int, stage_pages: int, dtype: torch.dtype, device: torch.device) -> None:
        g = geometry
        shape = (g.paged_layers, num_pages, g.kv_heads, g.page_size)
        self.k_scale = torch.ones(shape, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(shape, dtype=torch.float32, device=device)
        self.scale_rows = [(self.k_scale[i].view(-1), self.v_scale[i].view(-1)) for i in range(g.paged_layers)]
        self.staging = KeyStaging(g, num_pages, stage_pages, dtype, device)

    def write(self, row: int, k_rows: torch.Tensor, v_rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v [N * Hkv, D] float at rows `slots` of paged layer `row`: codes into k_rows / v_rows (its int8
        [rows, D] views), scales beside them, the keys into the staging rows of their pages."""
        for rows, scale_rows, x in ((k_rows, self.scale_rows[row][0], k), (v_rows, self.scale_rows[row][1], v)):
            codes, row_scales = quantize_rows(x)
            rows.index_copy_(0, slots, codes)
            scale_rows.index_copy_(0, slots, row_scales)
        self.staging.write(row, slots, k)

    def stage(self, table: Sequence[int], start: int, new_tokens: int, page_size: int) -> None:
        """Slots for the pages of `table` that positions [start, start + new_tokens) land in."""
        if new_tokens > 0:
            self.staging.take(table[start // page_size : (start + new_tokens - 1) // page_size + 1])

    def seal_keys(self, k: torch.Tensor, pages: Sequence[int], idx: torch.Tensor) -> torch.Tensor:
        """Keys [paged layers, n, Hkv, P, D] to summarise `pages` from (staged, else k's codes dequantized)."""
        return self.staging.keys(k, self.k_scale, pages, idx)

    def values(self, v: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The pages idx's values dequantized: [paged layers, n, Hkv, P, D] fp32 (eta > 0 records)."""
        return dequantize_rows(v.index_select(1, idx), self.v_scale.index_select(1, idx))

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_scale, self.v_scale, self.staging.k, self.staging.page_slot]


class KeyStaging:
    """Full-precision keys of open pages for sealing (see the module docstring). Shapes:
    k [paged layers, slots + 1, Hkv, P, D] (geometry.dtype), page_slot [pages] long (device; `slots` = none)."""

    def __init__(self, geometry, num_pages: int, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        if slots < 1:
            raise ValueError(f"stage_pages={slots} must be >= 1 (open pages whose keys are kept for sealing)")
        g = geometry
        self.slots, self.rows_per_page = slots, g.kv_heads * g.page_size
        self.k = torch.zeros((g.paged_layers, slots + 1, g.kv_heads, g.page_size, g.head_dim), dtype=dtype,
                             device=device)
        self.k_rows = [self.k[i].view(-1, g.head_dim) for i in range(g.paged_layers)]
        self.page_slot = torch.full((num_pages,), slots, dtype=torch.long, device=device)
        self._slot_of: dict[int, int] = {}
        self._free = list(range(slots - 1, -1, -1))
        self.misses = 0  # pages sealed from dequantized keys because no slot was free

    def take(self, pages: Sequence[int]) -> None:
        """Give each page about to be written a slot (pages that have one keep it)."""
        new = [p for p in dict.fromkeys(pages) if p not in self._slot_of]
        if not new:
            return
        got = []
        for page in new:
            if not self._free:
                break
            self._slot_of[page] = self._free.pop()
            got.append(page)
        if got:
            idx = torch.tensor(got, dtype=torch.long)
            self.page_slot.index_copy_(0, idx.to(self.page_slot.device),
                                       torch.tensor([self._slot_of[p] for p in got]).to(self.page_slot.device))

    def release(self, pages: Sequence[int]) -> None:
        """Pages sealed or freed: their slots go back (the device table points them at the overflow page)."""
        gone = [p for p in pages if p in self._slot_of]
        if not gone:
            return
        for page in gone:
            self._free.append(self._slot_of.pop(page))
        self.page_slot.index_fill_(0, torch.tensor(gone, dtype=torch.long).to(self.page_slot.device), self.slots)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """k [N * Hkv, D] at the pool rows `slots` [N * Hkv] of a paged layer -> the staging rows of their pages."""
        page, offset = slots // self.rows_per_page, slots % self.rows_per_page
        rows = self.page_slot.index_select(0, page) * self.rows_per_page + offset
        self.k_rows[layer].index_copy_(0, rows, k if k.dtype == self.k.dtype else k.to(self.k.dtype))

    def keys(self, codes: torch.Tensor, scales: torch.Tensor, pages: Sequence[int], idx: torch.Tensor) -> torch.Tensor:
        """The keys to seal `pages` (idx: them on the device) from: [paged layers, n, Hkv, P, D] float, staged where
        a page has a slot, else its int8 codes [paged layers, pages, Hkv, P, D] dequantized (counted in misses)."""
        staged = [p in self._slot_of for p in pages]
        if all(staged):
            slot_idx = torch.tensor([self._slot_of[p] for p in pages], dtype=torch.long, device=self.k.device)
            return self.k.index_select(1, slot_idx)
        self.misses += staged.count(False)
        keys = dequantize_rows(codes.index_select(1, idx), scales.index_select(1, idx), self.k.dtype)
        for i, page in enumerate(pages):
            if staged[i]:
                keys[:, i] = self.k[:, self._slot_of[page]]
        return keys
