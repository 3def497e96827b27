"""Attention over the page pool: gather exactly the selected K/V, then one exact softmax ([R-exact-attention]).

The decode path reads only the slots a `Selection` names (sink + top-k pages + window, or everything for dense
layers and short rows) into a contiguous [B, kv_heads, T, head_dim] buffer and runs SDPA on it (GQA-aware).
"""

from __future__ import annotations

import torch

from oval_edge.config import OvalConfig
from oval_edge.kernels.cpu import decode_kernels
from oval_edge.kernels.cpu_args import as_dtype
from oval_edge.kv.int8 import dequantize_rows
from oval_edge.kv.pool import PagePool
from oval_edge.kv.step_index import StepIndex

from .scoring import group_queries, score_pages
from .selection import DecodePlan, Selection


def flat_slots(page_table: torch.Tensor, positions: torch.Tensor, kv_heads: int, page_size: int) -> torch.Tensor:
    """Positions [B, Hkv, T] -> indices into a layer's K viewed as [pages*kv_heads*page_size, D]."""
    b = positions.shape[0]
    logical = (positions // page_size).clamp(max=page_table.shape[1] - 1)
    page = page_table.gather(1, logical.reshape(b, -1)).view_as(positions)
    heads = torch.arange(kv_heads, device=positions.device)[None, :, None]
    return (page * kv_heads + heads) * page_size + positions % page_size


def gather_kv(pool: PagePool, layer: int, page_table: torch.Tensor, positions: torch.Tensor):
    """Copy the named positions [B, Hkv, T] of one layer out of the pool: -> k, v [B, Hkv, T, D]."""
    g = pool.geometry
    return gather_slots(pool, layer, flat_slots(page_table, positions, g.kv_heads, g.page_size))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
           softcap: float = 0.0) -> torch.Tensor:
    """One softmax over the gathered slots. q [B, Hq, D]; k, v [B, Hkv, T, D]; valid [B, Hkv, T] -> [B, Hq, D].
    softcap > 0: the logits are soft-capped first, softcap * tanh(logits / softcap) (Gemma 2).

    Written as two grouped matmuls around a masked softmax rather than SDPA: with one query per row, SDPA's CPU
    kernel costs ~1.6x more at T = 8k (measured) and needs the mask repeated per query head; here the G query
    heads of a KV head share its K/V rows and its mask. Every row has at least one valid slot (its own token).
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    group, t = hq // hkv, k.shape[2]
    qg = q.reshape(b * hkv, group, d)  # [B * Hkv, G, D]: query head i reads KV head i // G
    keys = k.to(q.dtype).reshape(b * hkv, t, d).transpose(1, 2)
    # The scale inside the GEMM (alpha; beta = 0, so its input is never read): one kernel, where a matmul then a
    # multiply are two
    logits = torch.baddbmm(q.new_empty(()), qg, keys, beta=0, alpha=scale).view(b, hkv, group, t)  # [B, Hkv, G, T]
    if softcap:
        logits = cap_logits(logits, softcap)
    logits = torch.where(valid[:, :, None, :], logits, float("-inf"))  # one op: masked_fill_(~valid) is two
    return torch.matmul(torch.softmax(logits, dim=-1), v.to(q.dtype)).view(b, hq, d)


def decode_attention(
    pool: PagePool,
    layer: int,
    step: StepIndex,
    q: torch.Tensor,
    config: OvalConfig,
    scale: float,
    dense: bool = False,
    scores: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
    window: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, Selection]:
    """Attention of one new token per row. q [B, Hq, D] (rotated) -> ([B, Hq, D], the selection used).

    dense=True attends to every position (dense layers). Otherwise rows longer than the token budget select
    pages with `config.scorer` (or with `scores` [B, Hkv, Np] given by the caller, e.g. the eval oracle).
    window [B, Hkv]: window lengths chosen by the caller (the output-aware module) instead of the entropy rule.
    """
    g = pool.geometry
    if plan is None:
        plan = decode_plan(pool, step, config)
    if dense:
        selection = plan.full_dense()
    elif scores is None and plan.all_dense:
        # Every row fits the budget: attend densely over the page tables (at most T + page_size - 1 slots).
        selection = plan.full_dense()
    else:
        if scores is None:
            scores = score_pages(config.scorer, group_queries(q, g.kv_heads), pool.summaries, pool.paged_index[layer],
                                 step.page_table, scale, sealed=step.sealed,
                                 groups=(config.group_pages, config.top_groups))
        selection = plan.select(scores, window)
    return attend_selection(pool, layer, q, selection, scale, softcap), selection


PER_HEAD_SLOTS = 2048  # from this many slots per KV head (dense layers at long context) gather one head at a time


def attend_selection(pool: PagePool, layer: int, q: torch.Tensor, selection: Selection, scale: float,
                     softcap: float = 0.0) -> torch.Tensor:
    """Attend over the selection's K/V in one layer of the pool. q [B, Hq, D] -> [B, Hq, D]. Stored pages (a
    pool with a page store) are recalled first (PagePool.readable)."""
    k_rows, v_rows, flat, scales = pool.readable(layer, selection.flat, selection.valid)
    return attend_rows(q, k_rows, v_rows, flat, selection.valid, scale, softcap=softcap, scales=scales)


# scales: (k, v scales [rows] fp32) when the rows are int8 codes (kv_dtype='int8', oval_edge/kv/int8.py), else None;
# every path below dequantizes only the rows it reads.
Scales = tuple[torch.Tensor, torch.Tensor] | None


def attend_rows(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, flat: torch.Tensor, valid: torch.Tensor,
                scale: float, limits: torch.Tensor | None = None, softcap: float = 0.0,
                scales: Scales = None) -> torch.Tensor:
    """Attend over the valid slots `flat` [B, Hkv, T] of one layer's K/V rows [rows, D]. q [B, Hq, D] -> [B, Hq, D].

    limits [B]: row b reads only its first limits[b] slots (the static step's dense layers list every slot of a
    padded page table). On a CPU with the native kernels (oval_edge/kernels/cpu.py), and on CUDA with the Triton
    kernels (oval_edge/kernels/gpu.py), the rows are read in place. Otherwise they are gathered into a contiguous
    buffer first, and long selections go one KV head at a time: the same numbers, but the bf16 -> fp32 copies of K
    and V live for one head only (at 8k: 4 MB instead of 12 MB per dense layer, and fresh multi-MB buffers
    page-fault on every step).
    """
    kernels = decode_kernels(q.device) if not softcap else None  # the kernels take no soft-cap
    if kernels is not None:  # reads the selected rows in place: no gathered copy
        out = kernels.attend_slots(q, k_rows, v_rows, flat, valid, scale, limits, scales=scales)
        if out is not None:
            return out
    return torch_attend(q, k_rows, v_rows, flat, valid, scale, limits, softcap, scales)


def torch_attend(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, flat: torch.Tensor,
                 valid: torch.Tensor, scale: float, limits: torch.Tensor | None = None, softcap: float = 0.0,
                 scales: Scales = None) -> torch.Tensor:
    """attend_rows in torch ops only: the valid slots flat [B, Hkv, T] (the first limits[b] of row b) gathered, then
    one softmax; from PER_HEAD_SLOTS slots one KV head at a time (head_by_head_kv)."""
    if limits is not None:
        valid = valid & (torch.arange(flat.shape[-1], device=flat.device) < limits[:, None, None])
    if flat.shape[-1] < PER_HEAD_SLOTS:
        return attend(q, *gather_rows(k_rows, v_rows, flat, scales, q.dtype), valid, scale, softcap)
    group = q.shape[1] // flat.shape[1]
    parts = [attend(q[:, h * group : (h + 1) * group], k, v, valid[:, h : h + 1], scale, softcap)
             for h, (k, v) in enumerate(head_by_head_kv(k_rows, v_rows, flat, q.dtype, scales))]
    return torch.cat(parts, dim=1)


def head_by_head_kv(k_rows: torch.Tensor, v_rows: torch.Tensor, flat: torch.Tensor, dtype: torch.dtype,
                    scales: Scales = None):
    """Yield each KV head's gathered K, V [B, 1, T, D] in `dtype` for the flat slots [B, Hkv, T] of one layer's rows.

    All heads share one pair of buffers (valid until the next head is yielded): fresh multi-MB buffers per head land
    on different free heap pages each time, and a prefill chunk's 30 layers then left tens of MB resident until the
    chunk ended (with the compact heap of runtime/model/heap.py: 8k peak RSS ~660 -> ~635 MB).
    """
    b, hkv, t = flat.shape
    d = k_rows.shape[-1]
    picked = torch.empty((2, b, 1, t, d), dtype=k_rows.dtype, device=flat.device)  # [K; V] as stored in the pool
    wide = picked if k_rows.dtype == dtype else torch.empty((2, b, 1, t, d), dtype=dtype, device=flat.device)
    for head in range(hkv):
        idx = flat[:, head].reshape(-1)
        torch.index_select(k_rows, 0, idx, out=picked[0].view(b * t, d))
        torch.index_select(v_rows, 0, idx, out=picked[1].view(b * t, d))
        if scales is not None:  # int8 codes times their rows' scales [B * T]
            for i, row_scales in enumerate(scales):
                torch.mul(picked[i].view(b * t, d), row_scales.index_select(0, idx)[:, None], out=wide[i].view(b * t, d))
        elif wide is not picked:
            wide.copy_(picked)
        yield wide[0], wide[1]


def decode_plan(pool: PagePool, step: StepIndex, config: OvalConfig) -> DecodePlan:
    """Build the per-step selection plan once; pass it to decode_attention for every layer of the step."""
    if any(n > 1 for n in step.new_tokens):
        # The window slots cover the open page only when a row adds one token per step (it has at most
        # page_size unsealed positions); more would silently drop positions. Chunks go to prefill_attention.
        raise ValueError(
            f"decode_attention takes at most one new token per row, got new_tokens={step.new_tokens}; "
            "use prefill_attention for chunks"
        )
    g = pool.geometry
    return DecodePlan(config, step.lengths, step.sealed, step.page_table.shape[1], g.kv_heads, step.page_table)


def gather_slots(pool: PagePool, layer: int, flat: torch.Tensor):
    """Copy the slots `flat` [B, Hkv, T] (flat pool indices) of one layer: -> k, v [B, Hkv, T, D]."""
    k_rows, v_rows, flat, scales = pool.readable(layer, flat)
    return gather_rows(k_rows, v_rows, flat, scales)


def gather_rows(k_rows: torch.Tensor, v_rows: torch.Tensor, flat: torch.Tensor, scales: Scales = None,
                dtype: torch.dtype = torch.float32):
    """Copy the rows `flat` [B, Hkv, T] of one layer's K and V [rows, D]: -> k, v [B, Hkv, T, D] (as stored, or
    for int8 rows dequantized to `dtype`)."""
    idx = flat.reshape(-1)
    shape = (*flat.shape, k_rows.shape[-1])
    k, v = k_rows.index_select(0, idx), v_rows.index_select(0, idx)
    if scales is not None:
        k, v = (dequantize_rows(x, s.index_select(0, idx), dtype) for x, s in ((k, scales[0]), (v, scales[1])))
    return k.view(shape), v.view(shape)


def cap_logits(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's soft-capping of logits (attention and final): softcap * tanh(logits / softcap)."""
    return torch.tanh(logits / softcap) * softcap
