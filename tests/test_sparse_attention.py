"""Sparse decode attention equals a naive reference over explicit index sets ([R-candidates to R-exact-attention]).

A batch of 3 sequences (37, 300 and 1000 tokens, so short and long rows share one batch) is prefilled into a pool
through prepare/write/commit; the decode step writes the last token and attends. The reference re-derives the
selection from loop-computed page scores (candidates, entropy window, top-k) and computes softmax attention per
query head over the explicit index set; the pool's `Selection` is checked against it slot by slot.
"""

from __future__ import annotations

import pytest
import torch
from oval_reference import (
    make_pool,
    prefill,
    ref_attention,
    ref_page_score,
    ref_selection,
    structured_kv,
    write_tokens,
)

from oval_edge import OvalConfig
from oval_edge.sparse.attention import decode_attention
from oval_edge.sparse.selection import select_positions, slots_per_step

LAYERS, KV_HEADS, Q_HEADS, DIM, RANK, ETA = 2, 3, 9, 64, 4, 0.5
LENGTHS = (37, 300, 1000)
LAYER = 1  # not layer 0: the pool must index the right layer
TOL = 1e-5

CASES = {
    "oval-k4": dict(scorer="oval", top_k=4, sink_pages=1, window_min=20, window_max=100),
    "quest-k4": dict(scorer="quest", top_k=4, sink_pages=1, window_min=20, window_max=100),
    # No sink, no pages: window only, and window_max < page_size so the open page widens the window.
    "oval-k0-sink0": dict(scorer="oval", top_k=0, sink_pages=0, window_min=3, window_max=8),
    "quest-sink2-small-window": dict(scorer="quest", top_k=3, sink_pages=2, window_min=3, window_max=10),
    "oval-fixed-window": dict(scorer="oval", top_k=6, sink_pages=1, window_min=48, window_max=48),
}


