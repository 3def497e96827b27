"""The CPU kernels' self-check: both kernels against the torch code they replace, in the build's child process.

Run as `python -m oval_edge.kernels.cpu_check LIBRARY` by cpu_build.built_library: the torch reference touches
code (einsum, softmax, ...) that decoding with the kernels never runs, and those library pages would stay resident
in the server (~7 MiB measured), so the check never runs in the serving process.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from oval_edge.config import OvalConfig
from oval_edge.kv.int8 import dequantize_rows, quantize_rows
from oval_edge.kv.records.page_record import LayerRecords, encode
from oval_edge.kv.records.group_record import GROUP_NAMES, GROUP_SLOT, stored_group_record
from oval_edge.sparse.grouped import grouped_reference
from oval_edge.sparse.scoring import record_scores
from oval_edge.sparse.selection import DecodePlan

from .cpu import ELEMENT_SUFFIX, NativeKernels

SELF_CHECK_TOLERANCE = 1e-4


def random_records(gen: torch.Generator, hkv: int, pages: int, rank: int, dim: int, page_size: int, fmt: str,
                   dtype: torch.dtype) -> LayerRecords:
    """One layer's records of random pages, stored in `fmt` (float ones in `dtype`) as the pool holds them."""
    basis = torch.linalg.qr(torch.randn(hkv, pages, dim, rank, generator=gen)).Q.transpose(-1, -2)  # [Hkv, n, r, D]
    stored = encode(torch.randn(hkv, pages, dim, generator=gen), basis,
                    4 * torch.randn(hkv, pages, rank, page_size, generator=gen), fmt, dtype)
    return LayerRecords(stored["mean"], stored["basis"], stored["coords"], stored.get("scales"))


def self_check(kernels: NativeKernels) -> str | None:
    """Both kernels against the torch code they replace, on a small random case in each pool dtype."""
    gen = torch.Generator().manual_seed(0)
    # page_size 32: the shape every vector body takes (score_int4_avx512.h needs multiples of 32)
    hkv, group, dim, rank, page_size, pages = 2, 3, 64, 4, 32, 6
    q = torch.randn(2, hkv, group, dim, generator=gen)
    table = torch.tensor([[4, 1, 3], [0, 5, 2]])
    flat = torch.randint(0, pages * hkv * page_size, (2, hkv, 40), generator=gen)
    valid = torch.rand(2, hkv, 40, generator=gen) < 0.7
    for fmt in ("float", "int8", "int4"):  # every record format, each kernel instantiation it has
        for dtype in ELEMENT_SUFFIX if fmt == "float" else (torch.float32,):
            records = random_records(gen, hkv, pages, rank, dim, page_size, fmt, dtype)
            want = record_scores(q, records, table, 0.125)
            got = kernels.oval_scores(q, records, table, 0.125)
            if got is None or not torch.allclose(got, want, rtol=SELF_CHECK_TOLERANCE, atol=SELF_CHECK_TOLERANCE):
                return f"oval_scores {fmt} {dtype}"
            counted = kernels.oval_scores(q, records, table, 0.125, counts=torch.tensor([2, 3]))
            if counted is None or not (torch.equal(counted[0, :, :2], got[0, :, :2])
                                       and torch.equal(counted[1], got[1]) and bool((counted[0, :, 2] < -1e38).all())):
                return f"oval_scores with counts {fmt} {dtype}"
    for dtype in (*ELEMENT_SUFFIX, torch.int8):  # int8: codes + a scale per row (kv_dtype='int8', kv/int8.py)
        k_rows, v_rows, scales = _kv_rows(gen, pages * hkv * page_size, dim, dtype)
        k, v = (rows[flat].float() if scales is None else dequantize_rows(rows[flat], s[flat])  # [B, Hkv, T, D]
                for rows, s in zip((k_rows, v_rows), scales or (None, None)))
        logits = torch.einsum("bhgd,bhtd->bhgt", q, k) * 0.125
        weights = logits.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1)
        want = torch.einsum("bhgt,bhtd->bhgd", weights, v).reshape(2, hkv * group, dim)
        got = kernels.attend_slots(q.reshape(2, hkv * group, dim), k_rows, v_rows, flat, valid, 0.125, scales=scales)
        if got is None or not torch.allclose(got, want, rtol=SELF_CHECK_TOLERANCE, atol=SELF_CHECK_TOLERANCE):
            return f"attend_slots {dtype}"
        limits = torch.tensor([25, 40])
        bounded = valid & (torch.arange(40) < limits[:, None, None])
        want = kernels.attend_slots(q.reshape(2, hkv * group, dim), k_rows, v_rows, flat, bounded, 0.125,
                                    scales=scales)
        got = kernels.attend_slots(q.reshape(2, hkv * group, dim), k_rows, v_rows, flat, valid, 0.125, limits=limits,
                                   scales=scales)
        if got is None or want is None or not torch.allclose(got, want, rtol=SELF_CHECK_TOLERANCE, atol=1e-6):
            return f"attend_slots with limits {dtype}"
    problem = _check_selection(kernels, gen)
    if problem:
        return problem
    x, weight = torch.randn(3, 96, generator=gen), torch.randn(96, generator=gen)
    got = kernels.rms_norm(x, weight, 1e-5)
    if got is None or not torch.allclose(got, torch.nn.functional.rms_norm(x, (96,), weight, 1e-5), rtol=1e-5,
                                         atol=1e-6):
        return "rms_norm"
    return (_check_head(kernels, gen) or _check_4bit(kernels, gen) or _check_grouped(kernels, gen)
            or _check_grouped_weights(kernels, gen))


