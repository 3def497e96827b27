"""The oval page record in the pool: how it is laid out, quantized when a page seals, and read back ([R-page-score]).

A record of one (layer, KV head, page) is the page's key mean mu [D], its basis B^T [r, D] (r orthonormal rows)
and the centred keys' coordinates R^T [r, P], so that a key k_t ~= mu + B R_t and q . k_t ~= mu . q + R_t . (B^T q).

Layout, head-major per layer (a sequence's pages of one KV head are contiguous blocks; see pool.py):
    mean    [L, Hkv, pages, D]
    basis   [L, Hkv, pages, r, D]      (int4: [.., r, D / 2 + D / 8], see below)
    coords  [L, Hkv, pages, r, P]      (int4: [.., r * P / 2 + f * P / 8], see below)
    scales  [L, Hkv, pages, 1 + r]     fp16, quantized formats only: the mean's, then per rank i the product of
                                       basis row i's and coordinate row i's. Why one product: the score reads
                                       them only as (b_i . q) * R_i,t, so a separate pair would be 2r bytes that
                                       say nothing more. Why fp16: its 11-bit mantissa is far finer than the
                                       levels it scales, and its 18 bytes (r = 8) pay for the coordinates' fifth
                                       bits below.
Formats (geometry.RECORD_FORMATS):
    float  in the pool's dtype; no scales.
    int8   symmetric int8, x ~= s * q with s = max|x| / 127 per row (the mean, each basis row, each coordinate row).
    int4   the mean int8. Basis rows in symmetric 5-bit levels (s = max|x| / 15, q in [-15, 15]) stored as q + 16,
           a row being its D / 2 bytes of low nibbles (element 2j in the low nibble of byte j, 2j + 1 in its
           high one) then D / 8 bytes of fifth bits (bit i % 8 of byte i / 8 is element i's).
           Coordinates: the first f = record_layout.coord_fifth_ranks(r) ranks (three quarters) in 5-bit levels, the
           rest in 4-bit ones (s = max|x| / 7, q in [-7, 7], stored as q + 8). The record's coords bytes are the
           low nibbles of all r rows, rank-major, packed as the basis rows' (r * P / 2 bytes; a 5-bit row's nibble
           is that of q + 16), then the fifth bits of the first f rows (P / 8 bytes each, bit t % 8 of byte t / 8
           for token t). So every row widens as a 4-bit one (nibble - 8), and a 5-bit row adds 16 * bit - 8.
           Why these bits: measured on SmolLM2 (docs/oval-index.md), a basis bit moves the scores more than a
           coordinate bit (a basis row's error shifts every token of the page alike), so the basis gets five
           everywhere, and the coordinates get a fifth where the singular values are large; the all-4-bit
           record was 2.4-3.1% above the float record in KL. The mean stays int8 (its error moves every token's
           logit; int4 and 5-bit means measured +3%).
           The basis rows are stored rotated, b H with H the orthonormal Hadamard matrix of the head dim
           (`rotation`), so b . q = (b H) . (H q): a row's absmax is set by a few large channels of the keys,
           and at few levels that leaves the rest coarse; the rotation spreads every channel over all of them.
           The kernels rotate the query once per step (H is its own inverse).
The format is read off the basis dtype (record_format), so kernels and scorers need no extra argument.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from oval_edge.record_layout import coord_fifth_ranks, int4_coord_bytes, int5_row_bytes

from ..huge_pages import pool_tensor

RECORD_NAMES = ("mean", "basis", "coords", "scales")
INT8_LEVELS, INT4_LEVELS, INT5_LEVELS = 127, 7, 15


class LayerRecords(NamedTuple):
    """One layer's records (views, no copy): mean [Hkv, pages, D], basis, coords, scales (None for 'float')."""

    mean: torch.Tensor
    basis: torch.Tensor
    coords: torch.Tensor
    scales: torch.Tensor | None