@pytest.fixture(scope="module", params=[16, 32], ids=lambda p: f"P{p}")
def decode_step(request):
    """A pool holding L-1 tokens of each row, and the uncommitted decode step that wrote token L-1."""
    page_size = request.param
    gen = torch.Generator().manual_seed(2024 + page_size)
    data = [structured_kv(gen, LAYERS, KV_HEADS, n, DIM) for n in LENGTHS]
    keys, values = [k for k, _ in data], [v for _, v in data]
    pages = sum(-(-n // page_size) for n in LENGTHS)
    pool = make_pool(LAYERS, KV_HEADS, DIM, page_size, num_pages=pages, rank=RANK, eta=ETA)
    seq_ids = ["short", "mid", "long"]
    prefill(pool, seq_ids, keys, values, [n - 1 for n in LENGTHS], chunk=400)  # > SEAL_CHUNK pages/commit
    step = write_tokens(pool, seq_ids, keys, values, [1, 1, 1])
    q = torch.randn(len(LENGTHS), Q_HEADS, DIM, generator=gen) * 1.5
    return dict(pool=pool, step=step, keys=keys, values=values, q=q, scores={})


def _ref_scores(ctx, scorer, row, head, sealed):
    """Loop-reference scores {logical page: score} of one row and KV head (cached per scorer)."""
    key = (scorer, row, head)
    if key not in ctx["scores"]:
        P, group = ctx["pool"].page_size, Q_HEADS // KV_HEADS
        queries = ctx["q"][row, head * group : (head + 1) * group]
        k, v = ctx["keys"][row][LAYER, head], ctx["values"][row][LAYER, head]
        ctx["scores"][key] = {
            j: ref_page_score(scorer, queries, k[j * P : j * P + P], v[j * P : j * P + P], RANK, ETA, DIM**-0.5,
                              ctx["pool"].output_metric[LAYER, head])
            for j in range(sealed)
        }
    return ctx["scores"][key]


def _check_topk(chosen: set, candidates: list, scores: dict, k: int) -> None:
    """`chosen` is a top-k of `scores` over `candidates` (ties within fp32 noise may go either way)."""
    assert chosen <= set(candidates), f"picked non-candidate pages {sorted(chosen - set(candidates))}"
    assert len(chosen) == min(k, len(candidates))
    rest = [scores[j] for j in candidates if j not in chosen]
    if chosen and rest:
        assert min(scores[j] for j in chosen) >= max(rest) - TOL


@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches_naive_reference(decode_step, case, decode_kernels):
    ctx = decode_step
    pool, step, q = ctx["pool"], ctx["step"], ctx["q"]
    P = pool.page_size
    config = OvalConfig(page_size=P, rank=RANK, eta=ETA, **CASES[case])
    out, sel = decode_attention(pool, LAYER, step, q, config, DIM**-0.5)

    slots = (config.sink_pages + config.top_k) * P + max(config.window_max, P)
    assert slots_per_step(config) == slots
    assert sel.positions.shape == sel.valid.shape == (len(LENGTHS), KV_HEADS, slots)  # static T for every row
    sparse_seen = 0
    for row, length in enumerate(LENGTHS):
        sealed = int(step.sealed[row])
        assert sealed == (length - 1) // P  # pages sealed by earlier steps; the open page has no summary
        assert bool(sel.sparse_rows[row]) == (length > slots)
        index_sets = []
        for head in range(KV_HEADS):
            scores = _ref_scores(ctx, config.scorer, row, head, sealed) if length > slots else {}
            index, ref_chosen, window, start = ref_selection(config, scores, length, sealed)
            valid = sel.valid[row, head]
            positions = sel.positions[row, head][valid].tolist()
            assert all(0 <= p < length for p in positions)
            assert len(positions) == len(set(positions)), "a position is gathered twice"
            picked = {int(j) for j in sel.pages[row, head] if j >= 0}
            if length > slots:
                sparse_seen += 1
                candidates = [j for j in range(config.sink_pages, sealed) if j * P < start]
                _check_topk(picked, candidates, scores, config.top_k)
                assert int(sel.window[row, head]) == window
                assert config.window_min <= window <= config.window_max and length - start >= 3
                if picked != set(ref_chosen):  # a near-tie resolved the other way: rebuild the set from picks
                    index = _index_set(config, length, start, picked)
            else:
                assert not picked and index == set(range(length))  # fits the budget: dense and exact
            assert set(positions) == index
            index_sets.append(index)
        expected = ref_attention(q[row], ctx["keys"][row][LAYER, :, :length], ctx["values"][row][LAYER, :, :length],
                                 index_sets, DIM**-0.5)
        torch.testing.assert_close(out[row].double(), expected, atol=TOL, rtol=0)
    assert sparse_seen >= 2 * KV_HEADS  # the long rows really went through selection


def _index_set(config, length, start, chosen):
    P = config.page_size
    index = set(range(min(config.sink_pages * P, start))) | set(range(start, length))
    for j in chosen:
        index |= set(range(j * P, min(j * P + P, start)))
    return index


def test_dense_layer_reads_every_position(decode_step, decode_kernels):
    ctx = decode_step
    pool, step, q = ctx["pool"], ctx["step"], ctx["q"]
    config = OvalConfig(page_size=pool.page_size, top_k=1, window_min=16, window_max=16)
    out, sel = decode_attention(pool, LAYER, step, q, config, DIM**-0.5, dense=True)
    assert sel.pages is None and not bool(sel.sparse_rows.any())
    for row, length in enumerate(LENGTHS):
        full = [set(range(length))] * KV_HEADS
        assert {p for p in sel.positions[row, 0][sel.valid[row, 0]].tolist()} == full[0]
        expected = ref_attention(q[row], ctx["keys"][row][LAYER, :, :length], ctx["values"][row][LAYER, :, :length],
                                 full, DIM**-0.5)
        torch.testing.assert_close(out[row].double(), expected, atol=TOL, rtol=0)


def test_rows_that_fit_the_budget_stay_dense_in_a_mixed_batch():
    """select_positions directly: short rows (even with fewer pages than top_k) attend densely, pick nothing."""
    config = OvalConfig(page_size=16, top_k=4, sink_pages=1, window_min=16, window_max=32)
    slots = slots_per_step(config)  # 5 * 16 + 32 = 112
    lengths = torch.tensor([1, 40, slots, slots + 1, 700])
    sealed = (lengths - 1) // 16
    scores = torch.randn(5, 2, 44, generator=torch.Generator().manual_seed(5))
    sel = select_positions(config, scores, lengths, sealed)
    assert sel.sparse_rows.tolist() == [False, False, False, True, True]
    for row in range(3):
        assert (sel.pages[row] == -1).all()
        valid_positions = sel.positions[row][sel.valid[row]].view(2, -1)
        assert valid_positions.tolist() == [list(range(int(lengths[row])))] * 2
        assert (sel.positions[row][~sel.valid[row]] == 0).all()  # invalid slots gather in bounds
    # Only 2 pages in every table: fewer pages than top_k, every row dense.
    few = select_positions(config, scores[:2, :, :2], lengths[:2], sealed[:2])
    assert few.slots == slots and (few.pages == -1).all() and not few.sparse_rows.any()


def test_peaked_scores_shrink_the_window_and_flat_scores_widen_it():
    config = OvalConfig(page_size=16, top_k=2, sink_pages=1, window_min=8, window_max=64)
    lengths = torch.tensor([800, 800])
    sealed = (lengths - 1) // 16
    scores = torch.zeros(2, 1, 50)
    scores[0, 0, 10] = 1e4  # all the estimated mass on one page
    sel = select_positions(config, scores, lengths, sealed)
    assert sel.window[:, 0].tolist() == [8, 64]
    assert sel.pages[0, 0, 0] == 10


def test_decode_refuses_steps_with_several_new_tokens(decode_step):
    """More than one new token would leave unsealed positions outside the window slots: refuse, never drop."""
    pool = decode_step["pool"]
    config = OvalConfig(page_size=pool.page_size)
    step = pool.prepare(["short", "mid", "long"], [0, 2, 0])  # only indexes; nothing is written or committed
    with pytest.raises(ValueError, match=r"at most one new token per row, got new_tokens=\[0, 2, 0\]"):
        decode_attention(pool, LAYER, step, decode_step["q"], config, DIM**-0.5)
