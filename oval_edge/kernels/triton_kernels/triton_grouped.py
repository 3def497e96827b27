"""Projections in the grouped integer format on CUDA in Triton: y = x W^T (+ bias) for W held as 4- or 8-bit codes
with an fp16 scale and min per 16 or 32 weights (runtime/model/grouped/layout.py; `dequantize` there is the
reference, oval_edge/kernels/grouped_kernels.c the CPU kernel on the same bytes).

Why: a decode step's projections are GEMVs over a few rows of x, so their cost is streaming W; the kernel reads
the codes once, straight from memory, and never builds a dequantized copy of W (4.5 or 8.5 bits a weight read
instead of 16).

Layout of W [out, K] (K a multiple of 32, group g in {16, 32}):
  bits 4: codes [out, K / 2] uint8; in each 32-weight chunk c of a row, byte 16c + i holds weight 32c + i (low
          nibble) and weight 32c + i + 16 (high nibble);
  bits 8: codes [out, K] uint8, in order;
  scales, mins [out, K / g] fp16; weight = scale * code + min, formed in fp32.

Tiling: axis 0 takes BLOCK_OUT rows of W, axis 1 BLOCK_N rows of x; a program walks K one 32-weight chunk at a
time and splits each chunk into its two 16-weight halves. That split is the format's own: in 4 bits one load of
the chunk's 16 bytes per row gives the low half as `byte & 15` and the high half as `byte >> 4`, each already in
weight order (no interleaving), and in 8 bits the halves are the chunk's two 16-byte runs (one 32-byte sector per
row together). A half lies inside one group for both group sizes (g = 16: one group each; g = 32: both halves
share the chunk's group), so each half has a single scale and min.

Arithmetic: per half, tl.dot of x [BLOCK_N, 16] with the half's codes cast to x's dtype (integers up to 255 are
exact in fp16, bf16 and fp32) accumulates sum_k x_k code_k in fp32; then
    sum_k x_k (scale code_k + min) = scale * sum_k x_k code_k + min * sum_k x_k
adds the half's contribution to an fp32 accumulator (sum_k x_k also in fp32). So the weights are never rounded to
x's dtype: the only roundings are fp32 ones, as in the reference's fp32 weights times x.float(). fp32 rows take
the "ieee" dot (no TF32). n is padded to a BLOCK_N >= 16 that tl.dot takes; larger n takes more programs on axis
1. The bias is added in fp32 and the result is rounded once, to x's dtype.

Capturable: the output is allocated from the tensor shapes, the grid and block sizes come from shapes only, and
nothing is read back to the host (the static step is captured into CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .triton_ops import SUM

CHUNK = 32  # weights per nibble chunk along K (16 bytes in 4 bits)
GROUPS = (16, 32)
BITS = (4, 8)
BLOCK_OUT = 32  # rows of W per program: 32 rows x 16 B per half step; small so a 4096-row W still fills a GPU
MAX_BLOCK_N = 64  # rows of x per program; more rows take more programs along axis 1
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # x (and bias) dtypes on CUDA
# Triton's interpreter (CPU tensors, the tests) mis-handles bf16 (uint8 -> bf16 casts, bf16 tl.dot: see
# triton_int8_head.py), so there bf16 is declined and checked on the device only.
INTERPRETED_DTYPES = (torch.float16, torch.float32)


@triton.jit
def _half_chunk(acc, x_ptr, scales_ptr, mins_ptr, codes, rows_x, rows_w, n_ok, w_ok, hidden, k0,
                GROUP: tl.constexpr, PRECISION: tl.constexpr):
    """acc [N, OUT] fp32 + x[:, k0:k0 + 16] . (scale * codes + min)^T for one half chunk (16 weights, inside one
    group) starting at weight k0.

    codes [OUT, 16] integers in weight order; rows_x [N] and rows_w [OUT] int64 row indices."""
    k = k0 + tl.arange(0, 16)
    x = tl.load(x_ptr + rows_x[:, None] * hidden + k[None, :], mask=n_ok[:, None], other=0.0)  # [N, 16]
    # [N, OUT] fp32 sum_k x_k code_k; the products are exact for 16-bit rows (an fp16/bf16 times a byte fits fp32)
    partial = tl.dot(x, tl.trans(codes.to(x.dtype)), input_precision=PRECISION)
    total = tl.reduce(x.to(tl.float32), 1, SUM)  # [N] sum_k x_k, the min's factor
    group = rows_w * (hidden // GROUP) + k0 // GROUP  # [OUT] the half's group
    scale = tl.load(scales_ptr + group, mask=w_ok, other=0.0).to(tl.float32)
    low = tl.load(mins_ptr + group, mask=w_ok, other=0.0).to(tl.float32)
    return acc + partial * scale[None, :] + total[:, None] * low[None, :]


@triton.jit
def _grouped_kernel(x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, rows, out_features, hidden,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_OUT: tl.constexpr):
    """Axis 0: BLOCK_OUT rows of W; axis 1: BLOCK_N rows of x.

    x [rows, hidden]; codes [out, hidden * BITS / 8] uint8; scales, mins [out, hidden / GROUP] fp16; bias [out]
    (read when HAS_BIAS); out [rows, out] in x's dtype = x W^T + bias, accumulated in fp32. PRECISION: tl.dot's
    input precision ("ieee" for fp32 rows, no TF32; 16-bit rows take the default).
    """
    w_rows = tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    x_rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_ok, n_ok = w_rows < out_features, x_rows < rows
    w_rows, x_rows = w_rows.to(tl.int64), x_rows.to(tl.int64)  # row offsets past 2^31 bytes on large W
    i = tl.arange(0, 16)
    row_bytes = hidden * BITS // 8
    acc = tl.full([BLOCK_N, BLOCK_OUT], 0.0, dtype=tl.float32)  # (tl.zeros is a jit function: triton_ops.py)
    for c in range(hidden // 32):
        if BITS == 4:  # one load of the chunk's 16 bytes a row: low nibbles = weights 0..15, high = 16..31
            packed = tl.load(codes_ptr + w_rows[:, None] * row_bytes + c * 16 + i[None, :], mask=w_ok[:, None],
                             other=0)  # [OUT, 16] uint8
            first, second = packed & 15, packed >> 4
        else:  # the chunk's two 16-byte runs, adjacent: one 32-byte sector a row
            start = codes_ptr + w_rows[:, None] * row_bytes + c * 32 + i[None, :]
            first = tl.load(start, mask=w_ok[:, None], other=0)  # [OUT, 16] uint8
            second = tl.load(start + 16, mask=w_ok[:, None], other=0)
        acc = _half_chunk(acc, x_ptr, scales_ptr, mins_ptr, first, x_rows, w_rows, n_ok, w_ok, hidden, c * 32,
                          GROUP, PRECISION)
        acc = _half_chunk(acc, x_ptr, scales_ptr, mins_ptr, second, x_rows, w_rows, n_ok, w_ok, hidden, c * 32 + 16,
                          GROUP, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + w_rows, mask=w_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + x_rows[:, None] * out_features + w_rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & w_ok[None, :])


INTERPRETED = isinstance(_grouped_kernel, InterpretedFunction)  # decorated under TRITON_INTERPRET=1: CPU tensors


def takes(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None,
          bits: int) -> bool:
    """Whether the kernel takes these inputs (shapes, dtypes, devices, contiguity; no tensor values are read)."""
    device = codes.device
    dtypes = DTYPES if device.type == "cuda" else INTERPRETED_DTYPES if INTERPRETED and device.type == "cpu" else ()
    if bits not in BITS or x.dim() != 2 or codes.dim() != 2 or scales.dim() != 2 or x.dtype not in dtypes:
        return False
    out_features, hidden = codes.shape[0], x.shape[1]
    groups = scales.shape[1]
    tensors = (x, codes, scales, mins) + (() if bias is None else (bias,))
    return (hidden % CHUNK == 0 and groups > 0 and hidden % groups == 0 and hidden // groups in GROUPS
            and codes.dtype == torch.uint8 and codes.shape[1] == hidden * bits // 8
            and scales.dtype == mins.dtype == torch.float16 and scales.shape == mins.shape == (out_features, groups)
            and (bias is None or (bias.dtype in dtypes and bias.shape == (out_features,)))
            and all(t.device == device and t.is_contiguous() for t in tensors))


def grouped_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   bias: torch.Tensor | None, bits: int) -> torch.Tensor | None:
    """x [n, K] @ W^T (+ bias [out]) -> [n, out] in x's dtype, W in the grouped format (module doc); None for inputs
    the kernel does not take (`takes`), so the caller runs its torch code."""
    if not takes(x, codes, scales, mins, bias, bits):
        return None
    rows, hidden = x.shape
    out_features = codes.shape[0]
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out  # an empty grid is not launchable; there is nothing to compute
    block_n = min(MAX_BLOCK_N, max(16, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(out_features, BLOCK_OUT), triton.cdiv(rows, block_n))
    _grouped_kernel[grid](x, codes, scales, mins, x if bias is None else bias, out, rows, out_features, hidden,
                          BITS=bits, GROUP=hidden // scales.shape[1], HAS_BIAS=bias is not None,
                          PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_N=block_n,
                          BLOCK_OUT=BLOCK_OUT)
    return out
