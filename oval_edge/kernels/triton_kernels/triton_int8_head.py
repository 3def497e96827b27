"""The int8 output head on CUDA in Triton: logits = x W^T for W held as int8 codes with one fp32 scale per 32 weights.

Why: on CUDA in 4-bit modes the head was the largest tensor left in 16 bits (Llama-3.1-8B: 1 GiB of its 5.3 GiB); as
int8 + per-32 scales it is 1.125 bytes a weight and each decode step streams 44% less of it. The kernel reads the
codes once, straight from memory, and never builds a dequantized copy.

Layout (runtime/model/embeddings.py's CudaInt8Table): codes [vocab, K] int8 row-major and scales [vocab, K / 32]
fp32. Row-major rather than the CPU's 32-row panels because a program here reads a tile of BLOCK_V rows x 32 codes:
each row's 32 codes are one 32-byte sector, so every sector fetched is used whole (coalesced), the embedding's
gather reads one contiguous row per token, and no padding rows are needed.

Arithmetic: per block of 32 weights, tl.dot of x [BLOCK_N, 32] (fp16/bf16) with the block's codes cast to x's dtype
(integers up to 127 are exact in both) accumulates in fp32; the block's partial sums are then multiplied by the
fp32 scales and added to an fp32 accumulator. So the only rounding besides fp32 summation is x's own dtype, and
the logits come out in fp32. n (decode rows, 1..64) is padded to a BLOCK_N >= 16 that tl.dot takes.

Capturable: the output is allocated from the tensor shapes, the grid and block sizes come from shapes only, and
nothing is read back to the host (the static step is captured into CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 32  # weights per scale (the table's block, one tl.dot's K)
BLOCK_V = 64  # vocabulary rows per program: 64 rows x 32 B = 2 KB of codes per block step
MAX_BLOCK_N = 64  # rows of x per program; more rows take more programs along axis 1
DOT_DTYPES = (torch.float16, torch.bfloat16)
# Triton's interpreter (CPU tensors, the tests) mis-handles bf16: int8 -> bf16 casts give NaN and bf16 tl.dot
# garbage (probed with Triton 3.9), so there bf16 rows are declined and bf16 is checked on the device only.
INTERPRETED_DTYPES = (torch.float16,)


@triton.jit
def _int8_head_kernel(x_ptr, codes_ptr, scales_ptr, out_ptr, rows, vocab, hidden,
                      BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Axis 0: BLOCK_V vocabulary rows; axis 1: BLOCK_N rows of x.

    x [rows, hidden] fp16/bf16; codes [vocab, hidden] int8; scales [vocab, hidden / BLOCK_K] fp32;
    out [rows, vocab] fp32 = sum over blocks b of (x[:, b] . codes[v, b]) * scales[v, b].
    """
    v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    v_ok, n_ok = v < vocab, n < rows
    blocks = hidden // BLOCK_K
    acc = tl.full([BLOCK_N, BLOCK_V], 0.0, dtype=tl.float32)  # (tl.zeros is a jit function of tl.standard: triton_ops.py)
    for b in range(blocks):
        x = tl.load(x_ptr + n.to(tl.int64)[:, None] * hidden + b * BLOCK_K + k[None, :], mask=n_ok[:, None],
                    other=0.0)  # [N, 32]
        c = tl.load(codes_ptr + v.to(tl.int64)[:, None] * hidden + b * BLOCK_K + k[None, :], mask=v_ok[:, None],
                    other=0)  # [V, 32] int8
        partial = tl.dot(x, tl.trans(c.to(x.dtype)))  # [N, V] fp32: exact products, fp32 sums
        s = tl.load(scales_ptr + v.to(tl.int64) * blocks + b, mask=v_ok, other=0.0)  # [V]
        acc += partial * s[None, :]
    tl.store(out_ptr + n.to(tl.int64)[:, None] * vocab + v[None, :], acc, mask=n_ok[:, None] & v_ok[None, :])


def int8_head(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """x [n, K] fp16/bf16 @ W^T -> [n, vocab] fp32; None for inputs the kernel does not take (another dtype or
    device, K not a multiple of 32, non-contiguous tensors), so the caller runs its torch code."""
    dtypes = DOT_DTYPES if x.device.type == "cuda" else INTERPRETED_DTYPES
    if (x.dim() != 2 or x.dtype not in dtypes or codes.dtype != torch.int8 or scales.dtype != torch.float32
            or x.device != codes.device or scales.device != codes.device or x.shape[1] != codes.shape[1]
            or codes.shape[1] % BLOCK or scales.shape != (codes.shape[0], codes.shape[1] // BLOCK)
            or not (x.is_contiguous() and codes.is_contiguous() and scales.is_contiguous())):
        return None
    rows, hidden = x.shape
    vocab = codes.shape[0]
    out = torch.empty((rows, vocab), dtype=torch.float32, device=x.device)
    block_n = min(MAX_BLOCK_N, max(16, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(vocab, BLOCK_V), triton.cdiv(rows, block_n))
    _int8_head_kernel[grid](x, codes, scales, out, rows, vocab, hidden, BLOCK_N=block_n, BLOCK_V=BLOCK_V,
                            BLOCK_K=BLOCK)
    return out
