"""The Triton decode kernels (oval_edge/kernels/triton_*.py) against the torch reference, in Triton's interpreter on
CPU tensors (no GPU here). Their loader's switch and fallbacks: test_triton_loader.py, which imports this module
for the interpreter set-up below.

The matrix is a chosen set of cases rather than the full product (the interpreter is slow), but every listed value
appears: GQA 9/3 (a group of 3: padded query-head lanes) and 32/8, page sizes 16/32/64, batch 1 and batch 3 with
unequal lengths (padded page tables with counts / limits), fp32/bf16/fp16 with bf16 and fp16 under both GQA shapes,
K/V in a dtype other than q's, and both the single-split and the split-K (flash-decoding) attention.

Tolerances. The reference runs in fp32 on the same inputs (already rounded to the case's dtype), so only the
summation order and the output's rounding differ:
- scores are fp32 whatever the input dtype (fp32 accumulation on both sides): 1e-4 x max(1, |ref|);
- attention output is in q's dtype: fp32 1e-4; bf16 1e-2 and fp16 2e-3 x max(1, |ref|), i.e. ~2.5x and ~4x
  the rounding of a value below 2 to that dtype (half an ulp: 2^-8 = 3.9e-3 for bf16, 2^-11 = 4.9e-4 for fp16).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the x86_64 test extra has it); the torch ops cover "
                                     "decoding without it")

# TRITON_INTERPRET is read when @triton.jit runs, i.e. when the kernel modules are imported: set it first, reload
# them if this worker imported them earlier without it, then put the variable back for the other test files.
_PREVIOUS = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from oval_edge.kernels import gpu  # noqa: E402
from oval_edge.kernels.triton_kernels import (  # noqa: E402
    triton_attention, triton_check, triton_int8_head, triton_ops, triton_scoring,
)

if not all(isinstance(f, InterpretedFunction) for f in (triton_ops._add, triton_scoring._oval_kernel,
                                                         triton_attention._attend_kernel,
                                                         triton_int8_head._int8_head_kernel)):
    for _module in (triton_ops, triton_scoring, triton_attention, triton_int8_head):  # each binds the one before
        importlib.reload(_module)
if _PREVIOUS is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS

from oval_edge.sparse.attention import attend, gather_rows  # noqa: E402
from oval_edge.kernels.cpu_check import random_records  # noqa: E402
from oval_edge.kv.int8 import quantize_rows  # noqa: E402
from oval_edge.sparse.scoring import quest_scores, record_scores  # noqa: E402

DIM, RANK = 64, 4
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _near(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    error = float((actual.double() - expected.double()).abs().max())
    assert error <= tol * max(1.0, float(expected.abs().max())), f"max abs diff {error:.3g}"


def _table(gen: torch.Generator, batch: int, width: int, pages: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A page table [B, width] of distinct physical pages per row, and counts [B] (None for one row): unequal row
    lengths, the tails padded with page 0 as the static step pads them."""
    table = torch.stack([torch.randperm(pages, generator=gen)[:width] for _ in range(batch)])
    if batch == 1:
        return table, None
    counts = torch.tensor([width, width - 3, 2])[:batch]
    table[torch.arange(width) >= counts[:, None]] = 0
    return table, counts


# (Hq, Hkv, page size, batch, dtype of q and of the records)
SCORE_CASES = [
    (9, 3, 16, 1, F32), (32, 8, 32, 1, F32),
    (9, 3, 32, 3, BF16), (32, 8, 16, 3, BF16),
    (32, 8, 64, 3, F16), (9, 3, 64, 3, F16),
]
SCORE_IDS = [f"{hq}of{hkv}-P{p}-B{b}-{str(dt)[6:]}" for hq, hkv, p, b, dt in SCORE_CASES]


