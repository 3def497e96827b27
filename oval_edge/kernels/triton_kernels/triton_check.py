"""The Triton kernels' startup self-check: each kernel against a plain-torch statement of what it computes, on a small
random case per pool dtype, on the device it will serve (gpu.py runs it once, before any graph capture).

The references here are written from the definitions (einsum and logsumexp, no tricks) rather than imported from
oval_edge.sparse: the sparse package imports the kernels, and the kernels must not import it back (no cycles). The
tests (tests/test_triton_kernels.py) check the kernels against the sparse package's own torch code.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from oval_edge.kv.int8 import dequantize_rows, quantize_rows
from oval_edge.kv.records.page_record import LayerRecords, decode, encode, gather

log = logging.getLogger(__name__)

SELF_CHECK_TOLERANCE = 1e-4  # fp32 queries and accumulation on both sides, inputs rounded to the pool dtype once
CHECKED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # pool dtypes the self-check covers
UNSCORED_BELOW = -1e38  # a page past a row's count scores -3e38


def oval_reference(q: torch.Tensor, records: LayerRecords, table: torch.Tensor, scale: float) -> torch.Tensor:
    """logsumexp over the page's tokens p and the group's heads g of scale * (q_g . mu + sum_r (q_g . B^T_r) R^T_rp).
    q [B, Hkv, G, D]; records of one layer (page_record.py, any format); table [B, Np] -> [B, Hkv, Np]."""
    mean, basis, coords = decode(*gather(records, table))  # [B, Hkv, Np, (r,) *] fp32
    logits = torch.einsum("bhgd,bhnrd,bhnrp->bhngp", q.float(), basis, coords) * scale
    logits = logits + torch.einsum("bhgd,bhnd->bhng", q.float(), mean)[..., None] * scale
    return logits.flatten(3).logsumexp(-1)


def quest_reference(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """logsumexp over the group of scale * sum_d max(q_d kmax_d, q_d kmin_d). kmin, kmax [pages, Hkv, D]."""
    lo, hi = kmin[table].float()[:, :, :, None], kmax[table].float()[:, :, :, None]  # [B, Np, Hkv, 1, D]
    qe = q.float()[:, None]  # [B, 1, Hkv, G, D]
    bound = torch.maximum(qe * hi, qe * lo).sum(-1)  # [B, Np, Hkv, G]
    return (bound * scale).logsumexp(-1).transpose(1, 2)


def attend_reference(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, flat: torch.Tensor,
                     valid: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax over the valid slots of scale * q . k, times v. q [B, Hq, D]; flat, valid [B, Hkv, T] -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = flat.shape[1]
    k, v = k_rows[flat].float(), v_rows[flat].float()  # [B, Hkv, T, D]
    logits = torch.einsum("bhgd,bhtd->bhgt", q.float().view(b, hkv, hq // hkv, d), k) * scale
    weights = logits.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1)
    return torch.einsum("bhgt,bhtd->bhgd", weights, v).reshape(b, hq, d)


def self_check(kernels, device: torch.device) -> str | None:
    """None when every kernel agrees with its reference (with counts, limits, one and two splits); else what
    disagreed. kernels: gpu.TritonKernels."""
    gen = torch.Generator().manual_seed(0)
    b, hkv, group, dim, rank, page, pages, slots = 2, 2, 3, 32, 3, 16, 6, 40

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = rand(b, hkv, group, dim)
    table = torch.tensor([[4, 1, 3], [0, 5, 2]], device=device)
    counts = torch.tensor([2, 3], device=device)
    flat = torch.randint(0, pages * hkv * page, (b, hkv, slots), generator=gen).to(device)
    valid = (torch.rand(b, hkv, slots, generator=gen) < 0.7).to(device)
    valid[..., 0] = True
    limits = torch.tensor([25, slots], device=device)
    bounded = valid & (torch.arange(slots, device=device) < limits[:, None, None])
    for dtype in CHECKED_DTYPES:
        if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            continue
        for fmt in ("float", "int8", "int4") if dtype == torch.float32 else ("float",):
            stored = encode(rand(hkv, pages, dim), rand(hkv, pages, rank, dim), rand(hkv, pages, rank, page), fmt,
                            dtype)
            records = LayerRecords(stored["mean"], stored["basis"], stored["coords"], stored.get("scales"))
            want = oval_reference(q, records, table, 0.125)
            got = kernels.oval_scores(q, records, table, 0.125, counts)
            if got is None or not _close(got[1], want[1]) or not _close(got[0, :, :2], want[0, :, :2]) \
                    or not bool((got[0, :, 2] < UNSCORED_BELOW).all()):
                return f"oval_scores {fmt} {dtype}"
        kmin, kmax = rand(pages, hkv, dim, dtype=dtype), rand(pages, hkv, dim, dtype=dtype)
        got = kernels.quest_scores(q, kmin, kmax, table, 0.125)
        if got is None or not _close(got, quest_reference(q, kmin, kmax, table, 0.125)):
            return f"quest_scores {dtype}"
        k_rows, v_rows = rand(pages * hkv * page, dim, dtype=dtype), rand(pages * hkv * page, dim, dtype=dtype)
        want = attend_reference(q.view(b, -1, dim), k_rows, v_rows, flat, bounded, 0.125)
        for splits in (1, 2):
            got = kernels.attend_slots(q.view(b, -1, dim), k_rows, v_rows, flat, valid, 0.125, limits, splits)
            if got is None or not _close(got, want):
                return f"attend_slots {dtype} splits={splits}"
    # int8 K/V rows (kv_dtype='int8'): codes and per-row scales, against the reference on their dequantized rows
    (k_codes, k_scales), (v_codes, v_scales) = (quantize_rows(rand(pages * hkv * page, dim)) for _ in range(2))
    want = attend_reference(q.view(b, -1, dim), dequantize_rows(k_codes, k_scales), dequantize_rows(v_codes, v_scales),
                            flat, bounded, 0.125)
    for splits in (1, 2):
        got = kernels.attend_slots(q.view(b, -1, dim), k_codes, v_codes, flat, valid, 0.125, limits, splits,
                                   scales=(k_scales, v_scales))
        if got is None or not _close(got, want):
            return f"attend_slots int8 splits={splits}"
    return rope_write_check(kernels, device, gen)


def rope_write_check(kernels, device: torch.device, gen: torch.Generator) -> str | None:
    """None when rope_write rotates 3 query and 1 key heads as x cos + rotate_half(x) sin and stores the key and
    value at their slots (fp32 pool rows)."""
    n, heads, kv_heads, dim = 2, 3, 1, 16
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(device)
    angle = torch.rand(n, 1, dim // 2, generator=gen).to(device) * 6.0
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    signed = torch.cat((-sin[..., : dim // 2], sin[..., dim // 2:]), -1)
    heads_in = qkv.view(n, heads + 2 * kv_heads, dim)
    x = heads_in[:, : heads + kv_heads]
    rotated = x * cos + torch.cat((-x[..., dim // 2:], x[..., : dim // 2]), -1) * sin
    slots = torch.tensor([[5], [2]], device=device)
    k_rows, v_rows = torch.zeros(8, dim, device=device), torch.zeros(8, dim, device=device)
    q = kernels.rope_write(qkv, cos.contiguous(), signed.contiguous(), heads, kv_heads, slots, k_rows, v_rows)
    if q is None or not _close(q, rotated[:, :heads]) or not _close(k_rows[slots[:, 0]], rotated[:, heads]) \
            or not _close(v_rows[slots[:, 0]], heads_in[:, heads + kv_heads]) or bool(k_rows[0].any()):
        return "rope_write"
    return None


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.allclose(got.float(), want.float(), rtol=SELF_CHECK_TOLERANCE, atol=SELF_CHECK_TOLERANCE))


def int8_head_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ (codes [V, K] * scales [V, K/32] per block of 32)^T -> [n, V] fp32, summed in fp64 (no TF32
    whatever torch.backends says)."""
    weight = (codes.double().view(codes.shape[0], -1, 32) * scales.double()[..., None]).view(codes.shape)
    return (x.double() @ weight.T).float()


