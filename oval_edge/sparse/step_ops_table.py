"""The static decode step's kernel ops, resolved once per step ([R-static-step]): one small table of bodies.

Why: the step used to ask per call and per layer which kernel runs (a bound C scorer that could return None, the
Triton kernels that could return None, a torch scorer for some record formats, else the torch ops), up to eight
hops for one score. Here each op's body is chosen when the step is built, from what the kernels declare they take
(record format, dtypes, head dim, page size, K/V storage, device) through their own checks run once
(kernels/cpu_bound.py probes the C kernels with the step's shapes; TritonKernels.bind_* check the tensors), and
the step calls the chosen body directly. A body never returns None; `describe()` names them for the startup report.

    write[layer](slots [B, Hkv], k_new, v_new [B, Hkv, D])                      store one step's K/V
    scores[layer](q [B, Hkv, G, D], page_table [B, W], sealed [B]) -> [B, Hkv, W] fp32
                   flat (sealed bounds the pages read; later pages are no candidates, their value unspecified)
                   or two-level (grouped.py: -inf outside the pages scored finely); oval or quest
    select(plan, scores, sealed) -> (flat, valid [B, Hkv, T], window [B, Hkv])  the pages a sparse layer reads
    attend[layer](q [B, Hq, D], flat, valid, limits [B] | None) -> [B, Hq, D]   exact attention over them

Under torch.compile the bodies are step_ops.py's torch.library operators (traced=True), as [R-static-step] says,
each told which body (OP_BODIES) the table resolved for its layer, so it does not choose per call either.
Bodies by device: C (kernels/cpu.py; the SIMD body its build has) on a CPU, Triton (kernels/gpu.py) on CUDA, torch
where neither takes the inputs. tests/test_parity_grid.py checks every body against an fp64 reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from oval_edge.kernels.cpu import NativeKernels, decode_kernels
from oval_edge.kernels.gpu import TritonKernels
from oval_edge.kv.records.group_record import layer_coarse
from oval_edge.kv.records.page_record import LayerRecords, Rotations, layer_records

from . import step_ops
from .attention import torch_attend
from .step_ops import OP_BODIES
from .grouped import grouped_reference, uses_groups
from .packed_scores import PackedScorer
from .scoring import quest_scores, record_scores
from .selection import DecodePlan, window_slots

Body = tuple[str, Callable]  # (name for describe(), the callable)
OPS = ("write", "scores", "select", "attend")


@dataclass(frozen=True)
class StepOps:
    """One step's op bodies: write, scores, attend per model layer (tuples indexed by layer), select once."""

    write: tuple[Callable, ...]
    scores: tuple[Callable, ...]
    select: Callable
    attend: tuple[Callable, ...]
    names: tuple[tuple[str, str], ...]  # (op, body name), one per distinct pair, in OPS order

    def describe(self) -> str:
        """'write: torch index_put, scores: C avx2 + avx512 int4 (int4), select: C, attend: C' (startup report)."""
        by_op = {op: [name for o, name in self.names if o == op] for op in OPS}
        return ", ".join(f"{op}: {' / '.join(names)}" for op, names in by_op.items() if names)

    def attends_in_place(self) -> bool:
        """Whether every layer's attention reads the selected rows in place (the kernels), not a gathered copy
        (torch): what a step's statistics count as K/V read (StaticDecoder.read_stats)."""
        return {name for op, name in self.names if op == "attend"} <= {"C", "Triton"}


def flat_scores(kernels, records: LayerRecords, group: int, scale: float, rotation: torch.Tensor | None = None,
                packed: PackedScorer | None = None) -> Body:
    """oval scores of one layer's records: (q [B, Hkv, G, D], page_table [B, W], counts [B]) -> [B, Hkv, W]."""
    fmt = "int4" if records.basis.dtype == torch.uint8 else "int8" if records.basis.dtype == torch.int8 else "float"
    if isinstance(kernels, NativeKernels):
        bound = kernels.bind_oval_scores(records, group)
        if bound is not None:
            return f"C {kernels.scoring_body} ({fmt})", lambda q, table, counts: bound(q, table, scale, counts)
    if isinstance(kernels, TritonKernels):
        bound = kernels.bind_oval_scores(records, rotation)
        if bound is not None:
            return f"Triton ({fmt})", lambda q, table, counts: bound(q, table, scale, counts)
    if packed is not None and packed.takes(records):
        return "torch packed (int4)", lambda q, table, counts: packed(q, records, table)
    return f"torch ({fmt})", lambda q, table, counts: record_scores(q, records, table, scale)


