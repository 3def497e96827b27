"""Argument plumbing shared by the ctypes entry points of cpu.py: dtype casts that dispatch only when needed,
optional per-row bounds as pointers, input checks, and the C kernels' return codes turned into a result."""

from __future__ import annotations

import torch

from oval_edge.record_layout import int4_coord_bytes, int5_row_bytes
from oval_edge.kv.records.page_record import record_page_size as _page_size

# The C kernels' return codes: shapes above their fixed limits, an index outside the pool, no memory for scratch.
REFUSED, OUT_OF_RANGE, NO_MEMORY = 1, 2, 3


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, without an op when it already is (a same-dtype .to() is still one dispatched op, and these
    run for every layer of every decode step)."""
    return t if t.dtype == dtype else t.to(dtype)


def row_bounds(bounds: torch.Tensor | None) -> int | None:
    """The kernels' optional per-row bound [B] int64 (NULL when None); must stay alive for the call."""
    if bounds is None:
        return None
    if bounds.dtype != torch.int64 or not bounds.is_contiguous() or bounds.device.type != "cpu":
        raise ValueError("per-row bounds must be a contiguous int64 CPU tensor [B]")
    return bounds.data_ptr()


def scales_fit(scales, quantized: bool, rows: int) -> bool:
    """Scales given exactly for int8 rows, as contiguous fp32 CPU tensors of one value per row."""
    if not quantized:
        return scales is None
    return scales is not None and all(s.dtype == torch.float32 and s.is_contiguous() and s.numel() == rows
                                      and s.device.type == "cpu" for s in scales)


def records_fit(records) -> bool:
    """One layer's oval records (page_record.LayerRecords) as the scoring kernels read them in place: on the CPU,
    contiguous, and either float ones of one dtype or quantized ones with fp16 scales, in page_record's shapes."""
    mean, basis, coords, scales = records
    quantized = scales is not None
    dim, rank = mean.shape[-1], basis.shape[-2]
    int4 = basis.dtype == torch.uint8
    row = int5_row_bytes(dim) if int4 else dim
    return (on_cpu(mean, basis, coords) and all(t.is_contiguous() for t in records if t is not None)
            and quantized == (basis.dtype in (torch.int8, torch.uint8)) and basis.shape[-1] == row
            and (not int4 or coords.shape[-1] == int4_coord_bytes(rank, _page_size(basis, coords)))
            and (scales.dtype == torch.float16 and scales.shape[-1] == 1 + rank if quantized
                 else mean.dtype == coords.dtype == basis.dtype))


def record_page_size(records) -> int:
    """Tokens per page of one layer's records (page_record.record_page_size)."""
    _, basis, coords, _ = records
    return _page_size(basis, coords)


def on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def kernel_result(code: int, out: torch.Tensor, kernel: str, out_of_range: str, last: int) -> torch.Tensor | None:
    """`out` when the kernel ran; None when it refused the shapes (the caller falls back to torch). The error
    message is formatted only on error: this runs for every layer of every decode step."""
    if code == 0:
        return out
    if code in (REFUSED, NO_MEMORY):  # the torch code runs instead
        return None
    if code == OUT_OF_RANGE:
        raise ValueError(f"{kernel}: {out_of_range.format(last)}")
    raise RuntimeError(f"{kernel} returned unknown code {code}")


def grouped_fit(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, k: int) -> bool:
    """Tensors in grouped_kernels.c's layout for an input width k: uint8 codes [out, k * bits / 8], fp16 scales and
    mins [out, k / group] with group 16 or 32, k a multiple of 32."""
    groups = scales.shape[1] if scales.dim() == 2 else 0
    return (bits in (4, 8) and k % 32 == 0 and codes.dtype == torch.uint8 and codes.dim() == 2
            and codes.shape[1] * 8 == k * bits and scales.dtype == mins.dtype == torch.float16
            and scales.shape == mins.shape == (codes.shape[0], groups) and groups > 0 and k % groups == 0
            and k // groups in (16, 32))
