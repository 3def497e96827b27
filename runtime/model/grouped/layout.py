"""Projections in the grouped integer format: 4- or 8-bit codes with an fp16 scale and min per 16 or 32 weights.

Why: a GGUF file's projection blocks (Q4_0, Q4_1, Q8_0, Q5_x, the K-quants) are all integer codes times a scale plus a
min per 16 or 32 weights, so holding them in that form serves the file's own weights, where re-quantizing them to NF4
rounds a second time (+31.6% perplexity on the bundled SmolLM2 Q4_1, docs/weights.md). 16-bit checkpoints quantize to
the same form (4-bit codes, scale and min per 32: `quantize_grouped`). gguf_blocks.py converts a file's blocks.

Layout of W [out, in] (in a multiple of 32; oval_edge/kernels/grouped_kernels.c reads the same bytes):
  bits 4: codes [out, in / 2] uint8; in each 32-weight chunk c, byte 16c + i holds weight 32c + i (low nibble) and
          32c + i + 16 (high nibble): GGML's own nibble order;
  bits 8: codes [out, in] uint8;
  scales, mins [out, in / group] fp16; weight = scale * code + min in fp32.

The module holding such a weight and how it multiplies per device: linear.py.
"""

from __future__ import annotations

import torch

CHUNK = 32  # weights per nibble chunk along `in`
GROUPS = (16, 32)
BITS = (4, 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [out, in] integers in 0..2^bits-1 -> the stored uint8 codes (module doc's layout)."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    out, width = codes.shape
    chunks = codes.reshape(out, width // CHUNK, 2, 16)  # [out, chunks, low/high half, 16]
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(out, width // 2).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored uint8 codes -> codes [out, in] uint8 (pack_codes' inverse)."""
    if bits == 8:
        return packed
    out, half = packed.shape
    chunks = packed.reshape(out, half // 16, 1, 16)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(out, half * 2)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: stored codes [out, in * bits / 8], scales/mins [out, in / group] -> W [out, in] in `dtype`,
    scale * code + min formed in fp32."""
    q = unpack_codes(codes, bits).float()
    out, width = q.shape
    group = width // scales.shape[1]
    w = q.view(out, -1, group) * scales.float()[..., None] + mins.float()[..., None]
    return w.view(out, width).to(dtype)


def check_layout(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, in_features: int) -> int:
    """The group size the tensors imply, or ValueError naming what does not fit the layout."""
    if bits not in BITS:
        raise ValueError(f"grouped weights take {BITS}-bit codes, got {bits}")
    if in_features % CHUNK:
        raise ValueError(f"grouped weights need in_features % {CHUNK} == 0, got {in_features}")
    out = codes.shape[0]
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (out, in_features * bits // 8):
        raise ValueError(f"codes must be uint8 [{out}, {in_features * bits // 8}], got {codes.dtype} "
                         f"{list(codes.shape)}")
    if scales.shape != mins.shape or scales.dim() != 2 or scales.shape[0] != out or in_features % scales.shape[1]:
        raise ValueError(f"scales and mins must be [{out}, in / group], got {list(scales.shape)} and "
                         f"{list(mins.shape)}")
    group = in_features // scales.shape[1]
    if group not in GROUPS or scales.dtype != torch.float16 or mins.dtype != torch.float16:
        raise ValueError(f"groups of {GROUPS} weights with fp16 scales and mins, got {group} ({scales.dtype})")
    return group


def quantize_grouped(weight: torch.Tensor, bits: int = 4,
                     group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (codes, scales, mins) with `bits`-bit codes: per group, min = its minimum and scale =
    (max - min) / (2^bits - 1), both rounded to fp16 first and the codes rounded against those (so the fp16 rounding
    does not add to the codes' error)."""
    w = weight.float()
    out, width = w.shape
    blocks = w.view(out, width // group, group)
    low, high = blocks.amin(-1), blocks.amax(-1)
    mins = low.to(torch.float16)
    top = 2 ** bits - 1
    scales = ((high - mins.float()) / top).to(torch.float16)
    step = torch.where(scales.float() > 0, scales.float(), 1.0)[..., None]
    codes = torch.round((blocks - mins.float()[..., None]) / step).clamp_(0, top)
    return pack_codes(codes.view(out, width), bits), scales, mins
