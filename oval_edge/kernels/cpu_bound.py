"""Kernels bound once to tensors that never change: page scoring with one layer's records (what
NativeKernels.oval_scores and grouped_scores run), and a grouped projection's weight (gemv_grouped).

Why: a pool allocates its records once (kv/pool.py) and never replaces them, yet checking and converting them on
every call (device and contiguity checks over nine tensors, the record format, the layer's views of the pool's
tensors) cost ~25 us of Python a call, measured at SmolLM2's shape: 0.7 ms of a 32k decode step over its 28
sparse layers. A bound scorer checks a layer's records when it is made and keeps their pointers (and the tensors,
so the pointers stay valid); a call checks and converts only what changes per step: q, the page table, the rows'
counts. The static decode step binds one per sparse layer (runtime/engine/forward/static_step.py).
"""

from __future__ import annotations

import torch

from .cpu_args import as_dtype, grouped_fit, kernel_result, record_page_size, records_fit

ELEMENT_DTYPES = (torch.float32, torch.bfloat16)  # the coarse records' float storage (group_kernels.c)
RECORD_FORMAT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}  # group_kernels.c's fmt


def _per_call(q: torch.Tensor, hkv: int, dim: int, *rows: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """(q fp32, each of rows int64), contiguous, or None when any is not on the CPU or q is not [B, hkv, G, dim]."""
    if not (q.is_cpu and all(t.is_cpu for t in rows)) or q.dim() != 4 or q.shape[1] != hkv or q.shape[3] != dim:
        return None
    return (as_dtype(q, torch.float32).contiguous(), *(as_dtype(t, torch.int64).contiguous() for t in rows))


class BoundPageScorer:
    """scoring.oval_scores of one layer's records (page_record.LayerRecords) through oval_scores_<format>:
    score(q [B, Hkv, G, D], page_table [B, Np], scale, counts [B] | None) -> [B, Hkv, Np] fp32, or None for inputs
    the kernel does not take. Make it with `bind`, which returns None for records the kernel does not read."""

    def __init__(self, kernel, records, team) -> None:
        mean, basis, coords, scales = records
        self.records, self.kernel, self.team = records, kernel, team  # the tensors stay alive with their pointers
        self.hkv, self.dim, self.pages_total, self.rank = mean.shape[0], mean.shape[-1], basis.shape[1], basis.shape[2]
        self.pointers = (mean.data_ptr(), basis.data_ptr(), coords.data_ptr(),
                         scales.data_ptr() if scales is not None else None)
        self.page_size = record_page_size(records)

    @classmethod
    def bind(cls, kernels: dict, records, team) -> BoundPageScorer | None:
        kernel = kernels.get(records[1].dtype)
        return None if kernel is None or not records_fit(records) else cls(kernel, records, team)

    def __call__(self, q: torch.Tensor, page_table: torch.Tensor, scale: float,
                 counts: torch.Tensor | None = None) -> torch.Tensor | None:
        args = _per_call(q, self.hkv, self.dim, page_table, *(() if counts is None else (counts,)))
        if args is None:
            return None
        q, table = args[:2]
        bounds = args[2].data_ptr() if counts is not None else None
        b, _, group, _ = q.shape
        out = torch.empty((b, self.hkv, table.shape[1]), dtype=torch.float32)
        code = self.kernel(q.data_ptr(), *self.pointers, table.data_ptr(), bounds, b, self.hkv, group, self.dim,
                           self.rank, self.page_size, table.shape[1], self.pages_total, float(scale), out.data_ptr(),
                           self.team())
        return kernel_result(code, out, "oval_scores", "page table holds a page outside 0..{}", self.pages_total - 1)


class BoundGroupedScorer:
    """grouped.grouped_scores of one layer in one call of group_kernels.c: coarse records in GROUP_NAMES' order
    plus the pool's page -> slot map, the layer's fine records, group_pages and top_groups bound; score(q
    [B, Hkv, G, D], page_table [B, Np], sealed [B], scale) -> [B, Hkv, Np] fp32 (-inf on pages not scored finely),
    or None for inputs the kernel does not take. Make it with `bind`."""

    def __init__(self, kernel, coarse, records, group_pages: int, top_groups: int, team) -> None:
        mean, basis, coords, scales = records
        g_mean, g_basis, g_bounds, g_scales, g_slot = coarse
        self.coarse, self.records, self.kernel, self.team = coarse, records, kernel, team
        self.hkv, self.dim, self.pages_total, self.rank = mean.shape[0], mean.shape[-1], basis.shape[1], basis.shape[2]
        self.page_size = record_page_size(records)
        self.coarse_args = (g_mean.data_ptr(), g_basis.data_ptr(), g_bounds.data_ptr(), g_scales.data_ptr(),
                            int(g_mean.dtype == torch.bfloat16), g_slot.data_ptr(), g_mean.shape[0])
        self.fine_args = (mean.data_ptr(), basis.data_ptr(), coords.data_ptr(),
                          scales.data_ptr() if scales is not None else None, RECORD_FORMAT_CODE[basis.dtype])
        self.groups = (group_pages, top_groups)

    @classmethod
    def bind(cls, kernel, coarse, records, group_pages: int, top_groups: int, team) -> BoundGroupedScorer | None:
        g_mean, g_basis, g_bounds, g_scales, g_slot = coarse
        if (records[1].dtype not in RECORD_FORMAT_CODE or not records_fit(records)
                or not all(t.is_cpu and t.is_contiguous() for t in coarse) or g_mean.dtype not in ELEMENT_DTYPES
                or g_bounds.dtype != g_mean.dtype or g_basis.dtype != torch.int8 or g_scales.dtype != torch.float32
                or g_slot.dtype != torch.int64):
            return None
        return cls(kernel, coarse, records, group_pages, top_groups, team)

    def __call__(self, q: torch.Tensor, page_table: torch.Tensor, sealed: torch.Tensor,
                 scale: float) -> torch.Tensor | None:
        args = _per_call(q, self.hkv, self.dim, page_table, sealed)
        if args is None:
            return None
        q, table, done = args
        b, _, group, _ = q.shape
        out = torch.empty((b, self.hkv, table.shape[1]), dtype=torch.float32)
        code = self.kernel(q.data_ptr(), *self.coarse_args, *self.fine_args, table.data_ptr(), done.data_ptr(), b,
                           self.hkv, group, self.dim, self.rank, self.page_size, table.shape[1], self.pages_total,
                           *self.groups, float(scale), out.data_ptr(), self.team())
        return kernel_result(code, out, "oval_grouped_scores", "page table holds a page outside 0..{}",
                             self.pages_total - 1)


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