def two_level_scores(kernels, summaries: dict, row: int, group_pages: int, top_groups: int, group: int,
                     width: int, scale: float, fine: Body) -> Body:
    """Two-level oval scores (grouped.py) of pool layer `row`: (q, page_table [B, width], sealed) -> [B, Hkv,
    width]; fine: flat_scores' body for the same records (the fine level where no C kernel does both)."""
    if isinstance(kernels, NativeKernels):
        bound = kernels.bind_grouped_scores(layer_coarse(summaries, row), layer_records(summaries, row),
                                            group_pages, top_groups, group, width)
        if bound is not None:
            return f"C two-level ({kernels.scoring_body})", lambda q, table, sealed: bound(q, table, sealed, scale)
    name, score = fine

    def scores(q: torch.Tensor, table: torch.Tensor, sealed: torch.Tensor) -> torch.Tensor:
        return grouped_reference(q, summaries, row, table, sealed, scale, group_pages, top_groups,
                                 lambda fine_table, counts: score(q, fine_table, counts))

    return f"two-level torch over {name}", scores


def quest_page_scores(kernels, kmin: torch.Tensor, kmax: torch.Tensor, scale: float) -> Body:
    """Quest scores of one layer's kmin, kmax [pages, Hkv, D]: (q, page_table, counts) -> [B, Hkv, W]."""
    if isinstance(kernels, TritonKernels):  # the C kernels have none for quest
        bound = kernels.bind_quest_scores(kmin, kmax)
        if bound is not None:
            return "Triton (quest)", lambda q, table, counts: bound(q, table, scale, counts)

    def scores(q: torch.Tensor, table: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        flat = table.reshape(-1)
        lo, hi = (t.index_select(0, flat).view(*table.shape, *t.shape[1:]) for t in (kmin, kmax))
        return quest_scores(q, lo, hi, scale)

    return "torch (quest)", scores


def slot_attention(kernels, k_rows: torch.Tensor, v_rows: torch.Tensor, scales, kv_heads: int, group: int,
                   scale: float, softcap: float, dtype: torch.dtype) -> Body:
    """Attention over one layer's rows [rows, D]: (q [B, Hq, D] in dtype, flat, valid, limits) -> [B, Hq, D].
    The kernels take no soft-cap (Gemma 2), and the C one fp32 queries only."""
    if not softcap and isinstance(kernels, NativeKernels) and dtype == torch.float32:
        bound = kernels.bind_attend(k_rows, v_rows, scales, kv_heads, group)
        if bound is not None:
            return "C", lambda q, flat, valid, limits: bound(q, flat, valid, scale, limits)
    if not softcap and isinstance(kernels, TritonKernels):
        bound = kernels.bind_attend(k_rows, v_rows, scales)
        if bound is not None:
            return "Triton", lambda q, flat, valid, limits: bound(q, flat, valid, scale, limits)
    return "torch", lambda q, flat, valid, limits: torch_attend(q, k_rows, v_rows, flat, valid, scale, limits,
                                                               softcap, scales)


def page_selection(kernels, config, kv_heads: int, width: int) -> Body:
    """The sparse layers' selection: (plan, scores [B, Hkv, width], sealed) -> (flat, valid, window). The C kernel
    takes a fixed window only; the torch body is DecodePlan.select."""
    if isinstance(kernels, NativeKernels) and config.window_min == config.window_max:
        bound = kernels.bind_select(kv_heads, width, config.page_size, config.sink_pages, config.top_k,
                                    window_slots(config), config.window_min)
        if bound is not None:
            def select(plan: DecodePlan, scores: torch.Tensor, sealed: torch.Tensor):
                flat, valid = bound(scores, plan.page_table, plan.lengths, sealed, plan.start.view(plan.batch, 1))
                return flat, valid, plan.window

            return "C", select

    def select(plan: DecodePlan, scores: torch.Tensor, sealed: torch.Tensor):
        chosen = plan.select(scores, detail=False)
        return chosen.flat, chosen.valid, chosen.window

    return "torch", select


def row_write(pool, layer: int) -> Body:
    """Store k_new, v_new [B, Hkv, D] at the rows slots [B, Hkv] of model layer `layer`: a float pool without a
    page store writes them as they are (strided slices of the fused projection included: one index_put_ each,
    where flattening them for index_copy_ copies each first); int8 rows and a page store go through the pool."""
    if pool.scale_rows[layer] is None and pool.store is None:
        k_rows, v_rows = pool.k_rows[layer], pool.v_rows[layer]

        def write(slots: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
            for rows, new in ((k_rows, k_new), (v_rows, v_new)):
                rows.index_put_((slots,), new if new.dtype == rows.dtype else new.to(rows.dtype))

        return "torch index_put", write
    return "pool.write_rows", lambda slots, k_new, v_new: pool.write_rows(layer, slots.reshape(-1), k_new, v_new)


def _not_scored(layer: int) -> Callable:
    def refuse(*_):
        raise ValueError(f"layer {layer} is dense, sliding-window or a state layer: the step's table has no such op "
                         "for it")
    return refuse


def _op_body(name: str) -> int:
    """The OP_BODIES index of a resolved body's name ("C avx2 (int4)" -> "C"): what a traced step's operator runs."""
    return OP_BODIES.index(next((kind for kind in OP_BODIES[1:] if name.startswith(kind)), "torch"))


def _traced_write(pool, layer: int) -> Body:
    return "torch.library op", lambda slots, k, v: step_ops.write_kv(pool, layer, slots, k, v)


def _traced_attend(pool, layer: int, scale: float, softcap: float, name: str) -> Body:
    body = _op_body(name)
    return f"torch.library op ({name})", lambda q, flat, valid, limits: step_ops.attend_slots(
        pool, layer, q, flat, valid, limits, scale, softcap, body)


def _traced_scores(pool, layer: int, scale: float, name: str) -> Body:
    body = _op_body(name)
    return f"torch.library op ({OP_BODIES[body]})", lambda q, table, counts: step_ops.page_scores(
        pool, layer, q, table, counts, scale, body)


def step_ops_table(pool, config, width: int, heads: int, scale: float, scored: list[bool], softcap: float = 0.0,
                   dtype: torch.dtype = torch.float32, traced: bool = False, kernels="device",
                   rotations: Rotations | None = None) -> StepOps:
    """The ops of a static step over `pool` with page tables `width` wide, resolved once.

    config: the engine's OvalConfig; heads: query heads Hq (G = Hq / Hkv); scale, softcap: the attention's;
    scored[layer]: whether model layer `layer` selects pages (neither dense nor sliding); dtype: the queries'
    (activations') dtype; traced: the step runs under torch.compile (the bodies are step_ops' operators);
    kernels: decode_kernels(pool.device) unless given (a NativeKernels of another SIMD body, TritonKernels, or
    None for the torch ops: the parity grid); rotations: the owner's int4 rotation cache (page_record.Rotations)."""
    g = pool.geometry
    hkv = g.kv_heads
    if heads % hkv or len(scored) != len(pool.paged_index):
        raise ValueError(f"heads={heads} must be a multiple of the pool's {hkv} KV heads and scored must list "
                         f"{len(pool.paged_index)} layers (got {len(scored)})")
    group = heads // hkv
    kernels = decode_kernels(pool.device) if kernels == "device" else kernels
    rotations = rotations if rotations is not None else Rotations()
    rotation = rotations.get(g.head_dim, pool.device) if g.record == "int4" else None
    packed = PackedScorer(g.head_dim, scale, pool.device, rotations) if g.record == "int4" else None
    two_level = config.scorer == "oval" and uses_groups(width, config.group_pages, config.top_groups)
    chosen: dict[str, list[Body]] = {op: [] for op in ("write", "scores", "attend")}
    for layer, row in enumerate(pool.paged_index):
        if pool.k_rows[layer] is None:  # a hybrid model's state layer: no K/V, nothing to write, score or attend
            for op in chosen:
                chosen[op].append(("", _not_scored(layer)))
            continue
        attention = slot_attention(kernels, pool.k_rows[layer], pool.v_rows[layer], pool.scale_rows[layer], hkv,
                                   group, scale, softcap, dtype)
        chosen["write"].append(_traced_write(pool, layer) if traced else row_write(pool, layer))
        chosen["attend"].append(_traced_attend(pool, layer, scale, softcap, attention[0]) if traced else attention)
        if not scored[layer]:
            chosen["scores"].append(("", _not_scored(layer)))
        elif config.scorer == "quest":
            chosen["scores"].append(quest_page_scores(None if traced else kernels, pool.summaries["kmin"][row],
                                                      pool.summaries["kmax"][row], scale))
        else:
            fine = flat_scores(kernels, layer_records(pool.summaries, row), group, scale, rotation, packed)
            fine = _traced_scores(pool, layer, scale, fine[0]) if traced else fine
            chosen["scores"].append(two_level_scores(None if traced else kernels, pool.summaries, row,
                                                     config.group_pages, config.top_groups, group, width, scale,
                                                     fine) if two_level else fine)
    if traced:  # the compiler fuses the selection's torch ops itself
        kernels = None
    select = page_selection(kernels, config, hkv, width)
    names = [(op, name) for op in OPS for name, _ in ([select] if op == "select" else chosen[op]) if name]
    return StepOps(write=tuple(body for _, body in chosen["write"]),
                   scores=tuple(body for _, body in chosen["scores"]), select=select[1],
                   attend=tuple(body for _, body in chosen["attend"]), names=tuple(dict.fromkeys(names)))