def allocate_records(geometry, num_pages: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The pool's oval record tensors for `num_pages` pages (allocated once, written in place at seal time)."""
    g = geometry
    lead = (g.paged_layers, g.kv_heads, num_pages)
    if g.record == "float":
        return {"mean": pool_tensor(lead + (g.head_dim,), dtype, device),
                "basis": pool_tensor(lead + (g.rank, g.head_dim), dtype, device),
                "coords": pool_tensor(lead + (g.rank, g.page_size), dtype, device)}
    if g.record == "int8":
        basis_shape, coords_shape, packed = (g.rank, g.head_dim), (g.rank, g.page_size), torch.int8
    else:
        basis_shape, coords_shape = (g.rank, int5_row_bytes(g.head_dim)), (int4_coord_bytes(g.rank, g.page_size),)
        packed = torch.uint8
    return {"mean": pool_tensor(lead + (g.head_dim,), torch.int8, device),
            "basis": pool_tensor(lead + basis_shape, packed, device),
            "coords": pool_tensor(lead + coords_shape, packed, device),
            "scales": pool_tensor(lead + (1 + g.rank,), torch.float16, device)}


def record_page_size(basis: torch.Tensor, coords: torch.Tensor) -> int:
    """Tokens per page of records stored as `basis`, `coords` (any leading shape): the coordinates' last axis, or
    for int4 what int4_coord_bytes inverts to."""
    if record_format(basis) != "int4":
        return coords.shape[-1]
    rank = basis.shape[-2]
    return coords.shape[-1] * 8 // (4 * rank + coord_fifth_ranks(rank))


def record_format(basis: torch.Tensor) -> str:
    if basis.dtype == torch.int8:
        return "int8"
    return "int4" if basis.dtype == torch.uint8 else "float"


def layer_records(summaries: dict[str, torch.Tensor], layer: int) -> LayerRecords:
    scales = summaries.get("scales")
    return LayerRecords(summaries["mean"][layer], summaries["basis"][layer], summaries["coords"][layer],
                        scales[layer] if scales is not None else None)


def rotation_blocks(dim: int) -> list[int]:
    """The Hadamard blocks of a head dim: its binary decomposition, largest first (96 -> [64, 32]); the C kernels
    (score_kernels.c) transform the query block by block the same way."""
    return [1 << bit for bit in reversed(range(dim.bit_length())) if dim >> bit & 1]


def rotation(dim: int, device=None) -> torch.Tensor:
    """H [D, D] fp32: block-diagonal orthonormal Sylvester-Hadamard matrices over rotation_blocks(dim). Symmetric
    and orthogonal, so H is its own inverse."""
    out = torch.zeros(dim, dim, device=device)
    start = 0
    for size in rotation_blocks(dim):
        block = torch.ones(1, 1, device=device)
        while block.shape[0] < size:
            block = torch.cat((torch.cat((block, block), 1), torch.cat((block, -block), 1)), 0)
        out[start : start + size, start : start + size] = block / size**0.5
        start += size
    return out


class Rotations:
    """H = rotation(dim) per (dim, device, dtype), each built once. Why: the matrix is ~30 small kernels to build
    (a cat per doubling, a slice copy per block); a decode step that rebuilt it in every sparse layer spent 784 of
    its ~1,900 launches there (SmolLM2, 28 sparse layers). The static step's owner holds one of these and builds
    what its steps read before any CUDA graph capture, so a step only reads the tensor. It keeps the other device
    constants of the int4 record's readers too (`constant`: PackedScorer's level table), one per device for all of
    the owner's steps."""

    def __init__(self) -> None:
        self._built: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}
        self._constants: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, dim: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """H [dim, dim] on `device` in `dtype` (fp32 unless asked): built on the first call for the key."""
        key = (dim, torch.device(device), dtype)
        if key not in self._built:
            self._built[key] = rotation(dim, device).to(dtype)
        return self._built[key]

    def constant(self, name: str, device, build: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
        """The tensor `build(device)` made on the first call for (name, device), the same one after."""
        key = (name, torch.device(device))
        if key not in self._constants:
            self._constants[key] = build(key[1])
        return self._constants[key]


def _quantize(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of the last axis: x [..., n] -> (q [..., n] int8 in [-levels, levels], s [...])."""
    scale = x.abs().amax(dim=-1).clamp_min(1e-30) / levels
    return torch.round(x / scale[..., None]).clamp_(-levels, levels).to(torch.int8), scale


def _pair_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., n] int16 in [0, 15], n even -> [..., n / 2]: element 2j in the low nibble of byte j, 2j + 1 in its high."""
    pairs = nibbles.view(*nibbles.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _split_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., m] int16 bytes -> [..., 2m] in [0, 15] (the inverse of _pair_nibbles)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[..., n] int16 in {0, 1}, n a multiple of 8 -> [..., n / 8]: bit i % 8 of byte i / 8 is element i."""
    shifts = torch.arange(8, dtype=torch.int16, device=bits.device)
    return (bits.view(*bits.shape[:-1], -1, 8) << shifts).sum(-1)  # distinct bits: the sum is their OR


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """[..., m] int16 bytes -> [..., 8m] in {0, 1} (the inverse of _pack_bits)."""
    shifts = torch.arange(8, dtype=torch.int16, device=packed.device)
    return ((packed[..., None] >> shifts) & 1).reshape(*packed.shape[:-1], -1)


def _pack_int5(q: torch.Tensor) -> torch.Tensor:
    """q [..., n] int8 in [-15, 15], n a multiple of 8 -> [..., n / 2 + n / 8] uint8: the low nibbles of q + 16 paired
    by _pair_nibbles, then its fifth bits, bit i % 8 of byte i / 8 for element i."""
    biased = q.to(torch.int16) + 16
    return torch.cat((_pair_nibbles(biased & 15), _pack_bits(biased >> 4)), dim=-1).to(torch.uint8)


def _unpack_int5(packed: torch.Tensor) -> torch.Tensor:
    """[..., n / 2 + n / 8] uint8 -> [..., n] float32 in [-15, 15] (the inverse of _pack_int5)."""
    n = packed.shape[-1] * 8 // 5
    wide = packed.to(torch.int16)
    return (_split_nibbles(wide[..., : n // 2]) + (_unpack_bits(wide[..., n // 2:]) << 4) - 16).float()


def _pack_coords(q5: torch.Tensor, q4: torch.Tensor) -> torch.Tensor:
    """An int4 record's coordinates: q5 [..., f, P] in [-15, 15], q4 [..., r - f, P] in [-7, 7] ->
    [..., r * P / 2 + f * P / 8] uint8 (the layout in this module's docstring)."""
    biased5, biased4 = q5.to(torch.int16) + 16, q4.to(torch.int16) + 8
    nibbles = torch.cat((biased5 & 15, biased4), dim=-2).flatten(-2)  # [..., r * P], rank-major
    return torch.cat((_pair_nibbles(nibbles), _pack_bits((biased5 >> 4).flatten(-2))), dim=-1).to(torch.uint8)


def _unpack_coords(packed: torch.Tensor, rank: int, page: int) -> torch.Tensor:
    """[..., r * P / 2 + f * P / 8] uint8 -> levels [..., r, P] float32 (the inverse of _pack_coords)."""
    fifth = coord_fifth_ranks(rank)
    wide = packed.to(torch.int16)
    levels = _split_nibbles(wide[..., : rank * page // 2]).view(*packed.shape[:-1], rank, page) - 8
    bits = _unpack_bits(wide[..., rank * page // 2:]).view(*packed.shape[:-1], fifth, page)
    return torch.cat((levels[..., :fifth, :] + 16 * bits - 8, levels[..., fifth:, :]), dim=-2).float()


def encode(mean: torch.Tensor, basis_t: torch.Tensor, coords_t: torch.Tensor, fmt: str, dtype: torch.dtype) -> dict:
    """Float records -> stored tensors. mean [..., D], basis_t [..., r, D], coords_t [..., r, P] fp32."""
    if fmt == "float":
        return {"mean": mean.to(dtype), "basis": basis_t.to(dtype), "coords": coords_t.to(dtype)}
    q_mean, s_mean = _quantize(mean, INT8_LEVELS)
    if fmt == "int4":
        basis_t = basis_t.float() @ rotation(basis_t.shape[-1], basis_t.device)  # rows b -> b H
        fifth = coord_fifth_ranks(basis_t.shape[-2])
        q_basis, s_basis = _quantize(basis_t, INT5_LEVELS)
        q5, s5 = _quantize(coords_t[..., :fifth, :], INT5_LEVELS)
        q4, s4 = _quantize(coords_t[..., fifth:, :], INT4_LEVELS)
        q_basis, q_coords, s_coords = _pack_int5(q_basis), _pack_coords(q5, q4), torch.cat((s5, s4), dim=-1)
    else:
        q_basis, s_basis = _quantize(basis_t, INT8_LEVELS)
        q_coords, s_coords = _quantize(coords_t, INT8_LEVELS)
    scales = torch.cat((s_mean[..., None], s_basis * s_coords), dim=-1).float()
    return {"mean": q_mean, "basis": q_basis, "coords": q_coords,
            "scales": scales.clamp(max=torch.finfo(torch.float16).max).to(torch.float16)}


def decode(mean: torch.Tensor, basis: torch.Tensor, coords: torch.Tensor,
           scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored records (any leading shape) -> fp32 (mean [..., D], basis_t [..., r, D], coords_t [..., r, P]).
    Quantized records keep one scale per rank (the product), so basis_t rows carry it and coords_t are levels:
    basis_t^T coords_t and the scores are the record's; the rows alone are no longer orthonormal."""
    fmt = record_format(basis)
    if fmt == "float":
        return mean.float(), basis.float(), coords.float()
    if fmt == "int4":
        basis_q, coords_q = _unpack_int5(basis), _unpack_coords(coords, basis.shape[-2], record_page_size(basis, coords))
    else:
        basis_q, coords_q = basis.float(), coords.float()
    scales = scales.float()
    basis_t = basis_q * scales[..., 1:, None]  # the rank's folded scale goes with the basis row (either would do)
    if fmt == "int4":  # stored rotated: (b H) H = b
        basis_t = basis_t @ rotation(basis_t.shape[-1], basis_t.device)
    return mean.float() * scales[..., :1], basis_t, coords_q


def store(summaries: dict[str, torch.Tensor], pages: torch.Tensor, stored: dict[str, torch.Tensor]) -> None:
    """Write encoded records of `pages` [n] (the third axis of every record tensor) in place."""
    for name, value in stored.items():
        summaries[name].index_copy_(2, pages, value)


def gather(records: LayerRecords, page_table: torch.Tensor) -> LayerRecords:
    """One layer's records of the pages page_table [B, Np] lists -> [B, Hkv, Np, ...] each (contiguous copies)."""
    flat = page_table.reshape(-1)

    def pick(table: torch.Tensor | None) -> torch.Tensor | None:
        if table is None:
            return None
        picked = table.index_select(1, flat)  # [Hkv, B*Np, ...]: contiguous block copies
        return picked.view(table.shape[0], *page_table.shape, *table.shape[2:]).movedim(0, 1)

    return LayerRecords(*(pick(t) for t in records))
