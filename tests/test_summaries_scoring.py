"""Sealed page summaries and page scores equal plain loop references ([R-page-score]) within 1e-5.

The pool builds summaries batched over pages x heads x layers when `commit` seals pages; the references below
rebuild them one page and one head at a time in float64. Eigenvectors are only defined up to sign (and rotation
within equal eigenvalues), so the oval basis is compared through sign-invariant quantities: the projector U U^T,
C U^T q, and the scores themselves.
"""

from __future__ import annotations

import pytest
import torch
from oval_reference import (
    make_pool,
    output_metric,
    prefill,
    ref_oval_summary,
    ref_page_score,
    ref_quest_summary,
    structured_kv,
)

from oval_edge.kv.records.summaries import oval_summary
from oval_edge.sparse.scoring import group_queries, score_pages

LAYERS, KV_HEADS, Q_HEADS, DIM, RANK = 2, 3, 9, 64, 4
METRIC = output_metric(LAYERS, KV_HEADS, DIM)  # what make_pool gives the pool as its output projection's G^{1/2}
LENGTHS = (100, 70, 45)  # not page multiples: every sequence also holds an open, unsealed page
TOL = 1e-5


@pytest.fixture(scope="module", params=[(16, 0.0), (16, 0.5), (32, 0.5)], ids=lambda p: f"P{p[0]}-eta{p[1]}")
def sealed_pool(request):
    page_size, eta = request.param
    gen = torch.Generator().manual_seed(1234)
    data = [structured_kv(gen, LAYERS, KV_HEADS, n, DIM) for n in LENGTHS]
    pool = make_pool(LAYERS, KV_HEADS, DIM, page_size, num_pages=24, rank=RANK, eta=eta)
    pool.seal_chunk = 5  # one commit then seals its pages in several batches, as long prompts do
    seq_ids = ["a", "b", "c"]
    # Chunks of 40 tokens across all rows at once: pages of different rows interleave in the pool and are sealed
    # over several commits, so each seal batch mixes sequences.
    prefill(pool, seq_ids, [k for k, _ in data], [v for _, v in data], LENGTHS, chunk=40)
    return pool, seq_ids, data, eta


def _assert_near(actual, expected):
    """Max abs difference <= 1e-5, relative to the values' magnitude when it exceeds 1 (fp32 has ~7 digits)."""
    expected = expected.double()
    error = float((actual.double() - expected).abs().max())
    assert error <= TOL * max(1.0, float(expected.abs().max())), f"max abs diff {error:.3g}"


def _sealed_pages(pool, seq_ids):
    """(row, logical page, physical page) for every sealed page."""
    out = []
    for row, sid in enumerate(seq_ids):
        assert pool.sealed_pages(sid) == pool.length(sid) // pool.page_size
        table = pool.page_table(sid)
        out += [(row, j, table[j]) for j in range(pool.sealed_pages(sid))]
    return out


def _page(data, row, layer, head, logical, page_size):
    keys, values = data[row]
    sl = slice(logical * page_size, (logical + 1) * page_size)
    return keys[layer, head, sl], values[layer, head, sl]


def test_quest_summary_matches_loop_reference(sealed_pool):
    pool, seq_ids, data, _ = sealed_pool
    P = pool.page_size
    for row, logical, phys in _sealed_pages(pool, seq_ids):
        for layer in range(LAYERS):
            for head in range(KV_HEADS):
                kmin, kmax = ref_quest_summary(_page(data, row, layer, head, logical, P)[0])
                torch.testing.assert_close(pool.summaries["kmin"][layer, phys, head].double(), kmin, atol=0, rtol=0)
                torch.testing.assert_close(pool.summaries["kmax"][layer, phys, head].double(), kmax, atol=0, rtol=0)


