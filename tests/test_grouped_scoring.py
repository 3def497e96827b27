"""Two-level page scoring (oval_edge/sparse/grouped.py, oval_edge/kv/records/group_record.py): the coarse record bounds its
group's logits, the pool builds it when a group's last page seals (keyed by that page), two-level scores equal the
flat ones on every page they keep, and the static step runs it with no host sync and the eager forward's logits."""

from __future__ import annotations

import pytest
import torch
from eager_decode import eager_decode
from test_static_step import engine_for, prefill, static_equals_eager, tiny_folder, traced_step  # noqa: F401

from oval_edge import OvalConfig
from oval_edge.geometry import SLOTS_PER_GROUP, KVGeometry
from oval_edge.kv.records.group_record import GROUP_NAMES, GROUP_SLOT, group_record, stored_group_record
from oval_edge.kernels.cpu_check import random_records
from oval_edge.kv.pool import PagePool
from oval_edge.sparse.grouped import coarse_scores, grouped_reference, uses_groups
from oval_edge.sparse.scoring import record_scores, score_pages

GROUPED = OvalConfig(page_size=16, top_k=4, window_min=32, window_max=32, dense_layers=1, kv_dtype="float32",
                     group_pages=4, top_groups=2, two_level_from=0)


def test_config_and_geometry_validate_groups():
    with pytest.raises(ValueError, match="group_pages"):
        OvalConfig(group_pages=1)
    assert OvalConfig(group_pages=8, scorer="quest").group_pages == 0  # coarse records are oval's: quest is flat
    with pytest.raises(ValueError, match="top_groups"):
        OvalConfig(group_pages=8, top_groups=0)
    flat = KVGeometry(2, 3, 64, 32, "bfloat16", rank=4)
    grouped = KVGeometry(2, 3, 64, 32, "bfloat16", rank=4, group_pages=16)
    # mean and box in bf16, the basis int8 with an fp32 scale per row
    assert grouped.group_record_bytes() == (64 + 8) * 2 + 4 * 64 + 4 * 4 and flat.group_record_bytes() == 0
    # a page's share of the coarse slots (2 per 16 pages, every layer and KV head) and its entry in the slot map
    assert grouped.summary_bytes_per_page == flat.summary_bytes_per_page + -(-2 * 2 * 3 * 416 // 16) + 8
    # 256 pages = 16 groups: 16 coarse records + the fine records of 8 + 1 groups, against 256 fine records
    assert flat.scoring_bytes(256, 8) == 256 * flat.summary_bytes_per_head()
    assert grouped.scoring_bytes(256, 8) == 16 * grouped.group_record_bytes() + 144 * grouped.summary_bytes_per_head()
    assert grouped.scoring_bytes(128, 8) == 128 * grouped.summary_bytes_per_head()  # 8 groups: flat
    assert not uses_groups(128, 16, 8) and uses_groups(144, 16, 8) and not uses_groups(4096, 0, 8)


def test_two_levels_are_off_where_no_sequence_could_use_them(tiny_folder):
    """A model whose longest sequence holds at most top_groups complete groups scores flat anyway: its config drops
    the groups, so its pool keeps no coarse record slots (their bytes go to pages)."""
    config = OvalConfig(group_pages=16, top_groups=8, two_level_from=0)  # past 8 groups of 16 pages of 32 tokens
    assert config.for_context(8 * 16 * 32).group_pages == 0 and config.for_context(8 * 16 * 32 + 1) is config
    crossover = OvalConfig()  # the default: flat up to the measured crossover, so the bundled 8k model scores flat
    assert crossover.for_context(8192).group_pages == 0 and crossover.for_context(32768).group_pages == 16
    with pytest.raises(ValueError, match="two_level_from"):
        OvalConfig(two_level_from=-1)
    assert OvalConfig(group_pages=0).for_context(10**6).group_pages == 0
    short = engine_for(tiny_folder, oval=GROUPED, max_model_len=2 * 4 * 16)  # 2 groups of 4 pages of 16 tokens
    assert short.oval.group_pages == 0 and "group_mean" not in short.pool.summaries
    long = engine_for(tiny_folder, oval=GROUPED)
    assert long.oval.group_pages == 4 and "group_mean" in long.pool.summaries


def test_full_rank_coarse_record_bounds_every_logit_of_its_group():
    torch.manual_seed(0)
    keys = torch.randn(5, 128, 16) * torch.linspace(0.2, 3.0, 16)  # 5 groups of 128 tokens, D = 16
    mean, basis_t, bounds = group_record(keys, rank=16)
    q = torch.randn(5, 1, 1, 16)  # one query head per "row"
    for n in range(5):
        got = coarse_scores(q[n : n + 1], mean[n : n + 1, None, None], basis_t[n : n + 1, None, None],
                            bounds[n : n + 1, None, None],
                            scale=1.0)  # [1, 1, 1]
        true_max = (keys[n] @ q[n, 0, 0]).max()
        assert got.item() >= true_max.item() - 1e-4
    # rank 4 of 16: still a box around the kept coordinates; the basis is orthonormal
    _, basis4, bounds4 = group_record(keys, rank=4)
    torch.testing.assert_close(basis4 @ basis4.transpose(1, 2), torch.eye(4).expand(5, 4, 4), atol=1e-4, rtol=0)
    assert bool((bounds4[:, 0] <= bounds4[:, 1]).all())


def _filled_pool(pages: int, group_pages: int = 4) -> tuple[PagePool, list[int]]:
    geometry = KVGeometry(2, 2, 16, 16, "float32", rank=4, group_pages=group_pages)
    pool = PagePool(geometry, 64)
    assert pool.allocate("s", pages * 16 + 5) is not None
    torch.manual_seed(1)
    for _ in range(2):  # two writes: a group seals in the middle of one and at the end of another
        n = pages * 8 if _ == 0 else pages * 8 + 5
        step = pool.prepare(["s"], [n])
        for layer in range(2):
            pool.write(layer, step, torch.randn(2, n, 2, 16)[layer], torch.randn(2, n, 2, 16)[layer])
        pool.commit(step)
    return pool, pool.page_table("s")


def test_the_pool_builds_each_group_record_when_its_last_page_seals():
    pool, table = _filled_pool(pages=18)  # 18 sealed pages: groups 0..3 complete, 2 pages in the unfinished one
    assert pool.sealed_pages("s") == 18
    g = pool.geometry
    for j in range(4):
        group = table[j * 4 : (j + 1) * 4]
        keys = pool.k[:, group].permute(0, 2, 1, 3, 4).reshape(-1, 4 * 16, 16)  # [L*Hkv, T, D]
        mean, basis_t, bounds = group_record(keys, g.rank)
        slot = int(pool.group_slots.slot_of[group[-1]])
        assert slot >= 0
        torch.testing.assert_close(pool.summaries["group_mean"][:, slot].reshape(-1, 16), mean, atol=1e-5, rtol=0)
        torch.testing.assert_close(pool.summaries["group_bounds"][:, slot].reshape(-1, 2, 4), bounds,
                                   atol=1e-4, rtol=1e-4)
    assert int(pool.group_slots.slot_of[table[17]]) == -1  # the unfinished group has no record yet
    # the pool holds 2 record slots per 4 pages, not one a page
    assert pool.summaries["group_mean"].shape[1] == SLOTS_PER_GROUP * 64 // 4 and pool.group_slots.used == 4
    pool.check_invariants()


def test_two_level_scores_equal_flat_scores_on_every_page_they_keep(decode_kernels):
    pool, table = _filled_pool(pages=30)  # 7 complete groups of 4, then 2 sealed pages
    page_table = torch.tensor([table[:31]])
    sealed = torch.tensor([30])
    q = torch.randn(1, 2, 2, 16)  # [B, Hkv, G, D]
    flat = score_pages("oval", q, pool.summaries, 1, page_table, 0.25)
    two = score_pages("oval", q, pool.summaries, 1, page_table, 0.25, sealed=sealed, groups=(4, 2))
    kept = two[0, 0] > float("-inf")
    assert bool((kept == (two[0, 1] > float("-inf"))).all())  # one choice of pages per row, shared by KV heads
    assert int(kept.sum()) == 2 * 4 + 2  # two groups of 4 and the unfinished group's 2 sealed pages
    assert bool(kept[28:30].all()) and not bool(kept[30])  # the unfinished group; the open page is never kept
    torch.testing.assert_close(two[..., kept], flat[..., kept], atol=1e-5, rtol=0)
    # the groups kept are those with the highest coarse mass over the row's KV heads
    fine_calls = []
    grouped_reference(q, pool.summaries, 1, page_table, sealed, 0.25, 4, 2,
                   lambda t, n: fine_calls.append(t) or torch.zeros(1, 2, t.shape[1]))
    assert fine_calls[0].shape == (1, 3 * 4)
    # with room for every complete group, two levels are flat scoring on the sealed pages
    wide = score_pages("oval", q, pool.summaries, 1, page_table, 0.25, sealed=sealed, groups=(4, 7))
    torch.testing.assert_close(wide[..., :30], flat[..., :30], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt,dtype", [("float", torch.float32), ("float", torch.bfloat16), ("int8", torch.float32),
                                       ("int4", torch.float32)])