@pytest.mark.parametrize("fmt", ["float", "int8", "int4"])
@pytest.mark.parametrize("hq,hkv,page,batch,dtype", SCORE_CASES, ids=SCORE_IDS)
def test_oval_scores_equal_the_torch_scorer(hq, hkv, page, batch, dtype, fmt):
    """Every record format, read in place through the page table, scores as the torch scorer over the decoded
    records."""
    gen = torch.Generator().manual_seed(hq + page + batch)
    pages, width = 24, 9
    q = torch.randn(batch, hkv, hq // hkv, DIM, generator=gen).to(dtype)
    records = random_records(gen, hkv, pages, RANK, DIM, page, fmt, dtype)
    table, counts = _table(gen, batch, width, pages)
    scale = DIM**-0.5
    expected = record_scores(q.float(), records, table, scale)
    actual = triton_scoring.oval_scores(q, records, table, scale, counts)
    assert actual.shape == (batch, hkv, width) and actual.dtype == torch.float32
    _check_counted(actual, expected, counts)


@pytest.mark.parametrize("hq,hkv,page,batch,dtype", SCORE_CASES, ids=SCORE_IDS)
def test_quest_scores_equal_the_torch_scorer(hq, hkv, page, batch, dtype):
    gen = torch.Generator().manual_seed(hq + page + batch + 1)
    pages, width = 24, 9
    q = torch.randn(batch, hkv, hq // hkv, DIM, generator=gen).to(dtype)
    keys = torch.randn(pages, hkv, page, DIM, generator=gen)
    kmin, kmax = keys.amin(2).to(dtype), keys.amax(2).to(dtype)  # [pages, Hkv, D] as the pool stores them
    table, counts = _table(gen, batch, width, pages)
    expected = quest_scores(q.float(), kmin[table].float(), kmax[table].float(), DIM**-0.5)
    actual = triton_scoring.quest_scores(q, kmin, kmax, table, DIM**-0.5, counts)
    _check_counted(actual, expected, counts)


def _check_counted(actual: torch.Tensor, expected: torch.Tensor, counts: torch.Tensor | None) -> None:
    """Pages before counts[b] equal the reference; the rest are UNSCORED (not candidates, not read)."""
    listed = torch.ones(actual.shape[0], actual.shape[2], dtype=torch.bool) if counts is None else \
        torch.arange(actual.shape[2]) < counts[:, None]
    listed = listed[:, None].expand_as(actual)
    _near(actual[listed], expected[listed], 1e-4)
    assert bool((actual[~listed] == triton_scoring.UNSCORED).all())


def test_pages_outside_the_pool_are_not_read():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 3, DIM, generator=gen)
    records = random_records(gen, 2, 6, RANK, DIM, 16, "float", torch.float32)
    table = torch.tensor([[1, 6, 2, -1]])  # 6 and -1 lie outside the 6-page pool
    actual = triton_scoring.oval_scores(q, records, table, 0.125)
    expected = record_scores(q, records, table.clamp(0, 5), 0.125)
    _near(actual[..., [0, 2]], expected[..., [0, 2]], 1e-4)
    assert bool((actual[..., [1, 3]] == triton_scoring.UNSCORED).all())


# (Hq, Hkv, page size, batch, q dtype, K/V dtype, splits (None: the rule), layout)
ATTEND_CASES = [
    (9, 3, 16, 1, F32, F32, 1, "sparse"),
    (32, 8, 32, 1, F32, BF16, 2, "dense"),
    (9, 3, 16, 3, F32, F16, None, "dense"),
    (9, 3, 32, 3, BF16, BF16, 3, "dense"),
    (32, 8, 16, 3, BF16, BF16, 1, "sparse"),
    (9, 3, 64, 3, F16, F16, 4, "dense"),
    (32, 8, 64, 3, F16, F16, 1, "sparse"),
    (32, 8, 16, 3, F16, BF16, 2, "sparse"),
    (9, 3, 64, 1, BF16, BF16, None, "long"),  # 1536 slots: the rule picks 3 splits
]
ATTEND_IDS = [f"{hq}of{hkv}-P{p}-B{b}-{str(qd)[6:]}-kv{str(kd)[6:]}-S{s}-{lay}"
              for hq, hkv, p, b, qd, kd, s, lay in ATTEND_CASES]


@pytest.mark.parametrize("hq,hkv,page,batch,q_dtype,kv_dtype,splits,layout", ATTEND_CASES, ids=ATTEND_IDS)
def test_attention_over_slots_equals_gather_then_attend(hq, hkv, page, batch, q_dtype, kv_dtype, splits, layout):
    gen = torch.Generator().manual_seed(hq + page + batch + (splits or 0))
    pages = 24
    rows = pages * hkv * page
    k_rows = (2 * torch.randn(rows, DIM, generator=gen)).to(kv_dtype)
    v_rows = torch.randn(rows, DIM, generator=gen).to(kv_dtype)
    q = torch.randn(batch, hq, DIM, generator=gen).to(q_dtype)
    if layout == "sparse":
        flat, valid, limits = _sparse(gen, batch, hkv, page, pages)
    else:
        flat, valid, limits = _dense(gen, batch, hkv, page, pages, width=24 if layout == "long" else 6)
    if splits is None:
        assert triton_attention.split_count(batch, hkv, flat.shape[-1]) == (3 if layout == "long" else 1)
    bounded = valid if limits is None else valid & (torch.arange(flat.shape[-1]) < limits[:, None, None])
    k, v = gather_rows(k_rows, v_rows, flat)
    expected = attend(q.float(), k.float(), v.float(), bounded, DIM**-0.5)
    actual = triton_attention.attend_slots(q, k_rows, v_rows, flat, valid, DIM**-0.5, limits, splits)
    assert actual.shape == q.shape and actual.dtype == q_dtype
    _near(actual, expected, TOL[q_dtype])


def _dense(gen: torch.Generator, batch: int, hkv: int, page: int, pages: int, width: int = 6):
    """A dense layer of the static step: every slot of a padded `width`-page table, valid below each row's length,
    and limits = lengths; past the last row's limit the slots are marked valid on purpose (they must not be read)."""
    table = torch.stack([torch.randperm(pages, generator=gen)[:width] for _ in range(batch)])  # [B, Np]
    heads = torch.arange(hkv)[None, :, None, None]
    flat = ((table[:, None, :, None] * hkv + heads) * page + torch.arange(page)).flatten(2)  # [B, Hkv, Np * P]
    lengths = torch.tensor([width * page - 3, 2 * page + 5, 7])[:batch]
    valid = (torch.arange(flat.shape[-1]) < lengths[:, None, None]).expand(flat.shape).clone()
    valid[-1, :, lengths[-1]:] = True  # garbage past the last row's limit
    return flat, valid, lengths


def _sparse(gen: torch.Generator, batch: int, hkv: int, page: int, pages: int):
    """A sparse layer's selection: sink + 2 pages + a 20-slot window, some slots invalid, slot 0 always valid."""
    slots = 3 * page + 20
    flat = torch.randint(0, pages * hkv * page, (batch, hkv, slots), generator=gen)
    valid = torch.rand(batch, hkv, slots, generator=gen) < 0.8
    valid[..., 0] = True
    return flat, valid, None


# kv_dtype='int8' rows (oval_edge/kv/int8.py): (Hq, Hkv, page, batch, q dtype, splits, layout)
INT8_CASES = [(9, 3, 16, 3, F32, 1, "sparse"), (32, 8, 32, 3, BF16, 2, "dense"), (9, 3, 64, 1, F16, None, "long")]


@pytest.mark.parametrize("hq,hkv,page,batch,q_dtype,splits,layout", INT8_CASES,
                         ids=[f"{c[0]}of{c[1]}-P{c[2]}-{str(c[4])[6:]}-S{c[5]}-{c[6]}" for c in INT8_CASES])
def test_attention_over_int8_slots_equals_the_torch_reference(hq, hkv, page, batch, q_dtype, splits, layout):
    """The int8 variant reads codes and per-row scales in place; the torch path gathers and dequantizes them."""
    gen = torch.Generator().manual_seed(hq + page + batch)
    pages = 24
    rows = pages * hkv * page
    (k_rows, k_scales), (v_rows, v_scales) = (quantize_rows(torch.randn(rows, DIM, generator=gen) * 2) for _ in "kv")
    q = torch.randn(batch, hq, DIM, generator=gen).to(q_dtype)
    flat, valid, limits = (_sparse(gen, batch, hkv, page, pages) if layout == "sparse"
                           else _dense(gen, batch, hkv, page, pages, width=24 if layout == "long" else 6))
    bounded = valid if limits is None else valid & (torch.arange(flat.shape[-1]) < limits[:, None, None])
    scales = (k_scales, v_scales)
    k, v = gather_rows(k_rows, v_rows, flat, scales)  # the torch path: gathered rows dequantized
    assert k.dtype == F32
    expected = attend(q.float(), k, v, bounded, DIM**-0.5)
    actual = triton_attention.attend_slots(q, k_rows, v_rows, flat, valid, DIM**-0.5, limits, splits, scales)
    assert actual.shape == q.shape and actual.dtype == q_dtype
    _near(actual, expected, TOL[q_dtype])
    routed = gpu.TritonKernels(triton_scoring, triton_attention, "interpreted").attend_slots(
        q, k_rows, v_rows, flat, valid, DIM**-0.5, limits, splits, scales)
    _near(routed, expected, TOL[q_dtype])
    assert gpu.TritonKernels(triton_scoring, triton_attention, "interpreted").attend_slots(
        q, k_rows, v_rows, flat, valid, DIM**-0.5, limits) is None  # int8 rows without scales: declined


def test_slots_outside_the_layer_count_as_invalid():
    gen = torch.Generator().manual_seed(9)
    k_rows, v_rows = torch.randn(64, DIM, generator=gen), torch.randn(64, DIM, generator=gen)
    q = torch.randn(1, 4, DIM, generator=gen)
    flat = torch.randint(0, 64, (1, 2, 30), generator=gen)
    flat[0, 0, 5], flat[0, 1, 7] = 64, -2
    valid = torch.ones(1, 2, 30, dtype=torch.bool)
    k, v = gather_rows(k_rows, v_rows, flat.clamp(0, 63))
    expected = attend(q, k, v, valid & (flat >= 0) & (flat < 64), 0.125)
    _near(triton_attention.attend_slots(q, k_rows, v_rows, flat, valid, 0.125), expected, 1e-4)


def test_split_count_follows_length_and_occupancy():
    rule = triton_attention.split_count
    assert rule(1, 8, 300) == 1  # a sparse layer's selection: one split
    assert rule(1, 8, 8192) == 16  # one row, dense at 8k: 16 x 8 = 128 programs
    assert rule(4, 8, 8192) == 4  # four rows already give 32 programs
    assert rule(1, 2, 1500) == 2  # each split keeps >= 512 slots
    assert rule(64, 8, 8192) == 1  # the batch alone fills the GPU


# ---- the int8 output head (triton_int8_head.py) and the CUDA table around it (runtime/model/embeddings.py) ----

def _int8_weights(gen: torch.Generator, vocab: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(-127, 128, (vocab, hidden), generator=gen, dtype=torch.int8)
    return codes, torch.rand(vocab, hidden // 32, generator=gen) / 50


@pytest.mark.parametrize("rows", [1, 7, 64, 70])
def test_int8_head_kernel_equals_the_dequantized_matmul(rows):
    """fp32 logits within fp32 summation error of x @ (codes * scales)^T: the kernel's only rounding is x's own
    dtype (codes are exact in fp16/bf16, accumulation is fp32). 70 rows take two programs along the row axis;
    vocab 200 is not a multiple of the 64-row block. fp16 only: the interpreter mis-handles bf16
    (triton_int8_head.INTERPRETED_DTYPES); the device's self-check covers bf16 (make gpu-check)."""
    dtype = F16
    gen = torch.Generator().manual_seed(rows)
    codes, scales = _int8_weights(gen, 200, 128)
    x = torch.randn(rows, 128, generator=gen).to(dtype)
    actual = triton_int8_head.int8_head(x, codes, scales)
    assert actual.shape == (rows, 200) and actual.dtype == torch.float32
    _near(actual, triton_check.int8_head_reference(x, codes, scales), 1e-5)


def test_int8_head_kernel_declines_what_it_does_not_take():
    codes, scales = _int8_weights(torch.Generator().manual_seed(1), 64, 64)
    assert triton_int8_head.int8_head(torch.randn(2, 64), codes, scales) is None  # fp32 rows: the torch path
    assert triton_int8_head.int8_head(torch.randn(2, 64).bfloat16(), codes, scales) is None  # interpreter: no bf16
    assert triton_int8_head.int8_head(torch.randn(2, 64).half(), codes[:, :48], scales) is None  # shapes disagree
    assert triton_check.int8_head_check(triton_int8_head, torch.device("cpu")) is None


def test_cuda_table_layout_kernel_and_fallback_agree(monkeypatch):
    """CudaInt8Table built on CPU tensors (its layout does not depend on the device): row-major codes and scales,
    unpadded, the Q8 blocks of the rows; the Triton path (interpreter) and the torch fallback give the same logits;
    lookups dequantize the gathered rows."""
    from oval_edge.runtime.model import embeddings

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gpu.load_int8_head.cache_clear()
    try:
        gen = torch.Generator().manual_seed(3)
        weight = torch.randn(embeddings.PACK_ROWS + 37, 64, generator=gen)
        table = embeddings.CudaInt8Table.from_rows(lambda a, b: weight[a:b], *weight.shape, torch.device("cpu"))
        assert table.codes.shape == (weight.shape[0], 64) and table.scales.shape == (weight.shape[0], 2)
        assert table.head_kernel is triton_int8_head
        blocks = weight.view(-1, 2, 32)
        scale = blocks.abs().amax(-1) / 127
        assert torch.allclose(table.scales, scale)
        assert torch.equal(table.codes, (blocks / scale[..., None]).round().to(torch.int8).view_as(weight))
        ids = torch.tensor([0, 5, weight.shape[0] - 1, 5])
        dequantized = (table.codes.float().view(-1, 2, 32) * table.scales[..., None]).view_as(weight)
        assert torch.equal(table.lookup(ids), dequantized[ids])
        x = torch.randn(3, 64, generator=gen).half()
        kernel = table.matmul(x)
        fallback = embeddings._int8_head_rows(x, table.codes, table.scales)
        assert kernel.dtype == fallback.dtype == torch.float32
        _near(kernel, fallback, 1e-5)
        _near(fallback, x.float() @ dequantized.T, 1e-5)
    finally:
        gpu.load_int8_head.cache_clear()
