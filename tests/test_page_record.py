"""The stored oval record (oval_edge/kv/records/page_record.py): formats, their bytes, and what quantization costs the scores.

The kernels read every format in place (tests/test_native_kernels.py, tests/test_triton_kernels.py check them against
the torch scorer over decoded records); here the pool's own sealed records, quantized, are checked against the float
record they came from, and the byte counts against the tensors the pool really allocates.
"""

from __future__ import annotations

import pytest
import torch
from oval_reference import make_pool, prefill, structured_kv

from oval_edge import record_layout
from oval_edge.config import OvalConfig
from oval_edge.geometry import KVGeometry
from oval_edge.kv.records import page_record
from oval_edge.sparse.scoring import group_queries, score_pages

LAYERS, KV_HEADS, Q_HEADS, DIM, RANK, PAGE = 2, 3, 9, 64, 4, 32
LENGTHS = (200, 130)


@pytest.fixture(scope="module")
def pools():
    """The same keys and values sealed into one pool per record format."""
    gen = torch.Generator().manual_seed(21)
    data = [structured_kv(gen, LAYERS, KV_HEADS, n, DIM) for n in LENGTHS]
    out = {}
    for fmt in ("float", "int8", "int4"):
        pool = make_pool(LAYERS, KV_HEADS, DIM, PAGE, num_pages=16, rank=RANK, eta=0.0, record=fmt)
        prefill(pool, ["a", "b"], [k for k, _ in data], [v for _, v in data], LENGTHS, chunk=64)
        out[fmt] = pool
    return out


@pytest.mark.parametrize("fmt", ["float", "int8", "int4"])
def test_record_bytes_are_what_the_pool_allocates(pools, fmt):
    pool = pools[fmt]
    g = pool.geometry
    allocated = sum(pool.summaries[name].numel() * pool.summaries[name].element_size()
                    for name in page_record.RECORD_NAMES if name in pool.summaries)
    assert allocated == g.paged_layers * g.kv_heads * pool.num_pages * g.oval_record_bytes()


@pytest.mark.parametrize("rank,expected", [(8, {"float": 1664, "int8": 850, "int4": 554}),
                                           (4, {"float": 896, "int8": 458, "int4": 310})])
def test_quantized_records_are_3x_smaller_than_bf16_ones(rank, expected):
    """D = 64, P = 32 (SmolLM2), per page and KV head: mean D + basis r*D + coordinates r*P values, in bf16 or in
    int8 codes / int4 ones (5-bit basis rows: D/2 + D/8 bytes each; 4-bit coordinates, P/2 bytes a rank, with P/8
    bytes of fifth bits for the first 3r/4 ranks; the mean int8) plus 1 + r fp16 scales. r = 8 (the default):
    1664, 850 and 554 bytes (64 + 8*40 + 8*16 + 6*4 + 9*2)."""
    sizes = {fmt: KVGeometry.for_oval(30, 3, 64, OvalConfig(record=fmt, rank=rank), "bfloat16").oval_record_bytes()
             for fmt in ("float", "int8", "int4")}
    assert sizes == expected
    assert record_layout.coord_fifth_ranks(rank) == 3 * rank // 4
    if rank == 8:  # the default; at r = 4 the mean's fixed 64 + 2 bytes weigh more: 896 / 310 = 2.9x
        assert sizes["float"] / sizes["int4"] >= 3.0


@pytest.mark.parametrize("fmt,tolerance", [("int8", 0.02), ("int4", 0.15)])
def test_quantized_records_decode_close_to_the_float_record(pools, fmt, tolerance):
    """Each part within half a quantization step: the mean per element; the basis rows (5-bit in int4, in the
    rotated frame they are quantized in) and coordinate rows compared through their product per rank, since a
    rank's two scales are stored as one (decode hands it to the basis row)."""
    exact, packed = pools["float"].summaries, pools[fmt].summaries
    mean, basis, coords = page_record.decode(packed["mean"], packed["basis"], packed["coords"], packed["scales"])
    want_basis, want_coords = exact["basis"].float(), exact["coords"].float()
    if fmt == "int4":  # its basis rows are quantized as b H (H: the Hadamard rotation): bound them in that frame
        turn = page_record.rotation(DIM)
        basis, want_basis = basis @ turn, want_basis @ turn
    rank = want_coords.shape[-2]
    fifth = record_layout.coord_fifth_ranks(rank) if fmt == "int4" else rank
    basis_levels = page_record.INT5_LEVELS if fmt == "int4" else page_record.INT8_LEVELS
    low_levels = page_record.INT4_LEVELS if fmt == "int4" else page_record.INT8_LEVELS
    coord_levels = torch.tensor([page_record.INT5_LEVELS if fmt == "int4" else page_record.INT8_LEVELS] * fifth
                                + [low_levels] * (rank - fifth), dtype=torch.float32)  # [r]
    fp16 = 2.0**-11  # the scales are stored in fp16: their rounding adds this much of each value
    mean_want = exact["mean"].float()
    mean_step = mean_want.abs().amax(-1, keepdim=True) / page_record.INT8_LEVELS
    assert bool(((mean - mean_want).abs() <= mean_step / 2 + fp16 * mean_want.abs().amax(-1, keepdim=True)
                 + 1e-6).all())
    # decoded basis row i = s_b,i * s_c,i * levels and coords = levels: undo the coordinate scale from the float rows
    coord_scale = want_coords.abs().amax(-1) / coord_levels  # [..., r]
    got_basis = basis / coord_scale.clamp_min(1e-30)[..., None]
    absmax = want_basis.abs().amax(-1, keepdim=True)
    bound = absmax / basis_levels / 2 + fp16 * absmax + 1e-5
    assert bool(((got_basis - want_basis).abs() <= bound).all())
    got_coords = coords * coord_scale[..., None]
    assert bool(((got_coords - want_coords).abs() <= coord_scale[..., None] / 2 + 1e-5).all())
    # the keys the record stands for: mu + B R, whole
    keys = lambda m, b, c: m[..., None, :] + (b.transpose(-1, -2) @ c).transpose(-1, -2)  # noqa: E731
    want_keys, got_keys = keys(mean_want, want_basis, want_coords), keys(mean, got_basis, got_coords)
    assert float((got_keys - want_keys).norm() / want_keys.norm()) < tolerance