def int8_head_check(module, device: torch.device) -> str | None:
    """None when the int8 head kernel (triton_int8_head.py) agrees with its reference on 1, 5 and 40 rows, a
    vocabulary that is not a multiple of its row block, and both 16-bit activation dtypes on CUDA (fp16 only in
    the interpreter); else what disagreed."""
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = 200, 96
    codes = torch.randint(-127, 128, (vocab, hidden), generator=gen, dtype=torch.int8).to(device)
    scales = (torch.rand(vocab, hidden // 32, generator=gen) / 64).to(device)
    for dtype in module.DOT_DTYPES if device.type == "cuda" else module.INTERPRETED_DTYPES:
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            continue
        for rows in (1, 5, 40):
            x = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
            got = module.int8_head(x, codes, scales)
            if got is None or got.dtype != torch.float32 or not _close(got, int8_head_reference(x, codes, scales)):
                return f"int8_head {dtype} rows={rows}"
    return None


GROUPED_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # x max(1, |ref|): output rounding


def grouped_weight_reference(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int) -> torch.Tensor:
    """The grouped format's W [out, K] in fp64 from its definition (runtime/model/grouped/layout.py's layout, written
    out so the check imports nothing of the runtime): a 4-bit chunk's 16 bytes hold its weights 0..15 in their low
    nibbles and 16..31 in their high ones; scales, mins [out, K / group]."""
    rows = codes.shape[0]
    if bits == 4:
        chunks = codes.view(rows, -1, 16)  # [out, K / 32, 16] bytes
        codes = torch.stack((chunks & 0x0F, chunks >> 4), dim=2).view(rows, -1)  # [out, K]: low run, high run
    per_group = codes.double().view(rows, scales.shape[1], -1)  # [out, K / group, group]
    return torch.addcmul(mins.double()[..., None], per_group, scales.double()[..., None]).view(rows, -1)


def grouped_linear_check(module, device: torch.device) -> str | None:
    """None when the grouped-format kernel (triton_grouped.py) agrees with x W^T + bias on 1 and 5 rows, 4-bit codes
    in groups of 32 and 8-bit codes in groups of 16, 40 output rows (not a multiple of its row block), in every
    activation dtype it takes there (fp32 and fp16 in the interpreter); else what disagreed."""
    gen = torch.Generator().manual_seed(0)
    out_features, hidden = 40, 96
    bias = torch.randn(out_features, generator=gen).to(device)
    for bits, group in ((4, 32), (8, 16)):
        codes = torch.randint(0, 256, (out_features, hidden * bits // 8), generator=gen, dtype=torch.uint8).to(device)
        scales = (torch.rand(out_features, hidden // group, generator=gen) / 2 ** bits).half().to(device)
        mins = (-torch.rand(out_features, hidden // group, generator=gen)).half().to(device)
        weight = grouped_weight_reference(codes, scales, mins, bits)
        for dtype in module.DTYPES if device.type == "cuda" else module.INTERPRETED_DTYPES:
            if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
                continue
            for rows in (1, 5):
                x = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
                got = module.grouped_linear(x, codes, scales, mins, bias, bits)
                want = x.double() @ weight.T + bias.double()
                limit = GROUPED_TOLERANCE[dtype] * max(1.0, float(want.abs().max()))
                if got is None or got.dtype != dtype or float((got.double() - want).abs().max()) > limit:
                    return f"grouped_linear {bits}-bit group {group} {dtype} rows={rows}"
    return None


def delta_step_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         states: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated delta step from its definition in fp64 (triton_delta.py's docstring; written out so the check
    imports nothing of the runtime): (out [B, Hv, dv], the states after it). Rows have distinct slots here."""
    heads = v.shape[1] // q.shape[1]
    q, k = (torch.nn.functional.normalize(t.double(), dim=-1, eps=0.0).repeat_interleave(heads, 1) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    decay = g.double().exp()[..., None, None]  # [B, Hv, 1, 1]
    s = states.double()[slots] * decay  # [B, Hv, dk, dv]
    delta = beta.double()[..., None] * (v.double() - torch.einsum("bhk,bhkv->bhv", k, s))
    s = s + k[..., None] * delta[..., None, :]
    after = states.double().clone()
    after[slots] = s
    return torch.einsum("bhk,bhkv->bhv", q, s), after


def delta_step_check(module, device: torch.device) -> str | None:
    """None when the gated delta step kernel (triton_delta.py) agrees with its reference (output and the states it
    wrote in place) for Hv = Hk and Hv = 2 Hk in fp32 and a 16-bit dtype; else what disagreed."""
    gen = torch.Generator().manual_seed(0)
    for key_heads, value_heads, dtype in ((2, 2, torch.float32), (2, 4, torch.float16)):
        rows, dk, dv = 3, 32, 32
        rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
        q, k, v, beta = rand(rows, key_heads, dk), rand(rows, key_heads, dk), rand(rows, value_heads, dv), \
            rand(rows, value_heads).sigmoid()
        g = -torch.rand(rows, value_heads, generator=gen).to(device=device, dtype=dtype)
        states = torch.randn(5, value_heads, dk, dv, generator=gen).to(device)
        slots = torch.tensor([3, 0, 1], device=device)
        want, after = delta_step_reference(q, k, v, g, beta, states, slots)
        got = module.gated_delta_step(q, k, v, g, beta, states, slots)
        tolerance = 1e-4 if dtype == torch.float32 else 5e-3
        if got is None or not torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance) \
                or not torch.allclose(states.double(), after, atol=1e-4, rtol=1e-4):
            return f"gated_delta_step {dtype} Hk={key_heads} Hv={value_heads}"
    return None
