"""The static step's ops table (oval_edge/sparse/step_ops_table.py): each op's body is chosen once, when the table
is built, from what the kernels take; a step's calls then reach the chosen body with no per-call choice (every
per-call chooser is made to raise here, and the step's ops still run); describe() names the bodies for the startup
report. What each body computes is the parity grid's (tests/test_parity_grid.py)."""

from __future__ import annotations

import pytest
import torch

from oval_edge.config import OvalConfig
from oval_edge.geometry import KVGeometry
from oval_edge.kernels import cpu as native
from oval_edge.kernels.cpu_bound import BoundAttention, BoundGroupedScorer, BoundPageScorer, BoundSelect
from oval_edge.kv.pool import PagePool
from oval_edge.sparse import step_ops, step_ops_table as table_module
from oval_edge.sparse.selection import DecodePlan
from oval_edge.sparse.step_ops_table import step_ops_table

HKV, HEADS, DIM, PAGE, WIDTH = 2, 4, 64, 16, 8
CONFIG = OvalConfig(page_size=PAGE, top_k=2, window_min=20, window_max=20, rank=4, dense_layers=1, group_pages=0)
SCORED = [False, True, True]  # layer 0 dense


def _pool(record: str = "int4", kv_int8: bool = False, kinds=("oval",), group_pages: int = 0) -> PagePool:
    return PagePool(KVGeometry(3, HKV, DIM, PAGE, "float32", kinds, rank=4, record=record, group_pages=group_pages,
                               kv_int8=kv_int8), 24)


def _chosen_per_call(*_, **__):
    raise AssertionError("a kernel was chosen or bound during the step")