def test_oval_summary_matches_loop_reference(sealed_pool):
    pool, seq_ids, data, eta = sealed_pool
    P = pool.page_size
    gen = torch.Generator().manual_seed(7)
    checked = 0
    for row, logical, phys in _sealed_pages(pool, seq_ids):
        for layer in range(LAYERS):
            for head in range(KV_HEADS):
                keys, values = _page(data, row, layer, head, logical, P)
                mu_ref, u_ref, c_ref, evals = ref_oval_summary(keys, values, RANK, eta, METRIC[layer, head])
                # The data has a gap after the r-th eigenvalue, so the top-r subspace (B B^T) is well defined.
                assert float(evals[RANK - 1] - evals[RANK]) > 1e-3
                mu = pool.summaries["mean"][layer, head, phys].double()
                u = pool.summaries["basis"][layer, head, phys].double().T  # stored B^T [r, D] -> B [D, r]
                c = pool.summaries["coords"][layer, head, phys].double().T  # stored R^T [r, P] -> R [P, r]
                torch.testing.assert_close(mu, mu_ref, atol=TOL, rtol=0)
                torch.testing.assert_close(u.T @ u, torch.eye(RANK, dtype=torch.float64), atol=TOL, rtol=0)
                torch.testing.assert_close(u @ u.T, u_ref @ u_ref.T, atol=10 * TOL, rtol=0)
                torch.testing.assert_close(c, (keys.double() - mu) @ u, atol=TOL, rtol=0)  # R = X B, stored B
                q = torch.randn(DIM, generator=gen, dtype=torch.float64)
                _assert_near(c @ (u.T @ q), c_ref @ (u_ref.T @ q))
                checked += 1
    assert checked == LAYERS * KV_HEADS * sum(n // P for n in LENGTHS)


def test_eta_zero_ignores_values_and_eta_changes_the_basis():
    """eta=0 is the key-only spectral basis; eta>0 makes the basis depend on the values (output-aware)."""
    gen = torch.Generator().manual_seed(3)
    keys, values = structured_kv(gen, 1, 4, 32, DIM)
    keys, values = keys[0], values[0]  # [4 pages, 32, D]
    other_values = torch.randn(values.shape, generator=gen)
    metric = METRIC[0, :1].expand(4, DIM, DIM)
    _, u0, _ = oval_summary(keys, values, RANK, 0.0)
    _, u0_other, _ = oval_summary(keys, other_values, RANK, 0.0)
    proj = lambda u: u.transpose(-1, -2) @ u  # noqa: E731  (stored B^T [r, D] -> B B^T)
    torch.testing.assert_close(proj(u0), proj(u0_other), atol=TOL, rtol=0)
    # Values that load all their spread on the tokens with small keys pull the output-aware basis away.
    smallest = keys.norm(dim=-1).argsort(dim=-1)[:, :8]  # [4, 8]
    weights = torch.zeros(4, 32, 1).scatter_(1, smallest[..., None], 1.0)
    _, u1, _ = oval_summary(keys, values * weights, RANK, 1.0, metric)
    assert float((proj(u1) - proj(u0)).abs().max()) > 1e-2
    with pytest.raises(ValueError, match="eta > 0 needs the output projection's metric"):
        oval_summary(keys, values, RANK, 0.5)


def test_rank_is_capped_below_page_size():
    """Centred keys of a page span at most P - 1 directions: the pool refuses rank >= page_size."""
    from oval_edge.geometry import KVGeometry

    with pytest.raises(ValueError, match=r"rank=16 is above page_size - 1 = 15"):
        KVGeometry(2, 1, 64, 16, "float32", ("oval",), 16)


@pytest.mark.parametrize("scorer", ["oval", "quest"])
def test_scores_match_loop_reference(sealed_pool, scorer, decode_kernels):
    pool, seq_ids, data, eta = sealed_pool
    P, scale = pool.page_size, DIM**-0.5
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(len(seq_ids), Q_HEADS, DIM, generator=gen)
    step = pool.prepare(seq_ids, [0] * len(seq_ids))  # page tables only: nothing is written
    grouped = group_queries(q, KV_HEADS)  # [B, Hkv, G, D]
    scores = score_pages(scorer, grouped, pool.summaries, 1, step.page_table, scale)
    assert scores.shape == (len(seq_ids), KV_HEADS, step.page_table.shape[1])
    group = Q_HEADS // KV_HEADS
    for row, logical, _ in _sealed_pages(pool, seq_ids):
        for head in range(KV_HEADS):
            keys, values = _page(data, row, 1, head, logical, P)
            queries = q[row, head * group : (head + 1) * group]  # the query heads that share this KV head
            expected = ref_page_score(scorer, queries, keys, values, RANK, eta, scale, METRIC[1, head])
            _assert_near(scores[row, head, logical], torch.tensor(expected))


def test_unknown_scorer_is_a_clear_error(sealed_pool):
    pool, seq_ids, _, _ = sealed_pool
    step = pool.prepare(seq_ids, [0] * len(seq_ids))
    with pytest.raises(ValueError, match=r"scorer='dense' is unknown; allowed: oval, quest"):
        score_pages("dense", torch.zeros(3, KV_HEADS, 3, DIM), pool.summaries, 0, step.page_table, 1.0)
