"""One device's plan: for each page size, the pool `size_pool` buys, what it holds, and what a decode step reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from oval_edge.config import DEFAULT_PREFILL_CHUNK, OvalConfig
from oval_edge.geometry import size_pool
from oval_edge.jetson.modules import ModuleSpec
from oval_edge.units import format_bytes

from .memory import (
    RUNTIME_OVERHEAD, PagePlan, decode_reads, geometry_for, load_peak_bytes,
    reserved_workspace_bytes, target_of, workspace_bytes,
)
from .model import ModelShape
from .weights import WeightBreakdown, weight_bytes


@dataclass(frozen=True)
class PlanRequest:
    quant: str = "nf4"
    context: int = 4096
    batch: int = 1
    page_sizes: tuple[int, ...] = (16, 32, 64, 128)
    oval: OvalConfig = field(default_factory=OvalConfig)
    memory_budget: int | None = None  # the serving process's budget; None: device DRAM - OS reserve
    desktop: bool = False  # OS reserve with the desktop running
    runtime_overhead: int | None = None  # None: RUNTIME_OVERHEAD of the target
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    bandwidth_gbps: float | None = None  # None: the device table's figure

    def __post_init__(self) -> None:
        for name in ("context", "batch", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not self.page_sizes:
            raise ValueError("page_sizes is empty; give at least one of 16, 32, 64, 128")
        for p in self.page_sizes:
            self.oval.replace(page_size=p)  # validates: power of two in range, with the reason


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
    """Plan `shape` on `device`. `budget_bytes` (from a probe) wins over the table's DRAM - OS reserve."""
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
    rows = tuple(_page_plan(shape, request, p, target, weights, budget, overhead, bandwidth, load_peak)
                 for p in request.page_sizes)
    longest = max(((longest_context(shape, request, p, target, weights.total, budget, overhead, weights.layout), p)
                   for p in request.page_sizes), key=lambda t: (t[0], -abs(math.log2(t[1] / 32))))
    return DevicePlan(device, shape, request, weights, budget, source, overhead, bandwidth, load_peak, rows,
                      recommend(rows), longest)


def longest_context(shape: ModelShape, request: PlanRequest, page_size: int, target: str, weights: int,
                    budget: int, overhead: int, layout: str) -> int:
    """Largest context (tokens per sequence, up to the model's) whose `batch` sequences fit the pool that is
    left once the workspace for that context is set aside. Binary search: both needs grow with the context."""
    geometry = geometry_for(shape, request.oval.replace(page_size=page_size), target)

    oval = request.oval.replace(page_size=page_size)

    def fits(tokens: int) -> bool:
        work = max(reserved_workspace_bytes(shape, geometry, target, request.prefill_chunk, tokens),
                   workspace_bytes(shape, oval, geometry, target, tokens, request.batch, request.prefill_chunk,
                                   layout)["total"])
        left = budget - weights - work - overhead
        return left > 0 and left // geometry.bytes_per_page >= request.batch * math.ceil(tokens / page_size)

    low, high = 0, shape.max_context or (1 << 20)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _page_plan(shape: ModelShape, request: PlanRequest, page_size: int, target: str, weights: WeightBreakdown,
               budget: int, overhead: int, bandwidth: float | None, load_peak: int) -> PagePlan:
    oval = request.oval.replace(page_size=page_size)
    geometry = geometry_for(shape, oval, target)
    serve_work = reserved_workspace_bytes(shape, geometry, target, request.prefill_chunk, request.context)
    parts = workspace_bytes(shape, oval, geometry, target, request.context, request.batch, request.prefill_chunk,
                            weights.layout)
    transient = parts["total"]
    # Set aside what the largest step really needs, even where serve's own formula reserves less (it does not
    # count the summaries built when pages are sealed); the written budget is lowered by the difference so that
    # serve, with its formula, allocates the same pages.
    work = max(serve_work, transient)
    try:
        sizing = size_pool(budget, weights.total, geometry, workspace_bytes=work, reserve_bytes=overhead)
        pages, explain = sizing.pages, sizing.explain()
    except ValueError as exc:  # not one page fits: the message carries the minimum for one page
        pages, explain = 0, str(exc)
    per_seq = math.ceil(request.context / page_size)
    needed = request.batch * per_seq
    max_ctx = (pages // request.batch) * page_size
    if shape.max_context:
        max_ctx = min(max_ctx, shape.max_context)
    reads = decode_reads(shape, oval, geometry, request.context, request.batch)
    step_bytes = weights.read_per_decode_step + reads["kv_bytes"] + reads["summary_bytes"]
    tok_s = request.batch * bandwidth * 1e9 / step_bytes if bandwidth else None
    pool = pages * geometry.bytes_per_page
    serving = overhead + weights.total + transient + pool
    return PagePlan(
        page_size=page_size, pages=pages, bytes_per_page=geometry.bytes_per_page, pool_bytes=pool,
        tokens_in_pool=pages * page_size, max_context_per_sequence=max_ctx, fits=pages >= needed and pages > 0,
        pages_needed=needed,
        minimum_budget=weights.total + work + overhead + needed * geometry.bytes_per_page,
        tokens_read_per_step=reads["tokens_per_step"], kv_bytes_read_per_step=reads["kv_bytes"],
        summary_bytes_read_per_step=reads["summary_bytes"], bytes_per_step=step_bytes, decode_tok_s=tok_s,
        workspace_bytes=work, serve_workspace_bytes=serve_work, transient_bytes=transient, seal_bytes=parts["seal"],
        serve_memory_budget=budget - (work - serve_work) - (overhead if target == "cuda" else 0),
        predicted_serving_peak_bytes=serving,
        predicted_peak_bytes=max(serving, load_peak), explain=explain,
    )


def recommend(rows: tuple[PagePlan, ...]) -> PagePlan | None:
    """Among page sizes where the requested context fits: fewest bytes streamed per decode step (the roofline
    order, so it holds when the bandwidth is unknown too), then the longest context, then the page size nearest
    32 (the size the reference fidelity figures were measured at)."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (r.bytes_per_step, -r.max_context_per_sequence, abs(math.log2(r.page_size / 32))))
