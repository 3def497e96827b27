"""Prefill attention over the page pool: dense and exact for chunks of new tokens ([R-dense-where-it-pays]).

A chunk that starts a sequence attends to itself (causal); a later chunk also reads the row's earlier pages, one KV
head at a time. Soft-capped logits (Gemma 2) take the explicit masked path, which SDPA and flash-attn lack.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from oval_edge.kv.int8 import dequantize_rows, quantize_rows
from oval_edge.kv.pool import PagePool
from oval_edge.kv.step_index import StepIndex

from .attention import as_dtype, cap_logits, flat_slots, head_by_head_kv


def prefill_attention(
    pool: PagePool,
    layer: int,
    step: StepIndex,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Dense causal attention for chunks of new tokens (prefill), after they were written to the pool.

    q [N, Hq, D]; k_new, v_new [N, Hkv, D] (this step's tokens, rows concatenated) -> [N, Hq, D].
    A chunk that starts a sequence attends to itself; a later chunk also reads the row's earlier pages.
    """
    out = torch.empty_like(q)
    for row, offset, start, end in chunk_rows(step):
        n = end - start
        qs = q[offset : offset + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        if start == 0:
            # The chunk's own K/V as the pool stores them (rounded to its dtype), the values every later reader
            # sees: a later chunk, decode, and a request that maps these pages from the prefix cache, whose
            # greedy tokens must equal this one's.
            # [1, Hkv, n, D]; int8 pools: the rows' int8 round trip (kv/int8.py), what decode will read
            ks = stored_rows(k_new[offset : offset + n], pool).transpose(0, 1)[None]
            vs = stored_rows(v_new[offset : offset + n], pool).transpose(0, 1)[None]
            if softcap:
                positions = torch.arange(n, device=q.device)
                res = capped_attention(qs, ks.to(q.dtype), vs.to(q.dtype), positions[None, :] <= positions[:, None],
                                       scale, softcap)
            else:
                res = _causal(qs, ks.to(q.dtype), vs.to(q.dtype), scale)
        else:
            flat = step.history_slots.get(row)
            if flat is None:  # the same for every layer of the step: built once
                positions = torch.arange(end, device=q.device).expand(1, pool.geometry.kv_heads, end)
                flat = flat_slots(step.page_table[row : row + 1], positions, pool.geometry.kv_heads,
                                  pool.geometry.page_size)
                step.history_slots[row] = flat
            res = _attend_history(pool, layer, flat, qs, start, scale, softcap)
        out[offset : offset + n] = res[0].transpose(0, 1)
    return out


def stored_rows(x: torch.Tensor, pool: PagePool) -> torch.Tensor:
    """x [n, Hkv, D] as the pool returns it to a reader: in its dtype, or int8-quantized and back (fp32)."""
    if pool.int8 is None:
        return as_dtype(x, pool.k.dtype)
    codes, scales = quantize_rows(x.reshape(-1, x.shape[-1]))
    return dequantize_rows(codes, scales).view(x.shape)


def chunk_rows(step: StepIndex):
    """(row, offset of its first new token in the step, start, end position) of each row with new tokens."""
    offset = 0
    for row, n in enumerate(step.new_tokens):
        if n:
            yield row, offset, step.lengths_list[row] - n, step.lengths_list[row]
        offset += n


HISTORY_QUERY_BLOCK = 128  # queries per masked SDPA call over a long history: its float mask is 128 x context x 4 B


def _attend_history(pool: PagePool, layer: int, flat: torch.Tensor, q: torch.Tensor, start: int,
                    scale: float, softcap: float = 0.0) -> torch.Tensor:
    """A later chunk's queries q [1, Hq, n, D] (positions start..end-1) over the row's whole history in the pool,
    whose flat slots [1, Hkv, end] are `flat`.

    One KV head at a time (head_by_head_kv): its keys and values are gathered (and converted to q's dtype) alone
    and only its G query heads attend to them, so at 8k this holds ~6 MB instead of ~38 MB (all heads at once).
    -> [1, Hq, n, D].
    """
    hkv = pool.geometry.kv_heads
    group = q.shape[1] // hkv
    split = _split_attention_for_cpu() if q.device.type == "cpu" and not softcap else None
    out = torch.empty_like(q)
    k_rows, v_rows, flat, scales = pool.readable(layer, flat)  # stored pages read back (a page store)
    for head, (k, v) in enumerate(head_by_head_kv(k_rows, v_rows, flat, q.dtype, scales)):
        heads = slice(head * group, (head + 1) * group)
        if split is not None:
            out[:, heads] = _history_without_mask(split, q[:, heads], k, v, start, scale)
        else:
            out[:, heads] = _history_with_mask(q[:, heads], k, v, start, scale, softcap)
    return out


def _history_without_mask(split, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                          scale: float) -> torch.Tensor:
    """q [1, G, n, D] at positions start..start+n-1 over k, v [1, 1, start+n, D]: two mask-free attentions merged.

    Every query sees all of [0, start), so that part needs no mask and the G heads' queries share one call
    ([1, 1, G*n, D] against the head's keys); the chunk's own keys need a plain causal mask (query i sees keys
    <= i). Each call also returns its log-sum-exp, which merges the two softmaxes exactly. No [n, context] mask is
    built (SDPA would turn a bool one into a float copy per call: 4 MB per 128 queries at 8k, and 12% of prefill).
    """
    _, g, n, d = q.shape
    past, past_lse = split(q.reshape(1, 1, g * n, d), k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)
    own_k, own_v = k[:, :, start:].expand(1, g, n, d), v[:, :, start:].expand(1, g, n, d)
    own, own_lse = split(q, own_k, own_v, 0.0, True, scale=scale)  # [1, G, n, D], [1, G, n]
    past_lse = past_lse.view(1, g, n, 1)
    own_lse = own_lse.view(1, g, n, 1)
    peak = torch.maximum(past_lse, own_lse)
    w_past, w_own = (past_lse - peak).exp_(), (own_lse - peak).exp_()  # [1, G, n, 1]
    merged = past.view(1, g, n, d) * w_past + own * w_own
    return merged.div_(w_past + w_own)


def _history_with_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                       softcap: float = 0.0) -> torch.Tensor:
    """The same attention as `_history_without_mask` through SDPA with a causal-with-offset mask, in blocks of
    queries (devices without the CPU flash kernel's log-sum-exp output). q [1, G, n, D] -> [1, G, n, D]."""
    n, end = q.shape[2], k.shape[2]
    key_pos = torch.arange(end, device=q.device)
    mask = key_pos[None, :] <= torch.arange(start, end, device=q.device)[:, None]  # [n, end]
    if softcap:
        return capped_attention(q, k, v, mask, scale, softcap)
    out = torch.empty_like(q)
    for first in range(0, n, HISTORY_QUERY_BLOCK):
        rows = slice(first, first + HISTORY_QUERY_BLOCK)
        out[:, :, rows] = F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=mask[rows], scale=scale,
                                                         enable_gqa=True)
    return out


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float) -> torch.Tensor:
    """Masked attention with soft-capped logits, which SDPA and flash-attn do not take: q [1, Hq, n, D] over
    k, v [1, Hkv, T, D] (GQA), mask [n, T] True where a query sees a key -> [1, Hq, n, D]. Blocks of queries bound
    the [Hq, block, T] fp32 logits."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [1, Hq, T, D]
    out = torch.empty_like(q)
    for first in range(0, q.shape[2], HISTORY_QUERY_BLOCK):
        rows = slice(first, first + HISTORY_QUERY_BLOCK)
        logits = cap_logits(torch.matmul(q[:, :, rows], k.transpose(-1, -2)) * scale, softcap)
        logits = logits.masked_fill(~mask[rows], float("-inf"))
        out[:, :, rows] = torch.matmul(torch.softmax(logits.float(), dim=-1).to(q.dtype), v)
    return out


def _split_attention_for_cpu():
    """torch's CPU flash-attention op, which also returns each query's log-sum-exp; None where it is absent."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of a fresh chunk; flash-attn on CUDA when it is installed, SDPA otherwise."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _has_flash_attn():
        from flash_attn import flash_attn_func  # [batch, seq, heads, dim] layout, GQA native

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=True)
        return out.transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None
