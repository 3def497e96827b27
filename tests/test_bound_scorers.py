"""Page scorers with one layer's records bound once (oval_edge/kernels/cpu_bound.py): the static step binds one per
sparse layer when it is built, each scores as the unbound call does, and a call with a query of another shape is
refused with an error instead of reading the records with the wrong strides: the shapes a bound kernel takes are
decided when it is bound (the kernel's own check, probed then: a query group above its MAX_GROUP is refused there,
None), so a call never declines ([R-static-step]; sparse/step_ops_table.py)."""

from __future__ import annotations

import pytest
import torch
from test_grouped_scoring import GROUPED
from test_static_step import engine_for, prefill, tiny_folder  # noqa: F401

from oval_edge.kernels.cpu_check import random_records
from oval_edge.kv.records.group_record import GROUP_NAMES, GROUP_SLOT, group_record, stored_group_record
from oval_edge.kv.records.page_record import layer_records
from oval_edge.sparse.step_ops import page_scores


def test_bound_page_scorer_equals_the_call_and_refuses_other_shapes(kernels):
    gen = torch.Generator().manual_seed(5)
    hkv, group, dim, rank, page_size, pages = 3, 3, 64, 8, 32, 40
    q = torch.randn(2, hkv, group, dim, generator=gen)
    table = torch.stack([torch.randperm(pages, generator=gen)[:24] for _ in range(2)])
    counts = torch.tensor([24, 9])
    for fmt in ("float", "int8", "int4"):
        records = random_records(gen, hkv, pages, rank, dim, page_size, fmt, torch.float32)
        bound = kernels.bind_oval_scores(records, group)
        want = kernels.oval_scores(q, records, table, 0.125, counts)
        assert bound is not None and torch.equal(bound(q, table, 0.125, counts), want)
        for other in (q[:, :2], q[..., :32], q[:, :, :2]):  # two KV heads against three; another D; another G
            with pytest.raises(ValueError, match="was bound for CPU queries"):
                bound(other, table, 0.125)
        assert bound(q, table.float(), 0.125).shape == (2, hkv, 24)  # page indices in another dtype: converted
        assert kernels.bind_oval_scores(records, 33) is None  # above score_kernels.c's MAX_GROUP: refused at bind
    records = random_records(gen, hkv, pages, rank, dim, page_size, "float", torch.float32)
    assert kernels.bind_oval_scores((records[0], records[1], records[2][:, :, :, :16], None), group) is None


def test_bound_grouped_scorer_equals_the_call(kernels):
    gen = torch.Generator().manual_seed(6)
    hkv, group, dim, rank, page_size, pages = 3, 3, 64, 8, 32, 200
    records = random_records(gen, hkv, pages, rank, dim, page_size, "int4", torch.float32)
    slots = pages // 2
    record = group_record(torch.randn(slots * hkv, 256, dim, generator=gen), rank)
    coarse = (*stored_group_record(*(t.view(slots, hkv, *t.shape[1:]) for t in record), torch.bfloat16),
              torch.randint(0, slots, (pages,), generator=gen))
    table = torch.randperm(pages, generator=gen)[:192][None]
    sealed = torch.tensor([150])
    q = torch.randn(1, hkv, group, dim, generator=gen)
    bound = kernels.bind_grouped_scores(coarse, records, 8, 5, group, 192)
    want = kernels.grouped_scores(q, coarse, records, table, sealed, 0.125, 8, 5)
    got = bound(q, table, sealed, 0.125)
    assert torch.equal(got, want) and int((got[0, 0] > float("-inf")).sum()) == 5 * 8 + 6
    with pytest.raises(ValueError, match="was bound for CPU queries"):
        bound(q[:, :1], table, sealed, 0.125)
    assert kernels.bind_grouped_scores((coarse[0].float(), *coarse[1:]), records, 8, 5, group, 192) is None  # mixed
    assert kernels.bind_grouped_scores(coarse, records, 8, 5, group, 40) is None  # 5 groups, 5 kept: not two-level


def test_the_static_step_binds_each_sparse_layer_once(tiny_folder, kernels):  # noqa: F811
    """The engine's step holds its ops table (sparse/step_ops_table.py): a C scorer bound per sparse layer, none
    for the dense ones, scoring as the unbound call of the same layer does."""
    for oval, flat in ((None, True), (GROUPED, False)):
        engine = engine_for(tiny_folder, **({} if oval is None else {"oval": oval}))
        step = engine.static.step_for(1)
        config, scale = engine.runner.config, engine.runner.scale
        assert f"scores: C {'' if flat else 'two-level ('}{kernels.scoring_body}" in step.ops.describe()
        q = torch.randn(1, 2, 2, 32)
        with pytest.raises(ValueError, match="is dense, sliding-window or a state layer"):  # layer 0 is dense: no scorer
            step.ops.scores[0](q, step.page_table, step.sealed)
        prefill(engine, "s", 700)
        step.load(["s"], [5])
        layer = config.dense_layers
        got = step.ops.scores[layer](q, step.page_table, step.sealed)
        if flat:  # the unbound path of the same layer: the pool's records through the op a traced step uses
            want = page_scores(engine.pool, layer, q, step.page_table, step.sealed, scale)
        else:
            summaries, row = engine.pool.summaries, engine.pool.paged_index[layer]
            coarse = tuple(summaries[name][row] for name in GROUP_NAMES) + (summaries[GROUP_SLOT],)
            want = kernels.grouped_scores(q, coarse, layer_records(summaries, row), step.page_table, step.sealed,
                                          scale, config.group_pages, config.top_groups)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
