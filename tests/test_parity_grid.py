"""The parity grid: every op of the static step's ops table (oval_edge/sparse/step_ops_table.py) x record format or
K/V storage x body x shape against an fp64 reference (tests/parity_reference.py), as llama.cpp's test-backend-ops
checks every backend op against the CPU one. The bodies are the ones the table builds (flat_scores, ... called with
each kernel set), so what is checked is what a step would call; each case asserts the body it got is the one named.

Bodies: torch (kernels None); the C kernels built as each SIMD body this CPU runs (cpu_build.BODIES: portable, avx2,
and the native build: AVX-512 on a CPU with it), each its own library loaded side by side (kernels/cpu.py
body_kernels); Triton in its interpreter on CPU tensors (test_triton_kernels.py sets it up). Shapes: head_dim 64 /
128 x page_size 16 / 32 x GQA group 1 / 4 x batch 1 / 3 (ragged: rows of different lengths, counts and limits).
Triton runs a covering subset of the shapes (TRITON_SHAPES: every value of every axis appears): the interpreter takes
0.2-2.5 s a call (measured; the int4 record's query rotation most), the C kernels milliseconds.

Tolerances (max |got - ref| <= TOL x max(1, max |ref|)). The reference reads the same stored values (bf16, int8
codes, int4 nibbles) in fp64, so only the bodies' fp32 arithmetic differs: dot products of D <= 128 terms and a
log-sum-exp of G * P <= 128 exp2 terms (scores), a softmax over T <= 128 slots and a weighted sum (attention).
fp32's unit roundoff is 6e-8; the worst errors measured over the whole grid (every body) are 1.9e-7 for scores and
9.3e-7 for attention (relative to max(1, |ref|)), so SCORE_TOL 5e-6 and ATTEND_TOL 1e-5 leave >= 10x for another
CPU's exp2 or summation order, and still fail a body one rounding step off (bf16 rounding of a score: ~4e-3). Selection and writes are exact: the same rows
(selection), the value rounded to the pool dtype (|error| <= half an ulp: 2^-8 relative for bf16, 0 for fp32),
int8 codes within half a quantization step (scale / 2 = max |row| / 254).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

import parity_reference as ref
import test_triton_kernels  # noqa: F401  (Triton's interpreter for CPU tensors, set up before any kernel runs)
from oval_edge.config import OvalConfig
from oval_edge.geometry import KVGeometry
from oval_edge.kernels import cpu_build, gpu
from oval_edge.kernels.triton_kernels import triton_attention, triton_scoring
from oval_edge.kernels.cpu import NativeKernels, body_kernels
from oval_edge.kernels.cpu_check import random_records
from oval_edge.kv.records.group_record import GROUP_NAMES, GROUP_SLOT, stored_group_record
from oval_edge.kv.int8 import quantize_rows
from oval_edge.kv.records.page_record import LayerRecords, Rotations
from oval_edge.kv.pool import PagePool
from oval_edge.sparse import step_ops_table as table
from oval_edge.sparse.packed_scores import PackedScorer
from oval_edge.sparse.selection import DecodePlan

SCORE_TOL, ATTEND_TOL = 5e-6, 1e-5
HKV, RANK, PAGES, WIDTH, SCALE = 2, 4, 24, 8, 0.11
C_BODIES = ("portable", "avx2", "native")
BODIES = ("torch", *(f"C-{b}" for b in C_BODIES), "Triton")
FORMATS = ("float32", "bfloat16", "int8", "int4")  # page_record formats; float records in the pool's dtype


@dataclass(frozen=True)
class Shape:
    dim: int
    page: int
    group: int
    batch: int

    def __str__(self) -> str:
        return f"D{self.dim}-P{self.page}-G{self.group}-B{self.batch}"


SHAPES = [Shape(*s) for s in itertools.product((64, 128), (16, 32), (1, 4), (1, 3))]
TRITON_SHAPES = [Shape(64, 16, 1, 1), Shape(128, 32, 4, 3), Shape(64, 32, 4, 3), Shape(128, 16, 1, 3)]
STARTED = time.perf_counter()


def _cases(*axes, triton_axis=None):
    """The product of the axes with (body, shape) last, Triton only over TRITON_SHAPES."""
    return [(*values, body, shape) for values in itertools.product(*axes) for body in BODIES
            for shape in (TRITON_SHAPES if body == "Triton" else SHAPES)]


@pytest.fixture(scope="module")
def kernel_sets():
    """Body name -> its kernels (None: torch, or a C body this machine cannot build or run: its cases skip).
    The C bodies are built in parallel (each ~10-30 s cold, cached after: cpu_build.built_library)."""
    runnable = [b for b in C_BODIES if b == cpu_build.NATIVE_BODY or b in cpu_build.runnable_bodies()]
    with ThreadPoolExecutor(len(runnable)) as pool:
        built = dict(zip(runnable, pool.map(_try_body, runnable)))
    sets = {"torch": None, "Triton": gpu.TritonKernels(triton_scoring, triton_attention, "interpreted")}
    sets.update({f"C-{b}": built.get(b) for b in C_BODIES})
    return sets


def _try_body(body: str) -> NativeKernels | None:
    try:
        return body_kernels(body)
    except (ValueError, RuntimeError, OSError):
        return None


def kernels_for(kernel_sets, body: str):
    kernels = kernel_sets[body]
    if body.startswith("C-") and kernels is None:
        pytest.skip(f"the {body} kernels cannot be built or run here")
    return kernels


def expect_body(name: str, body: str) -> None:
    """The table built the body this case is for (not a silent torch fallback)."""
    want = {"torch": "torch", "Triton": "Triton"}.get(body, "C")
    assert name.startswith(want) or name.startswith(f"two-level {want.lower()}") or (
        want == "Triton" and "over Triton" in name), f"{body} case got body {name!r}"


def near(got: torch.Tensor, want: torch.Tensor, tol: float, mask: torch.Tensor | None = None) -> None:
    assert got is not None
    if mask is not None:
        got, want = got[mask], want[mask]
    error = float((got.double() - want).abs().max())
    assert error <= tol * max(1.0, float(want.abs().max())), f"max abs error {error:.3g}"


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(abs(hash(tuple(map(str, key)))) % (2 ** 31))


def _records(gen, shape: Shape, fmt: str, pages: int = PAGES) -> LayerRecords:
    dtype = torch.bfloat16 if fmt == "bfloat16" else torch.float32
    return random_records(gen, HKV, pages, RANK, shape.dim, shape.page, "float" if fmt.startswith("float") or
                          fmt == "bfloat16" else fmt, dtype)


def _table(gen, rows: int, width: int, pages: int) -> torch.Tensor:
    return torch.stack([torch.randperm(pages, generator=gen)[:width] for _ in range(rows)])


def _counts(batch: int, width: int) -> torch.Tensor:
    return torch.tensor([width, width - 3, 2][:batch])  # ragged: a full row, a shorter one, a short one


@pytest.mark.parametrize("fmt, body, shape", _cases(FORMATS), ids=str)
def test_flat_scores(kernel_sets, fmt, body, shape):
    kernels = kernels_for(kernel_sets, body)
    gen = _generator("flat", fmt, shape)
    records = _records(gen, shape, fmt)
    q = torch.randn(shape.batch, HKV, shape.group, shape.dim, generator=gen)
    pages, counts = _table(gen, shape.batch, WIDTH, PAGES), _counts(shape.batch, WIDTH)
    rotations = Rotations()
    name, score = table.flat_scores(kernels, records, shape.group, SCALE, rotations.get(shape.dim, "cpu"),
                                    PackedScorer(shape.dim, SCALE, "cpu", rotations))
    expect_body(name, body)
    candidates = (torch.arange(WIDTH) < counts[:, None])[:, None].expand(-1, HKV, -1)  # past counts: no candidate
    near(score(q, pages, counts), ref.oval_scores(q, records, pages, SCALE), SCORE_TOL, candidates)


@pytest.mark.parametrize("fmt, body, shape", _cases(("float32", "int4")), ids=str)
def test_two_level_scores(kernel_sets, fmt, body, shape):
    kernels = kernels_for(kernel_sets, body)
    gen = _generator("grouped", fmt, shape)
    size, keep, width, pages = 4, 2, 16, 40
    records = _records(gen, shape, fmt, pages)
    mean, basis = torch.randn(pages, HKV, shape.dim, generator=gen), torch.randn(pages, HKV, RANK, shape.dim,
                                                                                 generator=gen)
    bounds = torch.randn(pages, HKV, 2, RANK, generator=gen).sort(dim=2).values  # lo <= hi
    coarse = stored_group_record(mean, basis, bounds, torch.bfloat16 if fmt == "int4" else torch.float32)
    pages_of = _table(gen, shape.batch, width, pages)
    slot_of = torch.randperm(pages, generator=gen)  # a slot of its own per group (a shared one would tie)
    slot_of[pages_of[0, 2 * size - 1]] = -1  # row 0's second group has no coarse record: always kept
    coarse = (*coarse, slot_of)
    summaries = {**{n: t[None] for n, t in zip(GROUP_NAMES, coarse[:4])}, GROUP_SLOT: slot_of,
                 **{n: t[None] for n, t in zip(("mean", "basis", "coords", "scales"), records) if t is not None}}
    sealed = torch.tensor([14, 11, 6][: shape.batch])  # 3, 2 and 1 complete groups of 4 (keep 2), then the rest
    rotations = Rotations()
    fine = table.flat_scores(kernels, records, shape.group, SCALE, rotations.get(shape.dim, "cpu"))
    name, score = table.two_level_scores(kernels, summaries, 0, size, keep, shape.group, width, SCALE, fine)
    expect_body(name, body)
    q = torch.randn(shape.batch, HKV, shape.group, shape.dim, generator=gen)
    got = score(q, pages_of, sealed)
    want = ref.two_level_scores(q, coarse, records, pages_of, sealed, SCALE, size, keep)
    kept = want > float("-inf")
    assert torch.equal(got > float("-inf"), kept)  # the same pages scored finely
    near(got, want, SCORE_TOL, kept)


@pytest.mark.parametrize("body, shape", [(b, s) for b in ("torch", "Triton")
                                         for s in (TRITON_SHAPES if b == "Triton" else SHAPES)], ids=str)
def test_quest_scores(kernel_sets, body, shape):
    kernels = kernels_for(kernel_sets, body)
    gen = _generator("quest", shape)
    a, b = torch.randn(2, PAGES, HKV, shape.dim, generator=gen)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    name, score = table.quest_page_scores(kernels, kmin, kmax, SCALE)
    expect_body(name, body)
    q = torch.randn(shape.batch, HKV, shape.group, shape.dim, generator=gen)
    pages, counts = _table(gen, shape.batch, WIDTH, PAGES), _counts(shape.batch, WIDTH)
    candidates = (torch.arange(WIDTH) < counts[:, None])[:, None].expand(-1, HKV, -1)
    near(score(q, pages, counts), ref.quest_scores(q, kmin, kmax, pages, SCALE), SCORE_TOL, candidates)


SELECT_SHAPES = list(itertools.product((16, 32), (1, 3), (1, 3)))  # page size, KV heads, batch


@pytest.mark.parametrize("body", [b for b in BODIES if b != "Triton"])  # no Triton selection: torch on CUDA
@pytest.mark.parametrize("page, kv_heads, batch", SELECT_SHAPES)
def test_select(kernel_sets, body, page, kv_heads, batch):
    kernels = kernels_for(kernel_sets, body)
    gen = _generator("select", body, page, kv_heads, batch)
    window, width = page + 4, 12
    config = OvalConfig(page_size=page, top_k=2, sink_pages=1, window_min=window, window_max=window)
    slots = config.token_budget
    lengths = torch.tensor([width * page - 3, slots - 1, slots + page + 5][:batch])  # long, short (dense), mid
    sealed = (lengths - 1) // page
    pages_of = _table(gen, batch, width, 40)
    scores = torch.randn(batch, kv_heads, width, generator=gen)
    plan = DecodePlan(config, lengths, sealed, width, kv_heads, pages_of, static=True)
    name, select = table.page_selection(kernels, config, kv_heads, width)
    expect_body(name, body)
    flat, valid, window_out = select(plan, scores, sealed)
    assert torch.equal(window_out, torch.full((batch, kv_heads), window))
    want = ref.selected_slots(scores, pages_of, lengths, sealed, page, 1, 2, window, slots, kv_heads)
    got = [[sorted(flat[b, h][valid[b, h]].tolist()) for h in range(kv_heads)] for b in range(batch)]
    assert got == want


def _kv_rows(gen, rows: int, dim: int, kv: str):
    k, v = torch.randn(2, rows, dim, generator=gen)
    if kv != "int8":
        dtype = getattr(torch, kv)
        return k.to(dtype), v.to(dtype), None
    (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
    return k, v, (k_scale, v_scale)


@pytest.mark.parametrize("kv, limited, body, shape", _cases(("float32", "bfloat16", "int8"), (False, True)),
                         ids=str)
def test_attend(kernel_sets, kv, limited, body, shape):
    kernels = kernels_for(kernel_sets, body)
    gen = _generator("attend", kv, limited, shape)
    slots, rows = 4 * shape.page, PAGES * HKV * shape.page
    k_rows, v_rows, scales = _kv_rows(gen, rows, shape.dim, kv)
    flat = torch.randint(0, rows, (shape.batch, HKV, slots), generator=gen)
    valid = torch.rand(shape.batch, HKV, slots, generator=gen) < 0.7
    valid[..., 0] = True  # every row attends to at least its own token
    limits = torch.tensor([slots, slots - 7, 5][: shape.batch]) if limited else None
    name, attend = table.slot_attention(kernels, k_rows, v_rows, scales, HKV, shape.group, SCALE, 0.0,
                                        torch.float32)
    expect_body(name, body)
    q = torch.randn(shape.batch, HKV * shape.group, shape.dim, generator=gen)
    near(attend(q, flat, valid, limits), ref.attention(q, k_rows, v_rows, flat, valid, SCALE, limits, 0.0, scales),
         ATTEND_TOL)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_attend_softcap_is_torch(kernel_sets, shape):
    """Soft-capped logits (Gemma 2): no kernel takes them, so every kernel set resolves to torch, and it is right."""
    gen = _generator("softcap", shape)
    rows = PAGES * HKV * shape.page
    k_rows, v_rows, _ = _kv_rows(gen, rows, shape.dim, "float32")
    flat = torch.randint(0, rows, (shape.batch, HKV, 3 * shape.page), generator=gen)
    valid = torch.ones_like(flat, dtype=torch.bool)
    q = 8 * torch.randn(shape.batch, HKV * shape.group, shape.dim, generator=gen)  # logits beyond the cap
    want = ref.attention(q, k_rows, v_rows, flat, valid, SCALE, None, 5.0)
    for kernels in kernel_sets.values():
        name, attend = table.slot_attention(kernels, k_rows, v_rows, None, HKV, shape.group, SCALE, 5.0,
                                            torch.float32)
        assert name == "torch"
        near(attend(q, flat, valid, None), want, ATTEND_TOL)


@pytest.mark.parametrize("kv", ("float32", "bfloat16", "int8"))
@pytest.mark.parametrize("shape", [s for s in SHAPES if s.group == 1], ids=str)  # G: not an axis of a write
def test_write(kv, shape):
    """The table's write body for the pool's K/V storage: index_put_ of strided slices (float rows), the pool's
    write_rows (int8 codes and their scales, the keys staged for sealing)."""
    gen = _generator("write", kv, shape)
    geometry = KVGeometry(1, HKV, shape.dim, shape.page, "float32" if kv == "int8" else kv, kv_int8=kv == "int8")
    pool = PagePool(geometry, 8)
    pages, offsets = torch.randperm(8, generator=gen)[: shape.batch], torch.randint(0, shape.page, (shape.batch,))
    slots = (pages[:, None] * HKV + torch.arange(HKV)) * shape.page + offsets[:, None]  # [B, Hkv]
    if kv == "int8":
        for page, offset in zip(pages.tolist(), offsets.tolist()):
            pool.int8.stage([page], offset, 1, shape.page)
    fused = torch.randn(shape.batch, 3 * HKV, shape.dim, generator=gen)  # k, v: strided slices, as the step's
    k_new, v_new = fused[:, HKV : 2 * HKV], fused[:, 2 * HKV :]
    name, write = table.row_write(pool, 0)
    assert name == ("pool.write_rows" if kv == "int8" else "torch index_put")
    write(slots, k_new, v_new)
    for rows, new, scales in ((pool.k_rows[0], k_new, 0), (pool.v_rows[0], v_new, 1)):
        stored, new = rows[slots].double(), new.double()
        if kv == "int8":  # codes x their row's scale, within half a step of the value written
            stored = stored * pool.scale_rows[0][scales][slots].double()[..., None]
            bound = new.abs().amax(-1, keepdim=True) / 254 + 1e-7
        else:  # the value rounded to the pool's dtype: half an ulp (0 for fp32)
            bound = new.abs() * (2.0 ** -8 if kv == "bfloat16" else 0.0)  # bf16: 8 significant bits
        assert bool(((stored - new).abs() <= bound).all())


def test_the_c_bodies_are_distinct_builds(kernel_sets):
    """Each C body's library runs the scoring body its name says (score_kernels.c reports it): a build whose flags
    were ignored would test one body three times."""
    runnable = cpu_build.runnable_bodies()  # x86-64: the native build has the widest body this CPU runs
    native = "avx2 + avx512 int4" if "avx512" in runnable else "avx2" if "avx2" in runnable else None
    expected = {"C-portable": "plain", "C-avx2": "avx2", "C-native": native}
    for body, want in expected.items():
        kernels = kernel_sets[body]
        if kernels is not None and want is not None:
            assert kernels.scoring_body == want, body


def test_grid_size_and_time(request):
    """The grid's size and time so far, printed (the last test of the file: run the file alone for the figure);
    and every op of the table has cases."""
    cases = [item for item in request.node.parent.collect() if item.originalname != request.node.originalname]
    ops = {item.originalname.removeprefix("test_").split("_")[0] for item in cases}
    assert {"write", "flat", "two", "quest", "select", "attend"} <= ops
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown under -q too
        print(f"\nparity grid: {len(cases)} cases in {time.perf_counter() - STARTED:.1f} s")
