"""Kernels bound once to tensors that never change: page scoring with one layer's records (flat and two-level),
one layer's K/V rows for attention, the static step's selection layout, and a grouped projection's weight.

Why: a pool allocates its records and rows once (kv/pool.py) and never replaces them, yet checking and converting
them on every call (device and contiguity checks over nine tensors, the record format, the layer's views of the
pool's tensors) cost ~25 us of Python a call, measured at SmolLM2's shape: 0.7 ms of a 32k decode step over its 28
sparse layers. A bound kernel checks what it reads when it is made and keeps their pointers (and the tensors, so
the pointers stay valid); a call converts only what changes per step: q, the page table, the rows' counts.

Resolved once ([R-static-step]): `bind` returns None for tensors or shapes the kernel does not take, deciding it
with the kernel's own check (a probe call with the step's shapes and no work: the C code's limits, MAX_DIM and the
like, answer). A bound kernel then never declines: a call with other shapes is a caller's bug and raises, so the
step's ops table (sparse/step_ops_table.py) has no per-call fallback.
"""

from __future__ import annotations

import torch

from .cpu_args import (NO_MEMORY, REFUSED, as_dtype, grouped_fit, kernel_result, record_page_size, records_fit,
                       row_bounds, scales_fit)

ELEMENT_DTYPES = (torch.float32, torch.bfloat16)  # the coarse records' float storage (group_kernels.c)
RECORD_FORMAT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}  # group_kernels.c's fmt


def _queries(q: torch.Tensor, shape: tuple[int, int, int], kernel: str) -> torch.Tensor:
    """q [B, *shape] as the kernel reads it (fp32, contiguous); ValueError for another shape (a caller's bug)."""
    if tuple(q.shape[1:]) != shape or not q.is_cpu:
        raise ValueError(f"{kernel} was bound for CPU queries [B, {', '.join(map(str, shape))}], got "
                         f"{tuple(q.shape)} on {q.device}")
    return as_dtype(q, torch.float32).contiguous()


def _rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Index tensors as the kernels read them: int64, contiguous."""
    return tuple(as_dtype(t, torch.int64).contiguous() for t in tensors)


def _strict(code: int, out, kernel: str, out_of_range: str, last: int):
    """A bound kernel's result: `out`, or an error (it took these shapes when bound, so it cannot decline now)."""
    if code == NO_MEMORY:
        raise MemoryError(f"{kernel}: no memory for its scratch")
    if code == REFUSED:
        raise RuntimeError(f"{kernel} refused shapes it accepted when bound (a bug: report it)")
    return kernel_result(code, out, kernel, out_of_range, last)


