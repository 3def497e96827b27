"""The fused CPU kernels (score_kernels.c, group_kernels.c, attend_kernels.c, step_kernels.c, ...), loaded with
ctypes: typed entry points and their switch (argument plumbing in cpu_args.py).

Why: on a CPU, eager torch spends most of a long-context decode step on many small passes over the page summaries
(scoring) and on copying selected K/V rows out of the pool (attention). The kernels do each in one pass, reading the
pool in place. They are an optimisation only: `cpu_kernels()` is None (and callers keep their torch code) when
they are turned off (OVAL_EDGE_NATIVE=0), when no C compiler is found, when the build fails, or when the built
library disagrees with the torch reference on a small self-check (cpu_build.py builds, cpu_check.py checks).
Nothing else in the process changes. OVAL_EDGE_NATIVE_BODY=portable|avx2|avx512 loads that SIMD body's build
instead of this CPU's own (cpu_build.BODIES; A/B runs), and `body_kernels(body)` loads any of them side by side
(the parity grid, tests/test_parity_grid.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess

import torch

from .cpu_args import OUT_OF_RANGE, grouped_fit, on_cpu
from .cpu_bound import BoundAttention, BoundGroupedGemv, BoundGroupedScorer, BoundPageScorer, BoundSelect
from .cpu_build import NATIVE_BODY, built_library
from .gpu import TritonKernels, describe_gpu_kernels, gpu_kernels

NATIVE_ENV = "OVAL_EDGE_NATIVE"  # "0": never use the kernels (A/B measurements, debugging)
BODY_ENV = "OVAL_EDGE_NATIVE_BODY"  # a cpu_build.BODIES name: load that SIMD body's build (default: native)
ELEMENT_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
# Oval record formats by the basis dtype (page_record.py): the pool's float dtypes, int8, int4 packed in uint8.
RECORD_SUFFIX = {**ELEMENT_SUFFIX, torch.int8: "int8", torch.uint8: "int4"}

log = logging.getLogger(__name__)

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64
_SCORE_ARGS = [_ptr] * 7 + [_i64] * 8 + [ctypes.c_float, _ptr, _i64]
# oval_grouped_scores (group_kernels.c): q, the coarse records (mean, basis, bounds, scales) and their float dtype flag,
# the page -> slot map and the slot count, the fine records and their format,
# page table, sealed, then B, Hkv, G, D, r, P, Np, pages, group_pages, top_groups, scale, out, threads.
_GROUPED_ARGS = ([_ptr] * 5 + [_i64, _ptr, _i64] + [_ptr] * 4 + [_i64] + [_ptr] * 2 + [_i64] * 10
                 + [ctypes.c_float, _ptr, _i64])
_ATTEND_ARGS = [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _ptr, _ptr,
                _ptr, _ptr, _i64]
# attend_slots by K/V row storage: fp32, bf16, int8 codes with an fp32 scale per row (kv_dtype='int8').
ATTEND_SUFFIX = {**ELEMENT_SUFFIX, torch.int8: "int8"}


SCORING_BODIES = ("plain", "avx2", "avx2 + avx512 int4")  # by oval_scores_vectorised()'s code


class NativeKernels:
    """Typed entry points of the loaded library. Each returns None for inputs it does not take (another device
    or dtype, shapes above the limits the C file defines), so the caller runs its torch code instead."""

    def __init__(self, library: ctypes.CDLL, path: str, body: str = NATIVE_BODY) -> None:
        self.path, self.body = path, body  # body: the cpu_build.BODIES name it was built as, or "native"
        self._scores, self._attend = {}, {}
        for dtype, suffix in RECORD_SUFFIX.items():
            scores = getattr(library, f"oval_scores_{suffix}")
            scores.argtypes, scores.restype = _SCORE_ARGS, ctypes.c_int
            self._scores[dtype] = scores
        for dtype, suffix in ATTEND_SUFFIX.items():
            attend = getattr(library, f"attend_slots_{suffix}")
            attend.argtypes, attend.restype = _ATTEND_ARGS, ctypes.c_int
            self._attend[dtype] = attend
        self._grouped = library.oval_grouped_scores
        self._grouped.argtypes, self._grouped.restype = _GROUPED_ARGS, ctypes.c_int
        vectorised = library.oval_scores_vectorised
        vectorised.argtypes, vectorised.restype = [], ctypes.c_int
        # which body scores pages (score_kernels.c; int4 records on 512-bit vectors where the build has AVX-512F)
        self.scoring_body = SCORING_BODIES[vectorised()]
        self._rms_norm = library.rms_norm_f32
        self._rms_norm.argtypes, self._rms_norm.restype = [_ptr, _ptr, _i64, _i64, ctypes.c_float, _ptr], ctypes.c_int
        self._select = library.select_slots
        self._select.argtypes, self._select.restype = [_ptr] * 5 + [_i64] * 10 + [_ptr, _ptr], ctypes.c_int
        self._head = library.int8_head_f32
        self._head.argtypes, self._head.restype = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64], ctypes.c_int
        self._rows = library.int8_rows_f32
        self._rows.argtypes, self._rows.restype = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr], ctypes.c_int
        self._gemv_4bit = library.gemv_4bit_f32
        self._gemv_4bit.argtypes, self._gemv_4bit.restype = [_ptr, _i64, _i64] + [_ptr] * 4 + [_i64] * 3 + [
            _ptr, _i64, _i64], ctypes.c_int
        self._gemv_grouped = library.gemv_grouped_f32
        self._gemv_grouped.argtypes, self._gemv_grouped.restype = [_ptr, _i64, _i64] + [_ptr] * 3 + [_i64] * 2 + [
            _ptr, _i64, _i64, _ptr, _i64, _i64], ctypes.c_int
        self.grouped_rounds_inputs = bool(library.grouped_rounds_inputs())  # x to bf16: the body of grouped_bf16.h
        self._dequantize_grouped = library.dequantize_grouped
        self._dequantize_grouped.argtypes, self._dequantize_grouped.restype = [_ptr] * 3 + [_i64] * 6 + [
            _ptr, _i64, _i64], ctypes.c_int

    def oval_scores(self, q: torch.Tensor, records, page_table: torch.Tensor, scale: float,
                    counts: torch.Tensor | None = None) -> torch.Tensor | None:
        """scoring.oval_scores over the pages `page_table` [B, Np] lists, reading one layer's records in place.

        q [B, Hkv, G, D]; records: page_record.LayerRecords of one layer (mean [Hkv, pages, D], basis, coords,
        scales; any record format) -> scores [B, Hkv, Np] fp32.
        counts [B] int64: score only each row's first counts[b] pages (the rest get -3e38 and are not read).
        """
        fits = q.dim() == 4 and q.is_cpu and (q.shape[1], q.shape[3]) == (records[0].shape[0], records[0].shape[-1])
        scorer = BoundPageScorer.bind(self._scores, records, _team, q.shape[2], probe=False) if fits else None
        return None if scorer is None else scorer.lenient(q, page_table, scale, counts)

    def bind_oval_scores(self, records, group: int) -> BoundPageScorer | None:
        """oval_scores with `records` and the query group G checked once (cpu_bound.py): a callable (q, page_table,
        scale, counts=None) that never declines, or None for records the kernels do not read."""
        return BoundPageScorer.bind(self._scores, records, _team, group)

    def grouped_scores(self, q: torch.Tensor, coarse: tuple[torch.Tensor, ...], records, page_table: torch.Tensor,
                       sealed: torch.Tensor, scale: float, group_pages: int, top_groups: int) -> torch.Tensor | None:
        """grouped.grouped_scores in one call (group_kernels.c): q [B, Hkv, G, D]; coarse: one layer's coarse
        records in group_record.GROUP_NAMES' order (mean [slots, Hkv, D] and bounds [slots, Hkv, 2, r] in fp32 or
        bf16, basis [slots, Hkv, r, D] int8, scales [slots, Hkv, r] fp32), then the pool's page -> slot map [pages]
        int64 (-1: no record); records: that layer's fine LayerRecords;
        page_table [B, Np]; sealed [B] -> scores [B, Hkv, Np] fp32, -inf on pages not scored finely. None for
        inputs it does not take (the caller runs the torch code)."""
        fits = q.dim() == 4 and q.is_cpu and (q.shape[1], q.shape[3]) == (records[0].shape[0], records[0].shape[-1])
        scorer = BoundGroupedScorer.bind(self._grouped, coarse, records, group_pages, top_groups, _team, q.shape[2],
                                         page_table.shape[-1], probe=False) if fits else None
        return None if scorer is None else scorer.lenient(q, page_table, sealed, scale)

    def bind_grouped_scores(self, coarse: tuple[torch.Tensor, ...], records, group_pages: int, top_groups: int,
                            group: int, width: int) -> BoundGroupedScorer | None:
        """grouped_scores with the layer's records, the group settings, G and the page-table width checked once
        (cpu_bound.py): a callable (q, page_table, sealed, scale), or None where the kernel does not take them."""
        return BoundGroupedScorer.bind(self._grouped, coarse, records, group_pages, top_groups, _team, group, width)

    def attend_slots(self, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, flat: torch.Tensor,
                     valid: torch.Tensor, scale: float, limits: torch.Tensor | None = None,
                     scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """attention.attend over the valid slots of `flat` [B, Hkv, T] (rows of one layer's [rows, D] K and V
        views), reading them in place instead of gathering. q [B, Hq, D] fp32 -> [B, Hq, D].
        limits [B] int64: row b visits only its first limits[b] slots (the rest count as invalid).
        scales: (k, v) fp32 [rows] when the rows are int8 codes (each row read is dequantized in the kernel)."""
        hkv = flat.shape[1]
        if q.dtype != torch.float32 or q.dim() != 3 or q.shape[1] % hkv or not on_cpu(q, flat, valid):
            return None
        bound = BoundAttention.bind(self._attend, k_rows, v_rows, scales, _team, hkv, q.shape[1] // hkv, probe=False)
        return None if bound is None else bound.lenient(q, flat, valid, scale, limits)

    def bind_attend(self, k_rows: torch.Tensor, v_rows: torch.Tensor, scales, kv_heads: int,
                    group: int) -> BoundAttention | None:
        """attend_slots over one layer's rows [rows, D] (and int8 scales) checked once with Hkv and G (cpu_bound.py):
        a callable (q fp32, flat, valid, scale, limits=None), or None where the kernel does not take them."""
        return BoundAttention.bind(self._attend, k_rows, v_rows, scales, _team, kv_heads, group)

    def quest_scores(self, *args, **kwargs) -> None:
        """No C kernel for quest (a few torch passes already): None, the caller runs scoring.quest_scores."""
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """F.rms_norm(x, (dim,), weight, eps) for x [rows, dim] fp32 on the CPU; None for other inputs."""
        if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous()
                or not weight.is_contiguous() or x.shape[-1] != weight.shape[0] or not on_cpu(x, weight)):
            return None
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], float(eps), out.data_ptr())
        return out

    def int8_head(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
        """x [n, K] fp32 @ W^T for W held as runtime/model/embeddings.py's panels (codes [P, K, 32] int8, scales
        [P, K/32, 32] fp32) -> [n, P * 32] fp32, on torch's intra-op thread count. None for other inputs."""
        if (x.dtype != torch.float32 or codes.dtype != torch.int8 or scales.dtype != torch.float32 or x.dim() != 2
                or codes.dim() != 3 or x.shape[1] != codes.shape[1] or codes.shape[2] != 32
                or scales.shape != (codes.shape[0], codes.shape[1] // 32, 32)
                or not (x.is_contiguous() and codes.is_contiguous() and scales.is_contiguous())
                or not on_cpu(x, codes, scales)):
            return None
        out = torch.empty((x.shape[0], codes.shape[0] * 32), dtype=torch.float32)
        code = self._head(x.data_ptr(), x.shape[0], codes.data_ptr(), scales.data_ptr(), codes.shape[0],
                          codes.shape[1], out.data_ptr(), _team())
        return out if code == 0 else None

    def gemv_4bit(self, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
                  bias: torch.Tensor | None, out_features: int, blocksize: int) -> torch.Tensor | None:
        """x [n, K] fp32 @ W^T (+ bias) for W a bitsandbytes 4-bit weight [out_features, K] in its own layout (codes
        uint8, absmax [out * K / blocksize] fp32 un-nested, table [16] fp32; quant_kernels.c) -> [n, out] fp32
        rounded to bf16 as Linear4bit's bf16 compute rounds it, on torch's intra-op thread count. None for inputs it
        does not take (the caller runs the module)."""
        tensors = (x, codes, absmax, table) + (() if bias is None else (bias,))
        if (x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or codes.dtype != torch.uint8
                or absmax.dtype != torch.float32 or table.dtype != torch.float32 or table.numel() != 16
                or (bias is not None and (bias.dtype != torch.float32 or bias.numel() != out_features))
                or codes.numel() * 2 != out_features * x.shape[1] or not on_cpu(*tensors)
                or not all(t.is_contiguous() for t in tensors[1:])):
            return None
        out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
        code = self._gemv_4bit(x.data_ptr(), x.shape[0], x.stride(0), codes.data_ptr(), absmax.data_ptr(),
                               table.data_ptr(), None if bias is None else bias.data_ptr(), out_features, x.shape[1],
                               blocksize, out.data_ptr(), out.stride(0), _team())
        return out if code == 0 else None

    def gemv_grouped(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                     bias: torch.Tensor | None, bits: int) -> torch.Tensor | None:
        """x [n, K] fp32 @ W^T (+ bias [out] fp32) for W in the grouped integer format (codes uint8, scales / mins
        [out, K / group] fp16; runtime/model/grouped/layout.py, grouped_kernels.c) -> [n, out] fp32, on torch's
        intra-op thread count. None for inputs it does not take (the caller runs the torch path)."""
        bound = self.bind_gemv_grouped(codes, scales, mins, bias, bits)
        return None if bound is None else bound(x)

    def bind_gemv_grouped(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                          bias: torch.Tensor | None, bits: int) -> BoundGroupedGemv | None:
        """gemv_grouped with the weight checked once (cpu_bound.py); None for a weight the kernel does not read."""
        return BoundGroupedGemv.bind(self._gemv_grouped, codes, scales, mins, bias, bits, _team)

    def dequantize_grouped(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
                           first: int, last: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """Rows first..last-1 of a grouped weight (gemv_grouped's layout) -> [last - first, K] in dtype (fp32, or
        bf16 rounded to nearest even); None for inputs it does not take."""
        k = codes.shape[1] * 8 // bits
        if dtype not in (torch.float32, torch.bfloat16) or not grouped_fit(codes, scales, mins, bits, k) or not all(
                t.is_cpu and t.is_contiguous() for t in (codes, scales, mins)):
            return None
        out = torch.empty((last - first, k), dtype=dtype)
        code = self._dequantize_grouped(codes.data_ptr(), scales.data_ptr(), mins.data_ptr(), bits,
                                        k // scales.shape[1], codes.shape[0], k, first, last, out.data_ptr(),
                                        int(dtype == torch.bfloat16), _team())
        return out if code == 0 else None

    def int8_rows(self, codes: torch.Tensor, scales: torch.Tensor, vocab: int, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows `ids` [n] of the same table dequantized -> [n, K] fp32; None for inputs it does not take. An id
        outside 0..vocab-1 raises IndexError, as torch's embedding does."""
        if (ids.dtype != torch.int64 or ids.dim() != 1 or codes.dtype != torch.int8 or scales.dtype != torch.float32
                or not (ids.is_contiguous() and codes.is_contiguous() and scales.is_contiguous())
                or not on_cpu(ids, codes, scales)):
            return None
        out = torch.empty((ids.shape[0], codes.shape[1]), dtype=torch.float32)
        code = self._rows(codes.data_ptr(), scales.data_ptr(), vocab, codes.shape[1], ids.data_ptr(), ids.shape[0],
                          out.data_ptr())
        if code == OUT_OF_RANGE:
            raise IndexError(f"a token id lies outside the vocabulary 0..{vocab - 1}")
        return out if code == 0 else None

    def select_slots(self, scores: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
                     sealed: torch.Tensor, start: torch.Tensor, page_size: int, sink_pages: int, top_k: int,
                     window_slots: int, window_min: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """DecodePlan.select(detail=False)'s flat, valid [B, Hkv, T] in one pass (step_kernels.c), from scores
        [B, Hkv, Np] fp32, the step's page_table [B, Np], lengths [B], sealed [B] and the window start start [B, 1]
        or [B, Hkv] (int64). None where the kernel does not apply (the caller runs the torch code)."""
        b, hkv, pages = scores.shape
        if (not on_cpu(scores, page_table, lengths, sealed, start) or start.shape[-1] not in (1, hkv)
                or page_table.shape != (b, pages)):
            return None
        bound = BoundSelect.bind(self._select, hkv, pages, page_size, sink_pages, top_k, window_slots, window_min,
                                 probe=False)
        return bound.lenient(scores, page_table, lengths, sealed, start)

    def bind_select(self, kv_heads: int, width: int, page_size: int, sink_pages: int, top_k: int,
                    window_slots: int, window_min: int) -> BoundSelect | None:
        """select_slots with the static step's layout checked once (cpu_bound.py), or None where the kernel does
        not take it."""
        return BoundSelect.bind(self._select, kv_heads, width, page_size, sink_pages, top_k, window_slots,
                                window_min)


def _team() -> int:
    """The thread count a kernel splits its work over: torch's intra-op setting (its OpenMP team; head_kernels.c
    says why the team), within the C files' MAX_THREADS."""
    return max(1, min(64, torch.get_num_threads()))


def describe_kernels(device: torch.device) -> str:
    """Which decode path runs on `device`, for logs and serve's startup report."""
    if device.type != "cpu":
        return describe_gpu_kernels(device)  # the Triton kernels on CUDA, or why the torch ops run
    kernels = cpu_kernels()
    if kernels is not None:
        return f"native CPU scoring ({kernels.scoring_body}, {kernels.body} build) + attention ({kernels.path})"
    if os.environ.get(NATIVE_ENV, "").strip() == "0":
        return f"torch ops ({NATIVE_ENV}=0)"
    return "torch ops (native kernels unavailable: the log says why)"


def decode_kernels(device: torch.device) -> NativeKernels | TritonKernels | None:
    """The fused decode kernels for tensors on `device`: the C ones on a CPU, the Triton ones on CUDA (gpu.py);
    None where neither applies (callers run their torch code). Both offer oval_scores, quest_scores, attend_slots
    with the same arguments, and each may still return None for inputs it does not take."""
    return cpu_kernels() if device.type == "cpu" else gpu_kernels(device)


def cpu_kernels() -> NativeKernels | None:
    """The kernels, or None when they are off or unavailable (the reason is logged once). ValueError when
    OVAL_EDGE_NATIVE_BODY names a body this CPU cannot run."""
    if os.environ.get(NATIVE_ENV, "1").strip() == "0":
        return None
    return _load(os.environ.get(BODY_ENV, "").strip() or NATIVE_BODY)


def body_kernels(body: str) -> NativeKernels | None:
    """The kernels built as SIMD body `body` (cpu_build.BODIES, or "native"), whatever OVAL_EDGE_NATIVE says."""
    return _load(body)


@functools.cache
def _load(body: str = NATIVE_BODY) -> NativeKernels | None:
    try:
        path = built_library(body)
        return NativeKernels(ctypes.CDLL(path), path, body)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("native CPU kernels unavailable (%s); decoding with torch ops (slower at long context)", exc)
        return None
