"""The static step's small CPU kernels (oval_edge/kernels/step_kernels.c) against the torch code they replace:
RMSNorm, and the page selection of a sparse layer (DecodePlan.select), including the per-row bounds the scoring and
attention kernels take for padded page tables."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oval_edge import OvalConfig
from oval_edge.kernels.cpu_check import random_records
from oval_edge.sparse.scoring import record_scores
from oval_edge.sparse.selection import DecodePlan, window_slots


@pytest.mark.parametrize("rows, dim", [(1, 576), (3, 64), (130, 960)])
def test_rms_norm_matches_torch(kernels, rows, dim):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), F.rms_norm(x, (dim,), weight, 1e-5),
                               atol=1e-5, rtol=1e-5)
    assert kernels.rms_norm(x.double(), weight, 1e-5) is None  # other dtypes: the caller keeps torch's op


@pytest.mark.parametrize("page, top_k, sink, window", [(16, 3, 1, 20), (32, 4, 1, 64), (16, 8, 2, 16)])
def test_select_slots_matches_the_plan(kernels, page, top_k, sink, window):
    config = OvalConfig(page_size=page, top_k=top_k, sink_pages=sink, window_min=window, window_max=window)
    gen = torch.Generator().manual_seed(page + top_k)
    slots = config.token_budget
    lengths = torch.tensor([5, slots, slots + 1, 10 * page, 10 * page + 3, 40 * page - 1])  # short rows and long
    sealed = lengths // page
    pages = 48  # padded tables, as the static step's
    table = torch.stack([torch.randperm(500, generator=gen)[:pages] for _ in lengths])
    plan = DecodePlan(config, lengths, sealed, pages, 3, table, static=True)
    scores = torch.randn(len(lengths), 3, pages, generator=gen)
    scores[0, 0, 5:9] = 1.0  # ties: the lower page first, as torch.topk
    want = plan.select(scores, detail=False)
    flat, valid = kernels.select_slots(scores, table, lengths, sealed, plan.start.view(-1, 1), page, sink, top_k,
                                       window_slots(config), window)
    assert torch.equal(valid, want.valid)
    assert torch.equal(flat[valid], want.flat[want.valid])


def test_scores_and_attention_skip_what_the_row_bounds_leave_out(kernels):
    gen = torch.Generator().manual_seed(3)
    hkv, group, dim, rank, page, pool_pages = 2, 3, 64, 4, 16, 12
    q = torch.randn(2, hkv, group, dim, generator=gen)
    records = random_records(gen, hkv, pool_pages, rank, dim, page, "float", torch.float32)
    table = torch.tensor([[3, 1, 4, 0, 0, 0], [5, 9, 2, 6, 11, 7]])  # row 0 padded after 3 pages
    counts = torch.tensor([3, 6])
    got = kernels.oval_scores(q, records, table, 0.125, counts=counts)
    want = record_scores(q, records, table, 0.125)
    torch.testing.assert_close(got[0, :, :3], want[0, :, :3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    assert bool((got[0, :, 3:] < -1e38).all())  # not read: the kernel writes the 'unscored' value
    rows = pool_pages * hkv * page
    k_rows, v_rows = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    flat = torch.randint(0, rows, (2, hkv, 50), generator=gen)
    flat[0, :, 30:] = rows + 7  # out of the pool, but past row 0's limit: never read
    valid = torch.ones(2, hkv, 50, dtype=torch.bool)
    limits = torch.tensor([30, 50])
    got = kernels.attend_slots(q.reshape(2, -1, dim), k_rows, v_rows, flat, valid, 0.125, limits=limits)
    bounded = valid & (torch.arange(50) < limits[:, None, None])
    want = kernels.attend_slots(q.reshape(2, -1, dim), k_rows, v_rows, flat.clamp(max=rows - 1), bounded, 0.125)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
