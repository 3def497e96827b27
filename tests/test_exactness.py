"""Exactness ([R-dense-where-it-pays]): when the token budget covers the sequence, OVAL decode is dense causal
attention, and chunked prefill over the pool is dense causal attention, within 1e-5 in fp32.

The reference is plain float64 softmax(q K^T * scale) V per query head over positions 0..t.
"""

from __future__ import annotations

import pytest
import torch
from oval_reference import make_pool, prefill, structured_kv, write_tokens

from oval_edge import OvalConfig
from oval_edge.sparse.attention import decode_attention
from oval_edge.sparse.prefill import prefill_attention
from oval_edge.sparse.selection import slots_per_step

LAYERS, KV_HEADS, Q_HEADS, DIM = 2, 3, 9, 64
GROUP = Q_HEADS // KV_HEADS
SCALE = DIM**-0.5
TOL = 1e-5


def dense_causal(q, keys, values, position):
    """One token at `position` attending to 0..position. q [Hq, D]; keys/values [Hkv, L, D] -> [Hq, D] float64."""
    out = torch.empty(Q_HEADS, DIM, dtype=torch.float64)
    for head in range(Q_HEADS):
        k = keys[head // GROUP, : position + 1].double()
        v = values[head // GROUP, : position + 1].double()
        out[head] = torch.softmax(SCALE * (k @ q[head].double()), 0) @ v
    return out


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("scorer", ["oval", "quest"])
def test_decode_with_budget_covering_the_context_is_dense(page_size, scorer, decode_kernels):
    lengths = (37, 300, 1000)
    gen = torch.Generator().manual_seed(99 + page_size)
    data = [structured_kv(gen, LAYERS, KV_HEADS, n, DIM) for n in lengths]
    keys, values = [k for k, _ in data], [v for _, v in data]
    pool = make_pool(LAYERS, KV_HEADS, DIM, page_size, num_pages=sum(-(-n // page_size) for n in lengths))
    seq_ids = [0, 1, 2]
    prefill(pool, seq_ids, keys, values, [n - 1 for n in lengths], chunk=256)
    step = write_tokens(pool, seq_ids, keys, values, [1, 1, 1])
    q = torch.randn(3, Q_HEADS, DIM, generator=gen)
    # top_k large enough that every candidate page of the longest row could be selected.
    top_k = -(-max(lengths) // page_size)
    config = OvalConfig(page_size=page_size, top_k=top_k, window_min=16, window_max=64, scorer=scorer)
    assert slots_per_step(config) >= max(lengths)
    for layer in range(LAYERS):
        out, sel = decode_attention(pool, layer, step, q, config, SCALE)
        assert not bool(sel.sparse_rows.any())
        # The oracle path (caller-given page scores) must reach the same answer.
        oracle_scores = torch.randn(3, KV_HEADS, step.page_table.shape[1], generator=gen)
        out_oracle, _ = decode_attention(pool, layer, step, q, config, SCALE, scores=oracle_scores)
        for row, n in enumerate(lengths):
            expected = dense_causal(q[row], keys[row][layer], values[row][layer], n - 1)
            torch.testing.assert_close(out[row].double(), expected, atol=TOL, rtol=0)
            torch.testing.assert_close(out_oracle[row].double(), expected, atol=TOL, rtol=0)


def test_default_config_is_exact_below_its_token_budget(decode_kernels):
    """The shipped defaults: a sequence shorter than the budget decodes exactly, in every layer."""
    config = OvalConfig()
    length = slots_per_step(config)  # exactly the budget: still dense
    gen = torch.Generator().manual_seed(5)
    keys, values = structured_kv(gen, LAYERS, KV_HEADS, length, DIM)
    pool = make_pool(LAYERS, KV_HEADS, DIM, config.page_size, num_pages=-(-length // config.page_size))
    prefill(pool, ["s"], [keys], [values], [length - 1], chunk=100)
    step = write_tokens(pool, ["s"], [keys], [values], [1])
    q = torch.randn(1, Q_HEADS, DIM, generator=gen)
    for layer in range(LAYERS):
        out, sel = decode_attention(pool, layer, step, q, config, SCALE)
        assert sel.slots == length and bool(sel.valid.all())
        torch.testing.assert_close(out[0].double(), dense_causal(q[0], keys[layer], values[layer], length - 1),
                                   atol=TOL, rtol=0)


def _step_kv(keys, values, layer, seq_starts, counts):
    """This step's new keys/values, rows concatenated: -> k, v [N, Hkv, D]."""
    ks = [keys[r][layer, :, s : s + n].transpose(0, 1) for r, (s, n) in enumerate(zip(seq_starts, counts))]
    vs = [values[r][layer, :, s : s + n].transpose(0, 1) for r, (s, n) in enumerate(zip(seq_starts, counts))]
    return torch.cat(ks), torch.cat(vs)


@pytest.mark.parametrize("history", ["split", "mask"])
@pytest.mark.parametrize("page_size", [16, 32])
def test_chunked_prefill_equals_dense_causal(page_size, history, monkeypatch):
    """First chunks attend to themselves; later chunks also read earlier pages from the pool (batched rows).

    Chunk sizes are not page multiples, one step mixes a first chunk with later chunks, and one row sits a step
    out (0 new tokens), so page boundaries fall inside chunks and rows have different offsets. `split`: the CPU
    path (history and chunk attended apart, merged by log-sum-exp); `mask`: the masked-SDPA path other devices take.
    """
    if history == "mask":
        monkeypatch.setattr("oval_edge.sparse.prefill._split_attention_for_cpu", lambda: None)
    plan = [(50, 20, 0), (45, 70, 33), (0, 1, 61), (29, 16, 1)]  # new tokens per step for rows a, b, c
    totals = [sum(step[r] for step in plan) for r in range(3)]
    gen = torch.Generator().manual_seed(17)
    data = [structured_kv(gen, LAYERS, KV_HEADS, n, DIM) for n in totals]
    keys, values = [k for k, _ in data], [v for _, v in data]
    pool = make_pool(LAYERS, KV_HEADS, DIM, page_size, num_pages=sum(-(-n // page_size) for n in totals) + 2)
    seq_ids = ["a", "b", "c"]
    for sid in seq_ids:
        assert pool.allocate(sid, 1) is not None
    queries = [torch.randn(n, Q_HEADS, DIM, generator=gen) for n in totals]
    checked = 0
    for counts in plan:
        starts = [pool.length(sid) for sid in seq_ids]
        step = write_tokens(pool, seq_ids, keys, values, list(counts))
        q = torch.cat([queries[r][s : s + n] for r, (s, n) in enumerate(zip(starts, counts))])
        for layer in range(LAYERS):
            k_new, v_new = _step_kv(keys, values, layer, starts, counts)
            out = prefill_attention(pool, layer, step, q, k_new, v_new, SCALE)
            offset = 0
            for row, (start, n) in enumerate(zip(starts, counts)):
                for i in range(n):
                    expected = dense_causal(q[offset + i], keys[row][layer], values[row][layer], start + i)
                    torch.testing.assert_close(out[offset + i].double(), expected, atol=TOL, rtol=0)
                    checked += 1
                offset += n
        pool.commit(step)
    assert checked == LAYERS * sum(totals)