def _kv_rows(gen: torch.Generator, rows: int, dim: int, dtype: torch.dtype):
    """Random K, V rows [rows, D] stored in dtype, and for int8 their (k, v) scales [rows] (else None)."""
    k, v = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    if dtype != torch.int8:
        return k.to(dtype), v.to(dtype), None
    (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
    return k, v, (k_scale, v_scale)


def _check_head(kernels: NativeKernels, gen: torch.Generator) -> str | None:
    """int8_head against the dequantized matmul: 9 rows (a full tile of 8 and one left over), 3 panels of 32."""
    panels, hidden = 3, 64
    codes = torch.randint(-127, 128, (panels, hidden, 32), generator=gen, dtype=torch.int8)
    scales = torch.rand(panels, hidden // 32, 32, generator=gen) / 100
    weight = (codes.float().view(panels, hidden // 32, 32, 32) * scales[:, :, None]).view(panels, hidden, 32)
    x = torch.randn(9, hidden, generator=gen)
    want = x @ weight.permute(1, 0, 2).reshape(hidden, panels * 32)
    got = kernels.int8_head(x, codes, scales)
    if got is None or not torch.allclose(got, want, rtol=SELF_CHECK_TOLERANCE, atol=SELF_CHECK_TOLERANCE):
        return "int8_head"
    ids = torch.tensor([95, 0, 40, 40])
    rows = kernels.int8_rows(codes, scales, panels * 32, ids)
    if rows is None or not torch.allclose(rows, weight[ids // 32, :, ids % 32], rtol=0, atol=1e-7):
        return "int8_rows"
    return None


def _check_4bit(kernels: NativeKernels, gen: torch.Generator) -> str | None:
    """gemv_4bit against the dequantized matmul in bitsandbytes' layout: 5 rows (a tile of 4 and one), with a bias;
    both round to bf16, so they may differ by one bf16 step where the fp32 sums round to either side."""
    out_features, k, blocksize = 24, 128, 64
    codes = torch.randint(0, 256, (out_features * k // 2,), generator=gen, dtype=torch.uint8)
    absmax, table = torch.rand(out_features * k // blocksize, generator=gen), torch.randn(16, generator=gen)
    nibbles = torch.stack([codes >> 4, codes & 15], -1).reshape(-1).long()  # element 2i: the high nibble of byte i
    weight = (table[nibbles].view(-1, blocksize) * absmax[:, None]).view(out_features, k)
    x, bias = torch.randn(5, k, generator=gen), torch.randn(out_features, generator=gen).bfloat16().float()
    want = (x.bfloat16().float() @ weight.T).bfloat16().float() + bias
    got = kernels.gemv_4bit(x, codes, absmax, table, bias, out_features, blocksize)
    if got is None or not torch.allclose(got, want, rtol=2 ** -7, atol=1e-6):
        return "gemv_4bit"
    return None


def _check_grouped_weights(kernels: NativeKernels, gen: torch.Generator) -> str | None:
    """gemv_grouped and dequantize_grouped against the reference dequantization (runtime/model/grouped/layout.py's
    layout, written out here so the check imports nothing of the runtime): 4-bit codes in groups of 32 and 8-bit
    codes in groups of 16, 5 rows (a tile of 4 and one), with a bias."""
    out_features, k = 24, 128
    for bits, group in ((4, 32), (8, 16)):
        q = torch.randint(0, 2 ** bits, (out_features, k), generator=gen, dtype=torch.uint8)
        halves = q.view(out_features, k // 32, 2, 16)
        codes = q if bits == 8 else (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out_features, k // 2)
        scales = (torch.rand(out_features, k // group, generator=gen) / 8).half()
        mins = (-torch.rand(out_features, k // group, generator=gen)).half()
        weight = (q.float().view(out_features, -1, group) * scales.float()[..., None] + mins.float()[..., None])
        weight = weight.view(out_features, k)
        x, bias = torch.randn(5, k, generator=gen), torch.randn(out_features, generator=gen)
        got = kernels.gemv_grouped(x, codes.contiguous(), scales, mins, bias, bits)
        rounded = x.bfloat16().float() if kernels.grouped_rounds_inputs else x  # the AVX512-BF16 body's inputs
        if got is None or not torch.allclose(got, rounded @ weight.T + bias, rtol=SELF_CHECK_TOLERANCE,
                                             atol=SELF_CHECK_TOLERANCE):
            return f"gemv_grouped {bits}-bit"
        rows = kernels.dequantize_grouped(codes.contiguous(), scales, mins, bits, 3, 11)
        if rows is None or not torch.allclose(rows, weight[3:11], rtol=1e-6, atol=1e-6):
            return f"dequantize_grouped {bits}-bit"
    return None


def _check_selection(kernels: NativeKernels, gen: torch.Generator) -> str | None:
    """select_slots against DecodePlan.select on rows short (dense), at a page edge and long, fixed window."""
    config = OvalConfig(page_size=16, top_k=3, window_min=20, window_max=20)
    lengths = torch.tensor([40, 96, 161, 300])
    sealed = lengths // 16
    pages = 20
    table = torch.stack([torch.randperm(80, generator=gen)[:pages] for _ in lengths])
    plan = DecodePlan(config, lengths, sealed, pages, 2, table, static=True)
    scores = torch.randn(len(lengths), 2, pages, generator=gen)
    want = plan.select(scores, detail=False)
    got = kernels.select_slots(scores, table, lengths, sealed, plan.start.view(-1, 1), 16, 1, 3, 20, 20)
    if got is None or not torch.equal(got[1], want.valid) or not torch.equal(got[0][want.valid],
                                                                          want.flat[want.valid]):
        return "select_slots"
    return None


def _check_grouped(kernels: NativeKernels, gen: torch.Generator) -> str | None:
    """oval_grouped_scores against grouped.grouped_scores' torch code: rows with more complete groups than kept and
    with fewer, coarse records as a bf16 pool stores them in fewer slots than pages (one group without a record:
    always kept), int4 fine records."""
    hkv, group, dim, rank, page_size, pages, slots, size, keep = 2, 3, 64, 4, 16, 40, 20, 4, 2
    records = random_records(gen, hkv, pages, rank, dim, page_size, "int4", torch.float32)
    coarse = stored_group_record(torch.randn(slots, hkv, dim, generator=gen),
                                 torch.randn(slots, hkv, rank, dim, generator=gen),
                                 torch.randn(slots, hkv, 2, rank, generator=gen).sort(dim=2).values,  # lo <= hi
                                 torch.bfloat16)
    table = torch.stack([torch.randperm(pages, generator=gen)[:24] for _ in range(2)])
    slot_of = torch.randint(0, slots, (pages,), generator=gen)
    slot_of[table[0, 4 * size - 1]] = -1  # row 0's 4th group has no record
    coarse = (*coarse, slot_of)
    sealed, q = torch.tensor([22, 9]), torch.randn(2, hkv, group, dim, generator=gen)
    summaries = {**{name: t[None] for name, t in zip(GROUP_NAMES, coarse)}, GROUP_SLOT: slot_of}
    want = grouped_reference(q, summaries, 0, table, sealed, 0.125, size, keep,
                          lambda t, n: record_scores(q, records, t, 0.125))
    got = kernels.grouped_scores(q, coarse, records, table, sealed, 0.125, size, keep)
    kept = want > float("-inf")
    if got is None or not torch.equal(got > float("-inf"), kept) or not torch.allclose(
            got[kept], want[kept], rtol=SELF_CHECK_TOLERANCE, atol=SELF_CHECK_TOLERANCE):
        return "oval_grouped_scores"
    return None


def main(argv: list[str]) -> int:
    """`python -m oval_edge.kernels.cpu_check LIBRARY`: exit 0 if the library agrees with torch (the build's check)."""
    kernels = NativeKernels(ctypes.CDLL(argv[0]), argv[0])
    problem = self_check(kernels)
    if problem:
        print(f"disagrees with torch: {problem}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