class BoundPageScorer:
    """scoring.oval_scores of one layer's records (page_record.LayerRecords) through oval_scores_<format>:
    score(q [B, Hkv, G, D], page_table [B, Np], scale, counts [B] | None) -> [B, Hkv, Np] fp32. Make it with
    `bind`, which returns None for records (or a query group) the kernel does not read."""

    def __init__(self, kernel, records, team, group: int) -> None:
        mean, basis, coords, scales = records
        self.records, self.kernel, self.team, self.group = records, kernel, team, group  # tensors kept alive
        self.hkv, self.dim, self.pages_total, self.rank = mean.shape[0], mean.shape[-1], basis.shape[1], basis.shape[2]
        self.pointers = (mean.data_ptr(), basis.data_ptr(), coords.data_ptr(),
                         scales.data_ptr() if scales is not None else None)
        self.page_size = record_page_size(records)

    @classmethod
    def bind(cls, kernels: dict, records, team, group: int, probe: bool = True) -> BoundPageScorer | None:
        kernel = kernels.get(records[1].dtype)
        if kernel is None or not records_fit(records):
            return None
        bound = cls(kernel, records, team, group)
        return bound if not probe or bound._run(torch.zeros(1, bound.hkv, group, bound.dim),
                                                torch.zeros(1, 1, dtype=torch.long), 1.0,
                                                torch.zeros(1, dtype=torch.long))[0] == 0 else None  # no page read

    def __call__(self, q: torch.Tensor, page_table: torch.Tensor, scale: float,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
        return _strict(*self._call(q, page_table, scale, counts), *self._errors())

    def lenient(self, q: torch.Tensor, page_table: torch.Tensor, scale: float,
                counts: torch.Tensor | None = None) -> torch.Tensor | None:
        """A call with the unbound entry point's contract: None where the kernel declines (bound unprobed)."""
        return kernel_result(*self._call(q, page_table, scale, counts), *self._errors())

    def _call(self, q, page_table, scale, counts):
        q = _queries(q, (self.hkv, self.group, self.dim), "oval_scores")
        return self._run(q, *_rows(page_table), scale, *(() if counts is None else _rows(counts)))

    def _errors(self) -> tuple:
        return "oval_scores", "page table holds a page outside 0..{}", self.pages_total - 1

    def _run(self, q: torch.Tensor, table: torch.Tensor, scale: float, counts: torch.Tensor | None = None):
        out = torch.empty((q.shape[0], self.hkv, table.shape[1]), dtype=torch.float32)
        code = self.kernel(q.data_ptr(), *self.pointers, table.data_ptr(), row_bounds(counts), q.shape[0], self.hkv,
                           self.group, self.dim, self.rank, self.page_size, table.shape[1], self.pages_total,
                           float(scale), out.data_ptr(), self.team())
        return code, out


class BoundGroupedScorer:
    """grouped.grouped_scores of one layer in one call of group_kernels.c: coarse records in GROUP_NAMES' order
    plus the pool's page -> slot map, the layer's fine records, group_pages and top_groups bound; score(q
    [B, Hkv, G, D], page_table [B, Np], sealed [B], scale) -> [B, Hkv, Np] fp32 (-inf on pages not scored finely).
    Make it with `bind`, which probes the kernel with Np = width (the step's page-table width)."""

    def __init__(self, kernel, coarse, records, group_pages: int, top_groups: int, team, group: int) -> None:
        mean, basis, coords, scales = records
        g_mean, g_basis, g_bounds, g_scales, g_slot = coarse
        self.coarse, self.records, self.kernel, self.team, self.group = coarse, records, kernel, team, group
        self.hkv, self.dim, self.pages_total, self.rank = mean.shape[0], mean.shape[-1], basis.shape[1], basis.shape[2]
        self.page_size = record_page_size(records)
        self.coarse_args = (g_mean.data_ptr(), g_basis.data_ptr(), g_bounds.data_ptr(), g_scales.data_ptr(),
                            int(g_mean.dtype == torch.bfloat16), g_slot.data_ptr(), g_mean.shape[0])
        self.fine_args = (mean.data_ptr(), basis.data_ptr(), coords.data_ptr(),
                          scales.data_ptr() if scales is not None else None, RECORD_FORMAT_CODE[basis.dtype])
        self.groups = (group_pages, top_groups)

    @classmethod
    def bind(cls, kernel, coarse, records, group_pages: int, top_groups: int, team, group: int,
             width: int, probe: bool = True) -> BoundGroupedScorer | None:
        g_mean, g_basis, g_bounds, g_scales, g_slot = coarse
        if (records[1].dtype not in RECORD_FORMAT_CODE or not records_fit(records)
                or not all(t.is_cpu and t.is_contiguous() for t in coarse) or g_mean.dtype not in ELEMENT_DTYPES
                or g_bounds.dtype != g_mean.dtype or g_basis.dtype != torch.int8 or g_scales.dtype != torch.float32
                or g_slot.dtype != torch.int64):
            return None
        bound = cls(kernel, coarse, records, group_pages, top_groups, team, group)
        if not probe:
            return bound
        empty = torch.zeros(1, dtype=torch.long)  # sealed 0: no group complete, no page read
        code, _ = bound._run(torch.zeros(1, bound.hkv, group, bound.dim), torch.zeros(1, width, dtype=torch.long),
                             empty, 1.0)
        return bound if code == 0 else None

    def __call__(self, q: torch.Tensor, page_table: torch.Tensor, sealed: torch.Tensor,
                 scale: float) -> torch.Tensor:
        return _strict(*self._call(q, page_table, sealed, scale), *self._errors())

    def lenient(self, q: torch.Tensor, page_table: torch.Tensor, sealed: torch.Tensor,
                scale: float) -> torch.Tensor | None:
        """A call with the unbound entry point's contract: None where the kernel declines (bound unprobed)."""
        return kernel_result(*self._call(q, page_table, sealed, scale), *self._errors())

    def _call(self, q, page_table, sealed, scale):
        q = _queries(q, (self.hkv, self.group, self.dim), "oval_grouped_scores")
        return self._run(q, *_rows(page_table, sealed), scale)

    def _errors(self) -> tuple:
        return "oval_grouped_scores", "page table holds a page outside 0..{}", self.pages_total - 1

    def _run(self, q: torch.Tensor, table: torch.Tensor, sealed: torch.Tensor, scale: float):
        out = torch.empty((q.shape[0], self.hkv, table.shape[1]), dtype=torch.float32)
        code = self.kernel(q.data_ptr(), *self.coarse_args, *self.fine_args, table.data_ptr(), sealed.data_ptr(),
                           q.shape[0], self.hkv, self.group, self.dim, self.rank, self.page_size, table.shape[1],
                           self.pages_total, *self.groups, float(scale), out.data_ptr(), self.team())
        return code, out


class BoundAttention:
    """attend_slots_<rows> (attend_kernels.c) over one layer's K/V rows [rows, D] (and int8 scales) bound once:
    attend(q [B, Hkv * G, D] fp32, flat [B, Hkv, T], valid, scale, limits [B] | None) -> [B, Hkv * G, D]. Make it
    with `bind`, which returns None for rows or a query group the kernel does not take."""

    def __init__(self, kernel, k_rows, v_rows, scales, team, kv_heads: int, group: int) -> None:
        self.tensors, self.kernel, self.team = (k_rows, v_rows, scales), kernel, team  # kept alive
        self.rows, self.dim, self.hkv, self.group = k_rows.shape[0], k_rows.shape[-1], kv_heads, group
        self.pointers = (k_rows.data_ptr(), v_rows.data_ptr(), k_rows.shape[0])
        self.scale_pointers = tuple(s.data_ptr() for s in scales) if scales is not None else (None, None)

    @classmethod
    def bind(cls, kernels: dict, k_rows, v_rows, scales, team, kv_heads: int, group: int,
             probe: bool = True) -> BoundAttention | None:
        kernel = kernels.get(k_rows.dtype)
        if (kernel is None or v_rows.dtype != k_rows.dtype or k_rows.dim() != 2 or k_rows.shape != v_rows.shape
                or not (k_rows.is_cpu and v_rows.is_cpu and k_rows.is_contiguous() and v_rows.is_contiguous())
                or not scales_fit(scales, k_rows.dtype == torch.int8, k_rows.shape[0])):
            return None
        bound = cls(kernel, k_rows, v_rows, scales, team, kv_heads, group)
        if not probe:
            return bound
        slot = torch.zeros(1, kv_heads, 1, dtype=torch.long)  # row 0 of the layer, read and discarded
        code, _ = bound._run(torch.zeros(1, kv_heads * group, bound.dim), slot, torch.ones(1, kv_heads, 1,
                                                                                            dtype=torch.bool), 1.0)
        return bound if code == 0 else None

    def __call__(self, q: torch.Tensor, flat: torch.Tensor, valid: torch.Tensor, scale: float,
                 limits: torch.Tensor | None = None) -> torch.Tensor:
        return _strict(*self._call(q, flat, valid, scale, limits), *self._errors())

    def lenient(self, q: torch.Tensor, flat: torch.Tensor, valid: torch.Tensor, scale: float,
                limits: torch.Tensor | None = None) -> torch.Tensor | None:
        """A call with the unbound entry point's contract: None where the kernel declines (bound unprobed)."""
        return kernel_result(*self._call(q, flat, valid, scale, limits), *self._errors())

    def _call(self, q, flat, valid, scale, limits):
        if q.dtype != torch.float32:
            raise ValueError(f"attend_slots was bound for fp32 queries, got {q.dtype}")
        q = _queries(q, (self.hkv * self.group, self.dim), "attend_slots")
        return self._run(q, *_rows(flat), as_dtype(valid, torch.bool).contiguous(), scale, limits)

    def _errors(self) -> tuple:
        return "attend_slots", "a valid slot lies outside the layer's 0..{} rows", self.rows - 1

    def _run(self, q: torch.Tensor, flat: torch.Tensor, valid: torch.Tensor, scale: float,
             limits: torch.Tensor | None = None):
        b, slots = q.shape[0], flat.shape[-1]
        weights = torch.empty(b * q.shape[1] * slots, dtype=torch.float32)  # scratch: a row of logits per head
        out = torch.empty_like(q)
        code = self.kernel(q.data_ptr(), *self.pointers, flat.data_ptr(), valid.data_ptr(), row_bounds(limits), b,
                           self.hkv, self.group, self.dim, slots, float(scale), weights.data_ptr(), out.data_ptr(),
                           *self.scale_pointers, self.team())
        return code, out


class BoundSelect:
    """select_slots (step_kernels.c) with the static step's layout bound: select(scores [B, Hkv, Np] fp32,
    page_table [B, Np], lengths [B], sealed [B], start [B, 1]) -> (flat, valid [B, Hkv, T]), T = (sink_pages +
    top_k) * P + window_slots. Make it with `bind`, which returns None for a layout the kernel does not take (top_k
    above its MAX_TOP_K)."""

    def __init__(self, kernel, kv_heads: int, page_size: int, sink_pages: int, top_k: int, window_slots: int,
                 window_min: int) -> None:
        self.kernel, self.hkv = kernel, kv_heads
        self.layout = (page_size, sink_pages, top_k, window_slots, window_min)
        self.slots = (sink_pages + top_k) * page_size + window_slots

    @classmethod
    def bind(cls, kernel, kv_heads: int, width: int, page_size: int, sink_pages: int, top_k: int, window_slots: int,
             window_min: int, probe: bool = True) -> BoundSelect | None:
        bound = cls(kernel, kv_heads, page_size, sink_pages, top_k, window_slots, window_min)
        if not probe:
            return bound
        one = torch.ones(1, dtype=torch.long)  # a row of length 1: dense, reads page_table[0, 0] only
        code, _ = bound._run(torch.zeros(1, kv_heads, width), torch.zeros(1, width, dtype=torch.long), one,
                             one - 1, one.view(1, 1) - 1)
        return bound if code == 0 else None

    def __call__(self, scores: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor, sealed: torch.Tensor,
                 start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _strict(*self._call(scores, page_table, lengths, sealed, start), "select_slots", "{}", 0)

    def lenient(self, scores: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor, sealed: torch.Tensor,
                start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A call with the unbound entry point's contract: None where the kernel declines (bound unprobed)."""
        code, picked = self._call(scores, page_table, lengths, sealed, start)
        return picked if code == 0 else None

    def _call(self, scores, page_table, lengths, sealed, start):
        if scores.dim() != 3 or scores.shape[1] != self.hkv or not scores.is_cpu:
            raise ValueError(f"select_slots was bound for CPU scores [B, {self.hkv}, Np], got {tuple(scores.shape)}")
        return self._run(as_dtype(scores, torch.float32).contiguous(), *_rows(page_table, lengths, sealed, start))

    def _run(self, scores, page_table, lengths, sealed, start):
        b, hkv, pages = scores.shape
        flat = torch.empty((b, hkv, self.slots), dtype=torch.int64)
        valid = torch.empty((b, hkv, self.slots), dtype=torch.bool)
        code = self.kernel(scores.data_ptr(), page_table.data_ptr(), lengths.data_ptr(), sealed.data_ptr(),
                           start.data_ptr(), start.shape[-1], b, hkv, pages, *self.layout, self.slots,
                           flat.data_ptr(), valid.data_ptr())
        return code, (flat, valid)


class BoundGroupedGemv:
    """gemv_grouped_f32 (grouped_kernels.c) with one weight checked once and its pointers kept: x [n, K] fp32 ->
    x W^T (+ bias) [n, out] fp32, or None for an x the kernel does not take. Why: the per-call checks of the weight
    and its conversion to ctypes arguments cost ~8 us of Python, a tenth of the kernel at SmolLM2's shapes, ~120
    times a decode step. Make it with `bind`, which returns None for a weight the kernel does not read."""

    def __init__(self, kernel, codes, scales, mins, bias, bits: int, team) -> None:
        self.tensors = (codes, scales, mins, bias)  # kept alive with their pointers
        self.kernel, self.team, self.bits = kernel, team, bits
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * 8 // bits
        self.group = self.in_features // scales.shape[1]
        self.pointers = (codes.data_ptr(), scales.data_ptr(), mins.data_ptr())
        self.bias = None if bias is None else bias.data_ptr()

    @classmethod
    def bind(cls, kernel, codes, scales, mins, bias, bits: int, team) -> BoundGroupedGemv | None:
        k = codes.shape[1] * 8 // bits if codes.dim() == 2 and bits in (4, 8) else 0
        weight = (codes, scales, mins) + (() if bias is None else (bias,))
        if (not grouped_fit(codes, scales, mins, bits, k) or not all(t.is_cpu and t.is_contiguous() for t in weight)
                or (bias is not None and (bias.dtype != torch.float32 or bias.numel() != codes.shape[0]))):
            return None
        return cls(kernel, codes, scales, mins, bias, bits, team)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features or x.stride(1) != 1 \
                or not x.is_cpu:
            return None
        out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
        code = self.kernel(x.data_ptr(), x.shape[0], x.stride(0), *self.pointers, self.bits, self.group, self.bias,
                           self.out_features, self.in_features, out.data_ptr(), self.out_features, self.team())
        return out if code == 0 else None