def _inputs(pool: PagePool) -> dict:
    """A batch-2 step's inputs (a long row, a short one), the pages it writes staged where the pool is int8."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([WIDTH * PAGE - 5, 30])
    table = torch.stack([torch.arange(WIDTH), torch.arange(WIDTH, 2 * WIDTH)])
    written = table[torch.arange(2), (lengths - 1) // PAGE]
    for page in written.tolist() if pool.int8 is not None else ():
        pool.int8.stage([page], 0, 1, PAGE)
    slots = (written[:, None] * HKV + torch.arange(HKV)) * PAGE + ((lengths - 1) % PAGE)[:, None]
    return {"lengths": lengths, "sealed": (lengths - 1) // PAGE, "table": table, "slots": slots,
            "k": torch.randn(2, HKV, DIM, generator=gen), "v": torch.randn(2, HKV, DIM, generator=gen),
            "q": torch.randn(2, HEADS, DIM, generator=gen)}


def _step(ops, x: dict, layer: int = 1) -> torch.Tensor:
    """One sparse layer of a step through the table: write, score, select, attend -> [2, Hq, D]."""
    ops.write[layer](x["slots"], x["k"], x["v"])
    q = x["q"]
    scores = ops.scores[layer](q.view(2, HKV, HEADS // HKV, DIM), x["table"], x["sealed"])
    plan = DecodePlan(CONFIG, x["lengths"], x["sealed"], WIDTH, HKV, x["table"], static=True)
    flat, valid, _ = ops.select(plan, scores, x["sealed"])
    return ops.attend[layer](q, flat, valid, None)


def _run_step(ops, pool: PagePool) -> torch.Tensor:
    out = _step(ops, _inputs(pool))
    assert out.shape == (2, HEADS, DIM) and bool(out.isfinite().all())
    return out


def test_each_op_is_resolved_when_the_table_is_built(kernels, monkeypatch):
    pool = _pool()
    ops = step_ops_table(pool, CONFIG, WIDTH, HEADS, 0.125, SCORED)
    assert ops.describe() == (f"write: torch index_put, scores: C {kernels.scoring_body} (int4), select: C, "
                              "attend: C")
    assert ops.attends_in_place()

    for owner, name in ((native.NativeKernels, "oval_scores"), (native.NativeKernels, "grouped_scores"),
                        (native.NativeKernels, "attend_slots"), (native.NativeKernels, "select_slots"),
                        (native, "cpu_kernels"), (native, "decode_kernels"), (table_module, "decode_kernels"),
                        (BoundPageScorer, "bind"), (BoundGroupedScorer, "bind"), (BoundAttention, "bind"),
                        (BoundSelect, "bind")):
        monkeypatch.setattr(owner, name, _chosen_per_call)
    _run_step(ops, pool)
    with pytest.raises(ValueError, match="layer 0 is dense, sliding-window or a state layer"):
        ops.scores[0](torch.zeros(1, HKV, 2, DIM), torch.zeros(1, WIDTH, dtype=torch.long), torch.zeros(1))


def test_the_bodies_follow_the_inputs_each_kernel_takes(kernels):
    assert step_ops_table(_pool(), CONFIG, WIDTH, HEADS, 0.125, SCORED, kernels=None).describe() == (
        "write: torch index_put, scores: torch packed (int4), select: torch, attend: torch")
    # soft-capped logits (no kernel takes them), bf16 queries (the C attention takes fp32): torch attention
    capped = step_ops_table(_pool(), CONFIG, WIDTH, HEADS, 0.125, SCORED, softcap=30.0)
    assert capped.describe().endswith("attend: torch") and not capped.attends_in_place()
    assert step_ops_table(_pool(), CONFIG, WIDTH, HEADS, 0.125, SCORED, dtype=torch.bfloat16).describe().endswith(
        "attend: torch")
    int8_pool = _pool(kv_int8=True)
    int8 = step_ops_table(int8_pool, CONFIG, WIDTH, HEADS, 0.125, SCORED)
    assert int8.describe() == f"write: pool.write_rows, scores: C {kernels.scoring_body} (int4), select: C, attend: C"
    quest = OvalConfig(page_size=PAGE, top_k=2, window_min=20, window_max=20, rank=4, scorer="quest", group_pages=0)
    assert "scores: torch (quest)" in step_ops_table(_pool(kinds=("oval", "quest")), quest, WIDTH, HEADS, 0.125,
                                                     SCORED).describe()
    grouped = OvalConfig(page_size=PAGE, top_k=2, window_min=20, window_max=20, rank=4, group_pages=2, top_groups=2)
    grouped_pool = _pool(group_pages=2)
    two_level = step_ops_table(grouped_pool, grouped, WIDTH, HEADS, 0.125, SCORED)
    assert f"scores: C two-level ({kernels.scoring_body})" in two_level.describe()
    adaptive = OvalConfig(page_size=PAGE, top_k=2, window_min=20, window_max=40, rank=4, group_pages=0)
    assert "select: torch" in step_ops_table(_pool(), adaptive, WIDTH, HEADS, 0.125, SCORED).describe()
    for ops, pool in ((int8, int8_pool), (two_level, grouped_pool)):
        _run_step(ops, pool)


def test_a_traced_step_uses_the_operators_and_traces_whole(monkeypatch):
    """Under torch.compile the ops are step_ops' operators, each running the body resolved at build (no
    score_pages / attend_rows choosing inside them), and the step traces as one graph."""
    for name in ("score_pages", "attend_rows"):
        monkeypatch.setattr(step_ops, name, _chosen_per_call)
    pool = _pool(record="float")
    ops = step_ops_table(pool, CONFIG, WIDTH, HEADS, 0.125, SCORED, traced=True)
    assert ops.describe() == ("write: torch.library op, scores: torch.library op (C), select: torch, "
                              "attend: torch.library op (C)")  # each operator runs the body resolved here
    inputs = _inputs(pool)
    got = torch.compile(lambda: _step(ops, inputs), fullgraph=True, backend="eager")()
    assert torch.allclose(got, _step(ops, inputs), atol=1e-6)  # the same step, eager


def test_a_table_for_other_heads_is_refused():
    with pytest.raises(ValueError, match="must be a multiple of the pool's 2 KV heads"):
        step_ops_table(_pool(), CONFIG, WIDTH, 3, 0.125, SCORED)