def test_the_rotation_is_orthonormal_symmetric_and_blockwise_for_any_head_dim():
    for dim, blocks in ((64, [64]), (96, [64, 32]), (80, [64, 16]), (48, [32, 16])):
        turn = page_record.rotation(dim)
        assert page_record.rotation_blocks(dim) == blocks
        torch.testing.assert_close(turn @ turn, torch.eye(dim), atol=1e-6, rtol=0)  # its own inverse
        assert torch.equal(turn, turn.T)
        first = blocks[0]
        assert not turn[:first, first:].any() and not turn[first:, :first].any()  # block diagonal


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_records_rank_pages_as_the_float_record(pools, fmt, decode_kernels):
    """Scores from the quantized records stay close to the float record's, and the pages they rank first are (by the
    float record) as good as its own first choices, within that error."""
    gen = torch.Generator().manual_seed(4)
    q = group_queries(torch.randn(2, Q_HEADS, DIM, generator=gen) * 2, KV_HEADS)
    step = pools["float"].prepare(["a", "b"], [0, 0])
    want = score_pages("oval", q, pools["float"].summaries, 1, step.page_table, DIM**-0.5)
    got = score_pages("oval", q, pools[fmt].summaries, 1, pools[fmt].prepare(["a", "b"], [0, 0]).page_table,
                      DIM**-0.5)
    sealed = [n // PAGE for n in LENGTHS]
    for row, pages in enumerate(sealed):
        w, g = want[row, :, :pages], got[row, :, :pages]
        tolerance = 0.05 if fmt == "int8" else 0.5
        assert float((w - g).abs().max()) < tolerance
        regret = w.topk(2, -1).values - w.gather(-1, g.topk(2, -1).indices)  # [Hkv, 2]: float score given up
        assert float(regret.max()) <= 2 * tolerance


def test_unknown_record_format_is_a_clear_error():
    with pytest.raises(ValueError, match=r"record='int2' is unknown; allowed: float, int8, int4"):
        OvalConfig(record="int2")
    with pytest.raises(ValueError, match=r"needs a head_dim and a page_size that are multiples of 8 \(got 63, 16\)"):
        KVGeometry(1, 1, 63, 16, "float32", ("oval",), 4, "int4")
    with pytest.raises(ValueError, match=r"multiples of 8 \(got 64, 12\)"):
        KVGeometry(1, 1, 64, 12, "float32", ("oval",), 4, "int4")


@pytest.mark.parametrize("decode_step", ["static", "eager"])
def test_a_decode_step_counts_the_record_bytes_it_read(decode_step):
    """Honest bytes: the engine's summary_bytes_last_step is what scoring read, pages x KV heads x sparse layers x
    record bytes (the static step's kernels stop at each row's sealed pages; `eager` is the same step uncaptured)."""
    from oval_edge.runtime import Engine, EngineConfig, SamplingParams

    oval = OvalConfig(page_size=16, top_k=1, window_min=16, window_max=16, record="int8", kv_dtype="float32")
    engine = Engine.load("default", quant="nf4", device="cpu", oval=oval,
                         config=EngineConfig(max_batch=1, num_pages=32, decode_step=decode_step, oval_from=0))
    prompt = list(range(100, 300))  # 200 tokens: past the 64-token budget, so the sparse layers score pages
    out = engine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    g = engine.pool.geometry
    length = len(prompt) + len(out.output_ids) - 1  # the last step decoded the token before the final one
    pages = (length - 1) // 16
    sparse_layers = g.layers - oval.dense_layers
    assert engine.stats.summary_bytes_last_step == pages * sparse_layers * g.kv_heads * g.oval_record_bytes()
    assert engine.stats.kv_bytes_last_step > 0