def test_native_two_level_kernel_equals_the_torch_reference(kernels, fmt, dtype):
    """group_kernels.c: the same pages kept and the same scores as grouped.grouped_scores, rows with more complete
    groups than top_groups (a choice) and with fewer (every complete group), coarse records in fp32 and bf16."""
    gen = torch.Generator().manual_seed(3)
    hkv, group, dim, rank, page_size, pages = 3, 3, 64, 8, 32, 300
    records = random_records(gen, hkv, pages, rank, dim, page_size, fmt, dtype)
    slots = pages // 2
    record = group_record(torch.randn(slots * hkv, 256, dim, generator=gen), rank)
    coarse = stored_group_record(*(t.view(slots, hkv, *t.shape[1:]) for t in record), dtype)  # [slots, Hkv, ...]
    page_table = torch.stack([torch.randperm(pages, generator=gen)[:256] for _ in range(3)])  # [B, Np]
    slot_of = torch.randint(0, slots, (pages,), generator=gen)
    slot_of[page_table[0, 3 * 8 - 1]] = -1  # row 0's group 2 has no record: kept whatever the others bound
    coarse = (*coarse, slot_of)
    summaries = {**{name: t[None] for name, t in zip(GROUP_NAMES, coarse)}, GROUP_SLOT: slot_of}
    sealed = torch.tensor([250, 61, 19])  # 31, 7 and 2 complete groups of 8; top 5
    q = torch.randn(3, hkv, group, dim, generator=gen)
    want = grouped_reference(q, summaries, 0, page_table, sealed, 0.125, 8, 5,
                          lambda t, n: record_scores(q, records, t, 0.125))
    got = kernels.grouped_scores(q, coarse, records, page_table, sealed, 0.125, 8, 5)
    kept = want > float("-inf")
    assert torch.equal(got > float("-inf"), kept) and bool(kept[0, :, 16:24].all())
    assert kept.sum(-1).tolist() == [[5 * 8 + 2] * 3, [5 * 8 + 5] * 3, [2 * 8 + 3] * 3]
    torch.testing.assert_close(got[kept], want[kept], atol=1e-5, rtol=1e-5)


def test_static_two_level_step_has_no_host_sync_and_equals_the_eager_forward(tiny_folder, decode_kernels,
                                                                               monkeypatch):
    static, eager = engine_for(tiny_folder, oval=GROUPED), engine_for(tiny_folder, oval=GROUPED)
    lengths = (20, 300, 700)  # a dense row and two with more complete groups (4 pages) than top_groups (2)
    seq_ids = [f"r{i}" for i in range(len(lengths))]
    for engine in (static, eager):
        for seq_id, length in zip(seq_ids, lengths):
            prefill(engine, seq_id, length, seed=length)
    first = traced_step(static, seq_ids, [1, 2, 3], monkeypatch)
    assert first.host_reads == [] and first.device_copies == []
    step = eager.pool.prepare(seq_ids, [1, 1, 1])
    eager_decode(eager.runner, step, torch.tensor([1, 2, 3]))
    eager.pool.commit(step)
    static_equals_eager(static, eager, seq_ids, 20)  # crosses a page boundary and seals a group (700 + 20 > 704)
    static.pool.check_invariants()
