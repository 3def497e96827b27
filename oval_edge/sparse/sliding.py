"""Attention of the sliding-window layers over their rings (oval_edge/kv/ring.py): exact, never scored.

A query at position t sees keys at positions (t - W, t] (transformers' sliding-window mask). Decode reads the row's
whole ring, R pages = R * P slots, and masks by position the few it holds beyond the window: what is read is bounded
by the ring, never the context. Prefill gathers the window before the chunk's positions from the ring *before* the
chunk is written (a chunk longer than the ring overwrites pages its first queries still need), then attends over
[that history | the chunk's own keys, rounded to the pool's dtype as every later reader sees them].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oval_edge.kv.ring import ring_row

from .attention import as_dtype, attend_rows
from .prefill import HISTORY_QUERY_BLOCK, capped_attention, chunk_rows


def ring_slots(lengths: torch.Tensor, ring_base: torch.Tensor, geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat [B, Hkv, R*P], valid [B, Hkv, R*P]) of each row's ring after it wrote its token at lengths - 1.

    Ring page j holds the latest logical page lp <= cur with lp = j mod R (cur = the page of t = lengths - 1),
    so slot (j, o) holds position lp * P + o: valid when lp >= 0 and t - W < position <= t. All device ops on [B]
    inputs: static shapes, no host sync (the static decode step uses it too)."""
    g = geometry
    P, R, W, H = g.page_size, g.ring_pages, g.window, g.kv_heads
    last = lengths - 1  # [B]
    slot = torch.arange(R * P, device=lengths.device)
    j, offset = slot // P, slot % P  # [S]
    cur = (last // P)[:, None]  # [B, 1]
    logical = cur - torch.remainder(cur - j[None, :], R)  # [B, S]
    position = logical * P + offset[None, :]
    valid = (logical >= 0) & (position <= last[:, None]) & (position > last[:, None] - W)  # [B, S]
    page = ring_base[:, None] + j[None, :]  # [B, S]
    heads = torch.arange(H, device=lengths.device)[None, :, None]
    flat = (page[:, None, :] * H + heads) * P + offset[None, None, :]  # [B, H, S]
    return flat, valid[:, None, :].expand(-1, H, -1).contiguous()


def sliding_decode(pool, layer: int, ring: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, scale: float,
                   softcap: float = 0.0) -> torch.Tensor:
    """One new token per row (already written to the ring): q [B, Hq, D] -> out [B, Hq, D]. ring: the step's
    ring_slots (flat, valid), the same in every sliding layer, so computed once per step."""
    flat, valid = ring
    return attend_rows(q, pool.k_rows[layer], pool.v_rows[layer], flat, valid, scale, softcap=softcap)


def sliding_prefill(pool, layer: int, step, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    scale: float, softcap: float = 0.0, history: dict | None = None) -> torch.Tensor:
    """Chunks of new tokens, BEFORE they are written to the rings. q [N, Hq, D]; k_new, v_new [N, Hkv, D] ->
    [N, Hq, D]. history: where a later layer reads this layer's K/V (Gemma 4's shared layers, after this layer's
    chunk overwrote the ring), a dict that keeps each row's window before the chunk: filled by the layer that owns
    the ring, read by the layers sharing it."""
    g = pool.geometry
    P, W, H = g.page_size, g.window, g.kv_heads
    out = torch.empty_like(q)
    for row, offset, start, end in chunk_rows(step):
        n = end - start
        first = max(0, start - W + 1)  # the earliest position the chunk's first query sees
        ks = as_dtype(k_new[offset : offset + n], pool.k.dtype).transpose(0, 1)  # [Hkv, n, D]
        vs = as_dtype(v_new[offset : offset + n], pool.v.dtype).transpose(0, 1)
        if first < start and history is not None and row in history:  # kept by the layer owning the ring
            ks, vs = torch.cat([history[row][0], ks], 1), torch.cat([history[row][1], vs], 1)
        elif first < start:  # the window before the chunk, still in the ring
            positions = torch.arange(first, start, device=q.device)
            base = ring_row(g, pool.rings.base(step.seq_ids[row]), positions)  # [m]
            rows = base[None, :] + torch.arange(H, device=q.device)[:, None] * P  # [Hkv, m]
            d = g.ring_dim
            k_old = pool.k_rows[layer].index_select(0, rows.reshape(-1)).view(H, -1, d)  # [Hkv, m, D]
            v_old = pool.v_rows[layer].index_select(0, rows.reshape(-1)).view(H, -1, d)
            if history is not None:
                history[row] = (k_old, v_old)
            ks, vs = torch.cat([k_old, ks], 1), torch.cat([v_old, vs], 1)
        key_pos = torch.arange(first, end, device=q.device)
        query_pos = torch.arange(start, end, device=q.device)
        mask = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - W)  # [n, keys]
        qs = q[offset : offset + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        k, v = ks[None].to(q.dtype), vs[None].to(q.dtype)  # [1, Hkv, keys, D]
        if softcap:  # Gemma 2
            out[offset : offset + n] = capped_attention(qs, k, v, mask, scale, softcap)[0].transpose(0, 1)
            continue
        res = torch.empty_like(qs)
        for block in range(0, n, HISTORY_QUERY_BLOCK):
            rows_ = slice(block, block + HISTORY_QUERY_BLOCK)
            res[:, :, rows_] = F.scaled_dot_product_attention(qs[:, :, rows_], k, v, attn_mask=mask[rows_],
                                                              scale=scale, enable_gqa=True)
        out[offset : offset + n] = res[0].transpose(0, 1)
    return out
