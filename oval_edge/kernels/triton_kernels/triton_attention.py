"""Sparse decode attention in Triton ([R-exact-attention, R-static-step]): one new token per row over the pool rows a
selection names, read in place (nothing is gathered), with a split-K (flash-decoding) form for long slot lists.

Why: the torch path (attention.attend_rows) copies every selected K/V row into a [B, Hkv, T, D] buffer, converts
it to q's dtype and runs two matmuls around a masked softmax: four passes over T·D per head. Here each valid
slot's K and V rows are read once from the pool, in the pool's dtype, and the softmax is online (running max,
sum and fp32 accumulator), so nothing the size of T·D is written.

Work split: one program per (row b, KV head h, split s) handles all G query heads of the group, so a KV row read
from memory serves G queries (the GQA saving). Query head i reads KV head i // G (transformers' layout).
A sparse layer's selection is short (sink + top-k pages + window: a few hundred slots) and runs as one split,
normalising in place. A dense layer at long context lists thousands of slots per head, and B·Hkv programs alone
cannot fill the GPU (8 programs for one row of an 8-KV-head model), so T is cut into `splits` chunks whose
partial (max, sum, accumulator) a small merge kernel combines exactly (flash-decoding).

No host synchronisation and no data-dependent shapes (the step is captured into a CUDA graph): the split count and
block sizes come from shapes only, limits[b] is read by the kernel (a split past a row's limit exits at once), and
the partial buffers are sized from shapes. Slots whose index lies outside the layer count as invalid (not read): a
kernel in a graph cannot raise, and an out-of-range read would be worse.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_ops import MAX, SUM

LOG2_E = 1.0 / math.log(2.0)
# Largest [G, slots, D] product tile one program holds per step of its loop. Compiled for sm_87 (Orin) with 4 warps,
# 4096 elements take ~140-220 registers a thread and do not spill (ptxas -v); 8192 took up to 255 and spilled.
TILE_ELEMENTS = 4096
MIN_BLOCK_T, MAX_BLOCK_T = 8, 128
SPLIT_MIN_SLOTS = 512  # each split reads at least this many slots
MAX_SPLITS = 16
TARGET_PROGRAMS = 128  # programs (b, h, split) worth launching: 8 per SM of an Orin's 16, ~1 per SM of an H200


def split_count(batch: int, kv_heads: int, slots: int) -> int:
    """How many splits over T: enough to reach TARGET_PROGRAMS programs, but each split at least SPLIT_MIN_SLOTS
    slots and at most MAX_SPLITS of them.

    Why these bounds: a split costs one extra write and read of G·(D + 2) floats per head (its partial result) and
    the merge launch; with >= 512 slots it has read 512·2·D K/V elements, so the merge traffic stays below ~1% of
    it. Sparse layers (T of a few hundred) therefore never split: their B·Hkv programs each stream a short list
    and the merge would cost more than the parallelism buys. A dense layer at 8k with B = 1, Hkv = 8 gets 16
    splits (128 programs); with B = 4 it gets 4. Depends on shapes only, so a captured graph keeps it.
    """
    by_length = slots // SPLIT_MIN_SLOTS
    by_occupancy = max(1, TARGET_PROGRAMS // max(1, batch * kv_heads))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


@triton.jit
def _attend_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, flat_ptr, valid_ptr, limits_ptr, out_ptr, m_ptr, l_ptr,
                   kv_heads, group, dim, slots, chunk, rows_total, scale_log2,
                   HAS_LIMITS: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """One program: row b, KV head h (axis 0 = b * Hkv + h), split s (axis 1) over slots [s*chunk, (s+1)*chunk).

    q [B, Hq, D] with Hq = Hkv·G (so the group's heads are rows bh·G .. bh·G + G - 1); k, v [rows_total, D];
    flat [B, Hkv, T] int64; valid [B, Hkv, T] bool; limits [B] int64 (HAS_LIMITS).
    QUANT: k, v are int8 codes and ks, vs [rows_total] fp32 their rows' scales (kv_dtype='int8'): each row read is
    dequantized here, code * scale, so only the selected rows' bytes and scales are read.
    SPLIT=False: out [B, Hq, D] (q's dtype), normalised. SPLIT=True: out is the fp32 accumulator [B·Hq, S, D]
    (unnormalised), m, l [B·Hq, S] the running max (log2 units) and sum, for _merge_kernel.
    """
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok, d_ok = g < group, d < dim
    heads = bh * group + g  # [G]: the group's query heads, as rows of q's [B·Hq, D] view
    q = tl.load(q_ptr + heads[:, None].to(tl.int64) * dim + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)
    q = q.to(tl.float32) * scale_log2  # [G, D], logits in log2 units
    lo = s * chunk
    hi = tl.minimum(lo + chunk, slots)
    if HAS_LIMITS:
        hi = tl.minimum(hi, tl.load(limits_ptr + b))  # the row's own length bounds what it reads
    peak = tl.full([BLOCK_G], -3.0e38, dtype=tl.float32)  # finite: an all-invalid block leaves exp2(0 - 0) = 1 out
    total = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    base = bh.to(tl.int64) * slots
    for start in range(lo, hi, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        in_range = t < hi
        idx = tl.load(flat_ptr + base + t, mask=in_range, other=0)  # [T] int64 pool rows
        ok = (tl.load(valid_ptr + base + t, mask=in_range, other=0) != 0) & in_range
        ok = ok & (idx >= 0) & (idx < rows_total)
        rows = idx[:, None] * dim + d[None, :]  # [T, D]
        row_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if QUANT:
            k = k * tl.load(ks_ptr + idx, mask=ok, other=0.0)[:, None]
        z = tl.reduce(q[:, None, :] * k[None, :, :], 2, SUM)  # [G, T]
        z = tl.where(ok[None, :], z, float("-inf"))
        new_peak = tl.maximum(peak, tl.reduce(z, 1, MAX))
        rescale = tl.exp2(peak - new_peak)  # [G]: the old terms under the new max
        w = tl.exp2(z - new_peak[:, None])  # [G, T]; 0 for invalid slots
        total = total * rescale + tl.reduce(w, 1, SUM)
        v = tl.load(v_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if QUANT:
            v = v * tl.load(vs_ptr + idx, mask=ok, other=0.0)[:, None]
        acc = acc * rescale[:, None] + tl.reduce(w[:, :, None] * v[None, :, :], 1, SUM)  # [G, D]
        peak = new_peak
    if SPLIT:
        splits = tl.num_programs(1)
        part = heads.to(tl.int64) * splits + s  # [G]: (head, split) in the [B·Hq, S] partial buffers
        tl.store(m_ptr + part, peak, mask=g_ok)
        tl.store(l_ptr + part, total, mask=g_ok)
        tl.store(out_ptr + part[:, None] * dim + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    else:
        # A (b, h) with no valid slot gets zeros, as the C kernel (callers guarantee one: the row's own token).
        res = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
        tl.store(out_ptr + heads[:, None].to(tl.int64) * dim + d[None, :], res.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, splits, dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per query head (row of q's [B·Hq, D] view): combine its S partial results exactly,
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s. acc [B·Hq, S, D] fp32,
    m, l [B·Hq, S] fp32 -> out [B·Hq, D] (q's dtype). Splits that read nothing have m = -3e38, l = 0, acc = 0."""
    head = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok, d_ok = s < splits, d < dim
    m = tl.load(m_ptr + head * splits + s, mask=s_ok, other=-3.0e38)
    l = tl.load(l_ptr + head * splits + s, mask=s_ok, other=0.0)
    top = tl.reduce(m, 0, MAX)
    w = tl.where(s_ok, tl.exp2(m - top), 0.0)  # [S]
    acc = tl.load(acc_ptr + (head * splits + s)[:, None] * dim + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    total = tl.reduce(w * l, 0, SUM)
    res = tl.reduce(w[:, None] * acc, 0, SUM) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + head * dim + d, tl.where(total > 0, res, 0.0).to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _rope_write_kernel(qkv_ptr, row_stride, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_ptr, v_ptr, heads, kv_heads, dim,
                       half, BLOCK_D: tl.constexpr):
    """One program: token row r (axis 0), head h of the fused q|k heads (axis 1, Hq + Hkv of them).

    qkv [n, (Hq + 2 Hkv) * D] rows of q | k | v heads (row stride row_stride); cos, sin [n, D] (sin signed: its first
    half negated, rotate_half folded in). RoPE in transformers' rotate_half convention, rounded as torch's
    x * cos then addcmul (the product in x's dtype, the sum in fp32 then x's dtype). A query head goes to q [n, Hq, D];
    key head j to k[slots[r, j]] and value head j, unrotated, to v[slots[r, j]] (k, v: a layer's [rows, D] pool
    rows, in the pool's dtype)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < dim
    src = qkv_ptr + r * row_stride + h * dim
    x = tl.load(src + d, mask=ok, other=0.0)
    partner = tl.load(src + (d + half) % dim, mask=ok, other=0.0)  # rotate_half's pair: x rolled by D/2
    c = tl.load(cos_ptr + r * dim + d, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + r * dim + d, mask=ok, other=0.0).to(tl.float32)
    first = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    out = (first + partner.to(tl.float32) * s).to(x.dtype)
    if h < heads:
        tl.store(q_ptr + (r * heads + h) * dim + d, out, mask=ok)
    else:
        slot = tl.load(slots_ptr + r * kv_heads + (h - heads))
        tl.store(k_ptr + slot * dim + d, out.to(k_ptr.dtype.element_ty), mask=ok)
        v = tl.load(src + kv_heads * dim + d, mask=ok, other=0.0)  # value head j sits Hkv heads after key head j
        tl.store(v_ptr + slot * dim + d, v.to(v_ptr.dtype.element_ty), mask=ok)


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               slots: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> torch.Tensor:
    """A layer's q, k, v from its fused projection in one launch: qkv [n, (Hq + 2 Hkv) * D] (unit stride along a
    row); cos, sin [n, 1, D] contiguous (sin signed); slots [n, Hkv] int64 contiguous; k_rows, v_rows [rows, D]
    contiguous -> q [n, Hq, D] rotated, contiguous; the rotated keys and the values written at their slots."""
    n, dim = qkv.shape[0], k_rows.shape[-1]
    q = torch.empty((n, heads, dim), dtype=qkv.dtype, device=qkv.device)
    _rope_write_kernel[(n, heads + kv_heads)](qkv, qkv.stride(0), cos, sin, slots, q, k_rows, v_rows, heads,
                                              kv_heads, dim, dim // 2, BLOCK_D=triton.next_power_of_2(dim))
    return q


def _block_t(group: int, block_d: int, slots: int) -> int:
    """Slots per loop step: as many as keep the [G, T, D] product tile within TILE_ELEMENTS (at least MIN_BLOCK_T)."""
    fits = max(MIN_BLOCK_T, TILE_ELEMENTS // (triton.next_power_of_2(group) * block_d))
    return min(1 << (fits.bit_length() - 1), MAX_BLOCK_T, max(MIN_BLOCK_T, triton.next_power_of_2(slots)))


def attend_slots(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, flat: torch.Tensor,
                 valid: torch.Tensor, scale: float, limits: torch.Tensor | None = None,
                 splits: int | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """attention.attend_rows with the rows read in place. q [B, Hq, D]; k_rows, v_rows [rows, D] (contiguous, any
    float dtype, may differ from q's; or int8 codes with scales = (k, v) fp32 [rows]); flat [B, Hkv, T] int64;
    valid [B, Hkv, T] bool; limits [B] int64: row b reads only its first limits[b] slots -> [B, Hq, D] in q's
    dtype. splits: None = split_count(B, Hkv, T)."""
    b, hq, dim = q.shape
    hkv, slots = flat.shape[1], flat.shape[2]
    group = hq // hkv
    q = q.contiguous()
    flat = flat if flat.dtype == torch.int64 and flat.is_contiguous() else flat.to(torch.int64).contiguous()
    valid = valid.contiguous()
    if limits is not None and (limits.dtype != torch.int64 or not limits.is_contiguous()):
        limits = limits.to(torch.int64).contiguous()
    block_d = triton.next_power_of_2(dim)
    block_t = _block_t(group, block_d, slots)
    splits = split_count(b, hkv, slots) if splits is None else max(1, min(int(splits), triton.cdiv(slots, block_t)))
    chunk = triton.cdiv(triton.cdiv(slots, splits), block_t) * block_t  # whole loop steps per split
    splits = triton.cdiv(slots, chunk)  # no split starts past T
    out = torch.empty_like(q)
    meta = dict(HAS_LIMITS=limits is not None, QUANT=scales is not None, BLOCK_G=triton.next_power_of_2(group), BLOCK_T=block_t,
                BLOCK_D=block_d)
    args = (hkv, group, dim, slots, chunk, k_rows.shape[0], float(scale) * LOG2_E)
    bounds = flat if limits is None else limits  # not read without HAS_LIMITS
    kv = (k_rows, v_rows, *(scales if scales is not None else (k_rows, v_rows)))  # scales not read without QUANT
    if splits == 1:
        _attend_kernel[(b * hkv, 1)](q, *kv, flat, valid, bounds, out, out, out, *args, SPLIT=False,
                                     **meta)
        return out
    acc = torch.empty((b * hq, splits, dim), dtype=torch.float32, device=q.device)
    peak = torch.empty((b * hq, splits), dtype=torch.float32, device=q.device)
    total = torch.empty_like(peak)
    _attend_kernel[(b * hkv, splits)](q, *kv, flat, valid, bounds, acc, peak, total, *args, SPLIT=True,
                                      **meta)
    _merge_kernel[(b * hq,)](acc, peak, total, out, splits, dim, BLOCK_S=triton.next_power_of_2(splits),
                             BLOCK_D=block_d)
    return out
