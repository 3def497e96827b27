"""A GGUF tensor's quantized blocks -> the grouped integer format (layout.py), without a second rounding.

Every classic GGML type is integer codes times a scale plus a min per 16 or 32 weights:
  type   code bits  held as   group  scale         min              exact?
  Q4_0   4          4         32     d             -8 d             yes
  Q4_1   4          4         32     d             m                yes
  Q5_0   5          8         32     d             -16 d            yes
  Q5_1   5          8         32     d             m                yes
  Q8_0   8 (signed) 8         32     d             -128 d           yes (code + 128)
  Q2_K   2          4         16     d sc          -dmin m          within fp16 rounding of d sc and dmin m
  Q3_K   3 (signed) 4         16     d (sc - 32)   -4 d (sc - 32)   within fp16 rounding
  Q4_K   4          4         32     d sc          -dmin m          within fp16 rounding
  Q5_K   5          8         32     d sc          -dmin m          within fp16 rounding
  Q6_K   6 (signed) 8         16     d sc          -32 d sc         within fp16 rounding
(d, dmin, m: the block's fp16 values; sc, m of K-quants: 4-8-bit sub-block integers.) The code layouts follow the
`gguf` package's own dequantizers, and tests/test_gguf_blocks.py checks every type against them. Types outside the
table (IQ*, TQ*, MXFP4, 16/32-bit floats) have no such form: `convert` returns None and the loader quantizes their
dequantized weights to 8-bit codes per 32 (quantize_grouped), saying so in the startup report.
"""

from __future__ import annotations

import numpy as np

K_BLOCK = 256  # weights per K-quant super-block


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n] fp32 (the block's fp16 field)."""
    return np.ascontiguousarray(raw).view(np.float16).reshape(-1).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes of a 32-weight block in GGML's order (low nibbles: weights 0..15, high: 16..31) -> [n, 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[n, count / 8] bytes of little-endian bit flags -> [n, count] in 0/1."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[:, :count]


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit sub-block scales and mins -> ([n, 8], [n, 8]) as fp32."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


# Each decoder: blocks [n, type size] uint8 -> (codes [n, block] integers, scales [n, groups], mins [n, groups]).
def _q4_0(b):
    d = _f16(b[:, 0:2])[:, None]
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:20]), _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]


def _q5_0(b):
    d = _f16(b[:, 0:2])[:, None]
    return _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6], 32) << 4), d, -16 * d


def _q5_1(b):
    codes = _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8], 32) << 4)
    return codes, _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]


def _q8_0(b):
    d = _f16(b[:, 0:2])[:, None]
    return b[:, 2:34] ^ 0x80, d, -128 * d  # int8 q -> uint8 q + 128


def _q2_k(b):
    n = b.shape[0]
    sc, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82])[:, None], _f16(b[:, 82:84])[:, None]
    # weight 128 h + 32 s + j: bits 2s of byte 32 h + j
    codes = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    return codes.reshape(n, K_BLOCK), d * (sc & 0x0F), -dmin * (sc >> 4)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, packed = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])[:, None]
    low = (packed[:, 0:8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    scale = d * (((low & 0x0F) | ((high & 0x03) << 4)).astype(np.float32) - 32)
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    hbit = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    # weight = scale (ql - 4 (1 - hbit)): code ql + 4 hbit in 0..7 with min -4 scale
    codes = ql.reshape(n, K_BLOCK) + 4 * hbit.reshape(n, K_BLOCK)
    return codes, scale, -4 * scale


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scales_mins(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 1, 32)  # weight 64 p + 32 h + j: nibble h of byte 32 p + j
    codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return codes.reshape(n, K_BLOCK), d * sc, -dmin * mn


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scales_mins(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:176].reshape(n, 4, 1, 32)
    low = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, K_BLOCK)
    high = ((qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(n, K_BLOCK)
    return low | (high << 4), d * sc, -dmin * mn


def _q6_k(b):
    n = b.shape[0]
    ql, qh, sc = b[:, 0:128], b[:, 128:192], b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])[:, None]
    low = ((ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 2, 4, 32)
    high = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3)
    codes = (low | (high << 4)).reshape(n, K_BLOCK)  # weight = d sc (code - 32)
    scale = d * sc
    return codes, scale, -32 * scale


# name: (decoder, code bits held, weights per scale); block size and bytes come from the gguf package's table
DECODERS = {"Q4_0": (_q4_0, 4, 32), "Q4_1": (_q4_1, 4, 32), "Q5_0": (_q5_0, 8, 32), "Q5_1": (_q5_1, 8, 32),
            "Q8_0": (_q8_0, 8, 32), "Q2_K": (_q2_k, 4, 16), "Q3_K": (_q3_k, 4, 16), "Q4_K": (_q4_k, 4, 32),
            "Q5_K": (_q5_k, 8, 32), "Q6_K": (_q6_k, 8, 16)}
EXACT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the others: within fp16 rounding of the product scales
FALLBACK = (8, 32)  # (bits, group) a type outside DECODERS is re-quantized to (runtime/model/decoder_build.py)
SCALE_BYTES = 2  # each group's scale and min are fp16


def is_stored_projection(tensor) -> bool:
    """Whether a GGUFReader tensor is one of the decoder layers' projection matrices (not a norm, not global)."""
    return tensor.name.startswith("blk.") and len(tensor.shape) == 2 and "norm" not in tensor.name


def held_layout(type_name: str) -> tuple[int, int]:
    """(code bits, weights per scale) a projection stored as `type_name` is served in."""
    return DECODERS[type_name][1:] if type_name in DECODERS else FALLBACK


def held_bytes(rows: int, width: int, bits: int, group: int) -> tuple[int, int]:
    """(code bytes, scale + min bytes) of a [rows, width] weight in the grouped layout. No torch: plan counts with it."""
    return rows * width * bits // 8, rows * (width // group) * 2 * SCALE_BYTES


def convert(data: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """A 2-D GGUF tensor's raw rows [rows, bytes per row] uint8 of type `type_name` -> (codes, scales, mins, bits) in
    the grouped layout, or None for a type with no grouped form (module doc) or scales beyond fp16's range."""
    import torch
    from gguf import GGMLQuantizationType

    from .layout import pack_codes

    from gguf.constants import GGML_QUANT_SIZES

    if type_name not in DECODERS or data.ndim != 2:
        return None
    decoder, bits, group = DECODERS[type_name]
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rows = data.shape[0]
    width = data.shape[1] // size * block
    codes, scales, mins = decoder(np.ascontiguousarray(data).reshape(-1, size))
    scales = scales.reshape(rows, width // group)
    mins = mins.reshape(rows, width // group)
    finite = np.float32(np.finfo(np.float16).max)
    if not (np.abs(scales).max(initial=0) <= finite and np.abs(mins).max(initial=0) <= finite):
        return None
    packed = pack_codes(torch.from_numpy(codes.reshape(rows, width).astype(np.uint8)), bits)
    return (packed, torch.from_numpy(scales.astype(np.float16)), torch.from_numpy(mins.astype(np.float16)), bits)
