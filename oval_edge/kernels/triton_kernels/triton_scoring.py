"""Page scoring in Triton ([R-page-score, R-static-step]): oval and quest scores read from one layer's records in place.

Why: the torch scorers (oval_edge/sparse/scoring.py) first gather every listed page's record into a new buffer
([B, Hkv, Np, r, D + P] for oval), widen it to fp32, then run a matmul, r multiply-adds and a log-sum-exp, each a
pass over memory. Here each listed page's record is read once, straight from the pool through the page table, and
the logits live in registers. Same arithmetic as the C kernel (score_kernels.c): fp32 accumulation, logits in log2
units, the page's log-sum-exp over its P tokens and the group's G query heads, returned in natural-log units.

No host synchronisation and no data-dependent shapes (the static step is captured into a CUDA graph): the output
is sized from the page table's shape, block sizes from the tensor shapes, and counts[b] (pages a row really has)
is read by the kernel itself. Pages a row's count leaves out, and page-table entries outside the pool (a kernel in
a graph cannot raise), are not read and score UNSCORED; callers mask non-candidates anyway.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from oval_edge.record_layout import coord_fifth_ranks
from oval_edge.kv.records.page_record import record_page_size, rotation

from .triton_ops import MAX, SUM

UNSCORED = -3.0e38  # a page not scored (past counts[b]): finite, like the C kernel, so softmaxes over it stay finite
LOG2_E = 1.0 / math.log(2.0)
TILE_ELEMENTS = 4096  # largest [pages, G, max(D, P)] tile one program holds (fp32: 16 KB of registers for 4 warps)
MAX_PAGES_PER_PROGRAM = 32
_UNSCORED = tl.constexpr(UNSCORED)  # the kernels' copy: Triton reads only constexpr globals


@triton.jit
def _record_values(ptr, offsets, mask, FMT: tl.constexpr):
    """Record elements at `offsets` as fp32 (levels for FMT 1, int8). The int4 record's packed rows have their
    own readers (_int5_values, _int4_coord_values)."""
    return tl.load(ptr + offsets, mask=mask, other=0).to(tl.float32)


@triton.jit
def _nibble_and_bit(ptr, nibbles, plane, j, mask, bit_mask):
    """The int4 record's two packings (page_record.py) at element indices j: the nibble of element j from `nibbles`
    (two a byte, the even element in the low nibble) and its bit from the bit plane at `plane` (bit j % 8 of byte
    j / 8); offsets in bytes from ptr. Bits outside bit_mask read as 0."""
    byte = tl.load(ptr + nibbles + j // 2, mask=mask, other=0).to(tl.int32)
    bits = tl.load(ptr + plane + j // 8, mask=bit_mask, other=0).to(tl.int32)
    return tl.where(j % 2 == 1, byte >> 4, byte & 15), (bits >> (j % 8)) & 1


@triton.jit
def _int5_values(ptr, rows, d, dim, mask):
    """An int4 record's basis rows (page_record.py): `rows` [N] row indices, d [D] element indices -> [N, D] fp32
    5-bit levels. A row is dim / 2 bytes of low nibbles (stored as q + 16), then dim / 8 bytes of fifth bits."""
    start = rows[:, None] * (dim // 2 + dim // 8)
    low, high = _nibble_and_bit(ptr, start, start + dim // 2, d[None, :], mask, mask)
    return tl.where(mask, low + 16 * high - 16, 0).to(tl.float32)


@triton.jit
def _int4_coord_values(ptr, entry, i, p, rank, fifth, PAGE: tl.constexpr, mask):
    """Rank i's coordinate row of the int4 records `entry` [N] (page_record.py) -> [N, P] fp32 levels: the record's
    r * P / 2 bytes of nibbles (rank-major; level = nibble - 8), then P / 8 bytes of fifth bits for each of its
    first `fifth` ranks (such a row adds 16 * bit - 8)."""
    start = entry[:, None] * (rank * PAGE // 2 + fifth * PAGE // 8)
    j = i * PAGE + p[None, :]  # [1, P]: the token's index in the record's rank-major nibbles
    has_fifth = j < fifth * PAGE  # [1, P]: rank i < fifth, as a tensor (a mask must be one)
    low, high = _nibble_and_bit(ptr, start, start + rank * PAGE // 2, j, mask[:, None], mask[:, None] & has_fifth)
    return tl.where(mask[:, None], tl.where(has_fifth, low + 16 * high - 16, low - 8), 0).to(tl.float32)


@triton.jit
def _oval_kernel(q_ptr, qb_ptr, mean_ptr, basis_ptr, coords_ptr, scales_ptr, table_ptr, counts_ptr, out_ptr,
                 kv_heads, group, dim, rank, fifth, num_pages, pages_total, scale_log2,
                 HAS_COUNTS: tl.constexpr, FMT: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TURN: tl.constexpr = False):
    """One program: row b, KV head h (axis 0 = b * Hkv + h), BLOCK_N listed pages (axis 1).

    q [B, Hkv, G, D]; qb: the queries the basis rows are dotted with (q, or H q for the int4 record, whose rows
    are stored rotated: page_record.py); one layer's records (page_record.py): mean [Hkv, pages_total, D], basis
    B^T [Hkv, pages_total, r, D] (int4: 5-bit rows of D / 2 + D / 8 bytes), coords R^T [Hkv, pages_total, r, P]
    (int4: [Hkv, pages_total, r * P / 2 + fifth * P / 8] bytes), scales [Hkv, pages_total, 1 + r] fp16 (FMT > 0: the mean's, then per rank the product of its basis and coordinate
    scales);
    table [B, Np] int64; counts [B] int64 (HAS_COUNTS); out [B, Hkv, Np] fp32.
    logits[n, g, p] = mu[n] . q_g + sum_i (q_g . B^T[n, i]) * R^T[n, i, p] in log2 units, accumulated over the rank
    i (r is small: 1..16), so the tiles stay [BLOCK_N, G, D] and [BLOCK_N, G, P] whatever r is. Quantized records
    fold each rank's scale into the projections.
    """
    bh = tl.program_id(0)
    b = bh // kv_heads
    h = bh % kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    p = tl.arange(0, PAGE)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g_ok, d_ok = g < group, d < dim
    q = tl.load(q_ptr + (bh * group + g[:, None]) * dim + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(tl.float32) * scale_log2  # [G, D], log2 units
    if TURN:  # qb_ptr is H [D, D] fp32 (symmetric): qb = q H, one rank-1 update per input dim (no [G, D, D] tile)
        qb = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)  # (tl.zeros is a jit function: triton_ops.py)
        for i in range(0, dim):
            column = tl.load(q_ptr + (bh * group + g) * dim + i, mask=g_ok, other=0.0).to(tl.float32)  # [G]
            qb += column[:, None] * tl.load(qb_ptr + i * dim + d, mask=d_ok, other=0.0)[None, :]
    else:
        qb = tl.load(qb_ptr + (bh * group + g[:, None]) * dim + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                     other=0.0).to(tl.float32)
    qb = qb * scale_log2
    listed = n < num_pages
    if HAS_COUNTS:
        listed = listed & (n < tl.load(counts_ptr + b))
    page = tl.load(table_ptr + b.to(tl.int64) * num_pages + n, mask=listed, other=0)  # [N] int64
    inside = listed & (page >= 0) & (page < pages_total)
    entry = (h * pages_total + page).to(tl.int64)  # [N]: (h, page) in the [Hkv * pages, ...] views
    record = entry * rank  # [N]: row of (h, page, 0) in the [Hkv*pages*r, *] views
    mean = _record_values(mean_ptr, entry[:, None] * dim + d[None, :], inside[:, None] & d_ok[None, :],
                          1 if FMT > 0 else 0)  # [N, D]; the int4 record keeps an int8 mean
    offset = tl.reduce(mean[:, None, :] * q[None, :, :], 2, SUM)  # [N, G]: mu . q_g
    if FMT > 0:
        offset = offset * tl.load(scales_ptr + entry * (1 + rank), mask=inside, other=0.0).to(tl.float32)[:, None]
    logits = tl.full([BLOCK_N, BLOCK_G, PAGE], 0.0, dtype=tl.float32) + offset[:, :, None]
    for i in range(rank):
        if FMT == 2:
            u = _int5_values(basis_ptr, record + i, d, dim, inside[:, None] & d_ok[None, :])  # [N, D]
        else:
            u = _record_values(basis_ptr, (record + i)[:, None] * dim + d[None, :], inside[:, None] & d_ok[None, :],
                               FMT)  # [N, D]
        proj = tl.reduce(u[:, None, :] * qb[None, :, :], 2, SUM)  # [N, G]: the group's queries on basis vector i
        if FMT > 0:
            proj = proj * tl.load(scales_ptr + entry * (1 + rank) + 1 + i, mask=inside,
                                  other=0.0).to(tl.float32)[:, None]
        if FMT == 2:
            c = _int4_coord_values(coords_ptr, entry, i, p, rank, fifth, PAGE, inside)  # [N, P]
        else:
            c = _record_values(coords_ptr, (record + i)[:, None] * PAGE + p[None, :], inside[:, None], FMT)
        logits += proj[:, :, None] * c[:, None, :]
    logits = tl.where(g_ok[None, :, None], logits, float("-inf"))  # padded query heads take no mass
    peak = tl.reduce(tl.reduce(logits, 2, MAX), 1, MAX)  # [N]
    total = tl.reduce(tl.reduce(tl.exp2(logits - peak[:, None, None]), 2, SUM), 1, SUM)
    score = (tl.log2(total) + peak) * 0.6931471805599453  # natural-log units, as the torch scorer
    tl.store(out_ptr + bh.to(tl.int64) * num_pages + n, tl.where(inside, score, _UNSCORED), mask=n < num_pages)


@triton.jit
def _quest_kernel(q_ptr, kmin_ptr, kmax_ptr, table_ptr, counts_ptr, out_ptr,
                  kv_heads, group, dim, num_pages, pages_total, scale_log2,
                  HAS_COUNTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: row b, KV head h (axis 0), BLOCK_N listed pages (axis 1). Quest's bound per query head,
    bound[n, g] = sum_d max(q_gd * kmax_nd, q_gd * kmin_nd), then the log-sum-exp over the group of scale * bound.

    q [B, Hkv, G, D]; kmin, kmax [pages_total, Hkv, D] (one layer, page-major as the pool stores them);
    table [B, Np] int64; counts [B] int64 (HAS_COUNTS); out [B, Hkv, Np] fp32.
    """
    bh = tl.program_id(0)
    b = bh // kv_heads
    h = bh % kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g_ok, d_ok = g < group, d < dim
    q = tl.load(q_ptr + (bh * group + g[:, None]) * dim + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(tl.float32)[None, :, :]  # [1, G, D]
    listed = n < num_pages
    if HAS_COUNTS:
        listed = listed & (n < tl.load(counts_ptr + b))
    page = tl.load(table_ptr + b.to(tl.int64) * num_pages + n, mask=listed, other=0)
    inside = listed & (page >= 0) & (page < pages_total)
    row = ((page * kv_heads + h).to(tl.int64) * dim)[:, None] + d[None, :]  # [N, D]
    mask = inside[:, None] & d_ok[None, :]
    kmax = tl.load(kmax_ptr + row, mask=mask, other=0.0).to(tl.float32)[:, None, :]  # [N, 1, D]
    kmin = tl.load(kmin_ptr + row, mask=mask, other=0.0).to(tl.float32)[:, None, :]
    bound = tl.reduce(tl.maximum(q * kmax, q * kmin), 2, SUM) * scale_log2  # [N, G], log2 units
    bound = tl.where(g_ok[None, :], bound, float("-inf"))
    peak = tl.reduce(bound, 1, MAX)
    score = (tl.log2(tl.reduce(tl.exp2(bound - peak[:, None]), 1, SUM)) + peak) * 0.6931471805599453
    tl.store(out_ptr + bh.to(tl.int64) * num_pages + n, tl.where(inside, score, _UNSCORED), mask=n < num_pages)


def _pages_per_program(group: int, width: int, num_pages: int) -> int:
    """How many pages one program scores: as many as keep the [pages, G, width] tile within TILE_ELEMENTS (each
    page's record is independent, so more pages per program only amortise loading the group's queries)."""
    per_page = triton.next_power_of_2(group) * width
    fits = max(1, TILE_ELEMENTS // per_page)
    return min(1 << (fits.bit_length() - 1), MAX_PAGES_PER_PROGRAM, triton.next_power_of_2(max(num_pages, 1)))


def _counts_arg(counts: torch.Tensor | None, table: torch.Tensor) -> torch.Tensor:
    """The kernels' counts pointer: the given [B] int64, or any int64 tensor when HAS_COUNTS is off (not read)."""
    if counts is None:
        return table
    return counts if counts.dtype == torch.int64 and counts.is_contiguous() else counts.to(torch.int64).contiguous()


def _table_arg(page_table: torch.Tensor) -> torch.Tensor:
    if page_table.dtype == torch.int64 and page_table.is_contiguous():
        return page_table
    return page_table.to(torch.int64).contiguous()


FORMAT_CODES = {torch.int8: 1, torch.uint8: 2}  # the basis dtype -> the kernel's FMT (any float dtype: 0)


def oval_scores(q: torch.Tensor, records, page_table: torch.Tensor, scale: float,
                counts: torch.Tensor | None = None, turn: torch.Tensor | None = None) -> torch.Tensor:
    """scoring.oval_scores over the pages page_table [B, Np] lists, reading one layer's records in place.

    q [B, Hkv, G, D]; records: page_record.LayerRecords of one layer (contiguous; any record format)
    -> [B, Hkv, Np] fp32. counts [B] int64: pages at or past counts[b] are not read and score UNSCORED.
    turn: the int4 record's rotation H [D, D] fp32, built once by the caller (page_record.Rotations); None builds
    it here (~30 small kernels: the static step passes it).
    """
    mean, basis, coords, scales = records
    fmt = FORMAT_CODES.get(basis.dtype, 0)
    b, hkv, group, dim = q.shape
    pages_total, rank = basis.shape[1], basis.shape[2]
    page = record_page_size(basis, coords)
    table = _table_arg(page_table)
    num_pages = table.shape[1]
    out = torch.empty((b, hkv, num_pages), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(dim)
    block_n = _pages_per_program(group, max(block_d, page), num_pages)
    grid = (b * hkv, triton.cdiv(num_pages, block_n))
    q = q.contiguous()
    # int4 records: the kernel rotates the queries itself (qb = q H, H symmetric), from H [D, D] fp32 contiguous;
    # a separate q.float() @ H would be two more launches per layer
    qb = q if fmt != 2 else (turn if turn is not None else rotation(dim, q.device)).float().contiguous()
    _oval_kernel[grid](q, qb, mean, basis, coords, scales if scales is not None else mean, table,
                       _counts_arg(counts, table), out, hkv, group, dim, rank, coord_fifth_ranks(rank), num_pages,
                       pages_total,
                       float(scale) * LOG2_E, HAS_COUNTS=counts is not None, FMT=fmt, PAGE=page, BLOCK_N=block_n,
                       BLOCK_G=triton.next_power_of_2(group), BLOCK_D=block_d, TURN=fmt == 2)
    return out


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_table: torch.Tensor, scale: float,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
    """scoring.quest_scores over the pages page_table [B, Np] lists, reading one layer's kmin, kmax
    [pages, Hkv, D] in place. q [B, Hkv, G, D] -> [B, Hkv, Np] fp32; counts as in oval_scores."""
    b, hkv, group, dim = q.shape
    table = _table_arg(page_table)
    num_pages = table.shape[1]
    out = torch.empty((b, hkv, num_pages), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(dim)
    block_n = _pages_per_program(group, block_d, num_pages)
    grid = (b * hkv, triton.cdiv(num_pages, block_n))
    _quest_kernel[grid](q.contiguous(), kmin, kmax, table, _counts_arg(counts, table), out,
                        hkv, group, dim, num_pages, kmin.shape[0], float(scale) * LOG2_E,
                        HAS_COUNTS=counts is not None, BLOCK_N=block_n, BLOCK_G=triton.next_power_of_2(group),
                        BLOCK_D=block_d)
    return out
