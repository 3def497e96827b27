"""One device's plan: for each page size, the pool `size_pool` buys, what it holds, and what a decode step reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from oval_edge.config import DEFAULT_PREFILL_CHUNK, OvalConfig
from oval_edge.pool_sizing import size_pool
from oval_edge.jetson.modules import ModuleSpec
from oval_edge.units import format_bytes

from oval_edge.tools.profile.choice import DEFAULT_SPEED_TOLERANCE, check_speed_tolerance, speed_tie

from .memory import (
    RUNTIME_OVERHEAD, PagePlan, decode_reads, geometry_for, load_peak_bytes,
    reserved_workspace_bytes, target_of, workspace_bytes,
)
from .model import ModelShape
from .step_cost import STEP_COSTS, DeviceStepCost, OpCount
from .weights import WeightBreakdown, resolve_planned_quant, weight_bytes

FORMULA = "tok/s = batch / (bytes per step / bandwidth + fixed cost per step); per sequence: 1 / step"


@dataclass(frozen=True)
class PlanRequest:
    quant: str = "auto"
    context: int = 4096
    batch: int = 1
    page_sizes: tuple[int, ...] = (16, 32, 64, 128)
    oval: OvalConfig = field(default_factory=OvalConfig)
    memory_budget: int | None = None  # the serving process's budget; None: device DRAM - OS reserve
    desktop: bool = False  # OS reserve with the desktop running
    runtime_overhead: int | None = None  # None: RUNTIME_OVERHEAD of the target
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    bandwidth_gbps: float | None = None  # None: the device table's figure
    speed_tolerance: float = DEFAULT_SPEED_TOLERANCE  # predicted steps within this fraction of the fastest tie

    def __post_init__(self) -> None:
        for name in ("context", "batch", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not self.page_sizes:
            raise ValueError("page_sizes is empty; give at least one of 16, 32, 64, 128")
        for p in self.page_sizes:
            self.oval.replace(page_size=p)  # validates: power of two in range, with the reason
        check_speed_tolerance(self.speed_tolerance)


@dataclass(frozen=True)
class PlanChoice:
    """The recommendation rule's outcome (issue #26's rule, by predicted figures): the rows tied for the fastest
    predicted step, the fastest, and the runner-up (the next by the same order)."""

    chosen: PagePlan
    runner_up: PagePlan | None
    fastest: PagePlan
    tied: tuple[PagePlan, ...]
    tolerance: float
    by: str  # what speed was ranked by: the served path's predicted step, or bytes per step


@dataclass(frozen=True)
class DevicePlan:
    device: ModuleSpec
    shape: ModelShape
    request: PlanRequest
    weights: WeightBreakdown
    budget_bytes: int
    budget_source: str
    runtime_overhead: int
    bandwidth_gbps: float | None
    load_peak_bytes: int
    rows: tuple[PagePlan, ...]
    recommended: PagePlan | None
    longest_context: tuple[int, int]  # (largest context that fits at the requested batch, its page size)
    step_cost: DeviceStepCost  # the device kind's fixed-cost figures (step_cost.py)
    op_count: OpCount
    choice: PlanChoice | None = None

    @property
    def fits(self) -> bool:
        return self.recommended is not None and self.recommended.fits

    @property
    def load_exceeds_budget(self) -> bool:
        return self.load_peak_bytes > self.budget_bytes

    def does_not_fit_message(self) -> str:
        best = min(self.rows, key=lambda r: r.minimum_budget)
        r = self.request
        tokens, page = self.longest_context
        if tokens > 0:
            instead = f"; what fits: up to {tokens} tokens per sequence at batch {r.batch} (page_size {page})"
        else:
            instead = f"; not even one page per sequence fits at batch {r.batch}"
        return (
            f"does not fit: {self.shape.name} ({r.quant}) at context {r.context} x batch {r.batch} on "
            f"{self.device.title} needs a memory budget of at least {format_bytes(best.minimum_budget)} "
            f"({best.minimum_budget} bytes, page_size {best.page_size}); the budget is "
            f"{format_bytes(self.budget_bytes)}; weights alone take {format_bytes(self.weights.total)}{instead}"
        )


def plan_device(shape: ModelShape, device: ModuleSpec, request: PlanRequest,
                budget_bytes: int | None = None, budget_source: str | None = None) -> DevicePlan:
    """Plan `shape` on `device`. `budget_bytes` (from a probe) wins over the table's DRAM - OS reserve. quant 'auto' is
    planned as what the loader makes of it for this model (a GGUF's own blocks, or int4)."""
    request = replace(request, quant=resolve_planned_quant(request.quant, shape))
    target = target_of(device.kind)
    weights = weight_bytes(shape, request.quant, target, device.extra.get("cpu_flags", frozenset()))
    overhead = request.runtime_overhead if request.runtime_overhead is not None else RUNTIME_OVERHEAD[target]
    if request.memory_budget is not None:
        budget, source = request.memory_budget, "--memory-budget"
    elif budget_bytes is not None:
        budget, source = budget_bytes, budget_source or "probe"
    else:
        reserve = device.os_reserve(request.desktop)
        budget = device.dram_bytes - reserve
        source = (f"DRAM {format_bytes(device.dram_bytes)} - OS reserve {format_bytes(reserve)} "
                  f"({'desktop' if request.desktop else 'headless'}: {device.reserve_note or 'none'})")
    bandwidth = request.bandwidth_gbps if request.bandwidth_gbps is not None else device.bandwidth_gbps
    load_peak = load_peak_bytes(shape, weights, request.quant, target, overhead)
    rows = tuple(_page_plan(shape, request, p, target, weights, budget, overhead, bandwidth, load_peak, device.kind)
                 for p in request.page_sizes)
    longest = max(((row.max_context_per_sequence, row.page_size) for row in rows),
                  key=lambda t: (t[0], -abs(math.log2(t[1] / 32))))
    choice = recommend(rows, request.speed_tolerance)
    return DevicePlan(device, shape, request, weights, budget, source, overhead, bandwidth, load_peak, rows,
                      choice.chosen if choice else None, longest, STEP_COSTS.for_kind(device.kind),
                      STEP_COSTS.op_count(request.quant), choice)


@dataclass(frozen=True)
class PoolAt:
    """The pool serve builds when it is started for `context` tokens per sequence: the workspace it sets aside
    grows with the context, so the pages it leaves shrink."""

    pages: int
    workspace: int  # set aside: max(serve's formula, the largest step's transient)
    serve_workspace: int  # serve's own formula (geometry.prefill_workspace_bytes + CUDA graphs)
    parts: dict  # the largest step's transients: prefill, decode, seal, total
    explain: str  # size_pool's arithmetic, or its message when not one page fits


def pool_at(shape: ModelShape, request: PlanRequest, page_size: int, target: str, weights: WeightBreakdown,
            budget: int, overhead: int, context: int) -> PoolAt:
    oval = request.oval.replace(page_size=page_size)
    geometry = geometry_for(shape, oval, target)
    serve_work = reserved_workspace_bytes(shape, geometry, target, request.prefill_chunk, context, request.batch)
    parts = workspace_bytes(shape, oval, geometry, target, context, request.batch, request.prefill_chunk,
                            weights.layout)
    # Set aside what the largest step really needs, even where serve's own formula reserves less (it does not
    # count the summaries built when pages are sealed); the written budget is lowered by the difference so that
    # serve, with its formula, allocates the same pages.
    work = max(serve_work, parts["total"])
    try:  # serve's own sizing: sliding layers' rings (max_batch sequences) come out before the full pages
        sizing = size_pool(budget, weights.total, geometry, workspace_bytes=work, reserve_bytes=overhead,
                           ring_sequences=request.batch, state_snapshots=state_snapshots(geometry, request))
        pages, explain = sizing.pages, sizing.explain()
    except ValueError as exc:  # not one page fits: the message carries the minimum for one page
        pages, explain = 0, str(exc)
    return PoolAt(pages, work, serve_work, parts, explain)


def state_snapshots(geometry, request: PlanRequest) -> int:
    """The hybrid's state copies serve keeps for prefix caching (runtime/engine/setup.py's default: 2 x max_batch;
    none without state layers)."""
    return 2 * request.batch if geometry.states is not None else 0


def context_fits(shape: ModelShape, request: PlanRequest, page_size: int, target: str, weights: WeightBreakdown,
                 budget: int, overhead: int, context: int) -> bool:
    """Whether `batch` sequences of `context` tokens fit the pool serve builds for that context: the one test
    behind every "fits" and every longest context that plan prints, writes as JSON or tabulates."""
    pages = pool_at(shape, request, page_size, target, weights, budget, overhead, context).pages
    return pages > 0 and pages >= request.batch * math.ceil(context / page_size)


def longest_context(shape: ModelShape, request: PlanRequest, page_size: int, target: str, weights: WeightBreakdown,
                    budget: int, overhead: int) -> int:
    """Largest context (tokens per sequence, up to the model's) that `context_fits` at this page size. Binary
    search: the workspace and the pages needed both grow with the context, so the test turns false once."""
    low, high = 0, shape.max_context or (1 << 20)
    while low < high:
        mid = (low + high + 1) // 2
        fits = context_fits(shape, request, page_size, target, weights, budget, overhead, mid)
        low, high = (mid, high) if fits else (low, mid - 1)
    return low


def _page_plan(shape: ModelShape, request: PlanRequest, page_size: int, target: str, weights: WeightBreakdown,
               budget: int, overhead: int, bandwidth: float | None, load_peak: int, kind: str) -> PagePlan:
    oval = request.oval.replace(page_size=page_size)
    geometry = geometry_for(shape, oval, target)
    pool_now = pool_at(shape, request, page_size, target, weights, budget, overhead, request.context)
    pages, work, serve_work, transient = pool_now.pages, pool_now.workspace, pool_now.serve_workspace, \
        pool_now.parts["total"]
    # per running sequence: its rings and a hybrid's layer states, plus the state snapshots of prefix caching
    rings = (request.batch + state_snapshots(geometry, request)) * geometry.state_bytes_per_sequence \
        + request.batch * geometry.ring_bytes_per_sequence
    needed = request.batch * math.ceil(request.context / page_size)
    reads = decode_reads(shape, oval, geometry, request.context, request.batch)
    step_bytes = weights.read_per_decode_step + reads["kv_bytes"] + reads["summary_bytes"] + reads["state_bytes"]
    tok_s = request.batch * bandwidth * 1e9 / step_bytes if bandwidth else None
    paths = STEP_COSTS.predict(kind, request.quant, shape.layers, min(oval.dense_layers, shape.layers), step_bytes,
                               bandwidth, request.batch)
    served = next(p for p in paths if p.served)
    pool = pages * geometry.bytes_per_page
    serving = overhead + weights.total + transient + pool + rings
    return PagePlan(
        page_size=page_size, pages=pages, bytes_per_page=geometry.bytes_per_page, pool_bytes=pool,
        tokens_in_pool=pages * page_size,
        max_context_per_sequence=longest_context(shape, request, page_size, target, weights, budget, overhead),
        fits=context_fits(shape, request, page_size, target, weights, budget, overhead, request.context),
        pages_needed=needed,
        minimum_budget=weights.total + work + overhead + rings + needed * geometry.bytes_per_page,
        tokens_read_per_step=reads["tokens_per_step"], kv_bytes_read_per_step=reads["kv_bytes"],
        summary_bytes_read_per_step=reads["summary_bytes"], bytes_per_step=step_bytes, roofline_tok_s=tok_s,
        decode_tok_s=served.tok_s, decode_tok_s_per_sequence=served.tok_s_per_sequence,
        step_cost={"formula": FORMULA, "served": served.path, "paths": [p.as_dict() for p in paths]},
        workspace_bytes=work, serve_workspace_bytes=serve_work, transient_bytes=transient,
        seal_bytes=pool_now.parts["seal"],
        serve_memory_budget=budget - (work - serve_work) - (overhead if target == "cuda" else 0),
        predicted_serving_peak_bytes=serving,
        predicted_peak_bytes=max(serving, load_peak), explain=pool_now.explain, ring_bytes=rings,
    )


def predicted_step_s(row: PagePlan) -> float | None:
    """The served path's predicted step time in seconds (None when the bandwidth is unknown)."""
    served = next(p for p in row.step_cost["paths"] if p["served"])
    return None if served["step_ms"] is None else served["step_ms"] / 1e3


def recommend(rows: tuple[PagePlan, ...], tolerance: float = DEFAULT_SPEED_TOLERANCE) -> PlanChoice | None:
    """Issue #26's rule by predicted figures. Among page sizes where the requested context fits, those whose
    predicted step (the served path's; bytes streamed per step when the bandwidth is unknown, the roofline order)
    is within `tolerance` of the fastest tie; of them, the best predicted quality wins: the most K/V tokens
    attended per step (fidelity rises with the tokens attended: [R-oval-decode], k = 4 -> 8 at page 32 halves the KL;
    plan cannot measure KL, `oval-edge profile` does), then the smaller page (at equal reads smaller pages select
    better: README's profile runs), then the longest context."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return None
    timed = all(predicted_step_s(r) is not None for r in fitting)
    speed = predicted_step_s if timed else (lambda r: float(r.bytes_per_step))
    fastest = min(fitting, key=lambda r: (speed(r), abs(math.log2(r.page_size / 32))))
    tied = speed_tie(fitting, speed, tolerance)
    quality = sorted(tied, key=lambda r: (-r.tokens_read_per_step, r.page_size, -r.max_context_per_sequence))
    rest = sorted((r for r in fitting if r not in tied), key=lambda r: (speed(r), r.page_size))
    order = quality + rest
    return PlanChoice(order[0], order[1] if len(order) > 1 else None, fastest, tuple(quality), tolerance,
                      "predicted step" if timed else "bytes per step")
