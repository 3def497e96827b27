"""The fixed cost of one decode step per device kind, beside the bytes it streams, with the source of every figure.

A decode step is not only bytes / bandwidth: it dispatches ~1,300 ops (SmolLM2, 30 layers), and each costs host
time (Python, torch's dispatcher, the driver's launch) and, on a GPU, a gap between kernels; the step also packs
its inputs, reads one result back and samples. For SmolLM2-135M on an Orin Nano 8GB bytes alone predict 519 tok/s
where llama.cpp measures ~165 on the faster Orin Nano Super (issue #19). So plan predicts

    step = bytes per step / bandwidth + fixed cost;  tok/s = batch / step (aggregate), 1 / step per sequence

with the fixed cost of the path the server runs on that device:

    static eager, CPU:  ops x op_host + step_host            (one CPU dispatches and computes, in turn)
    eager, CUDA:        max(ops x op_host, bytes/bw + ops x node_gpu) - bytes/bw + step_host
                        (launches are asynchronous: the longer of the host's launching and the GPU's work sets it)
    graphed, CUDA:      graph_launch + ops x node_gpu + step_host   (one CUDA-graph replay, runtime/engine/forward/cuda_graph.py)

ops = base + per_dense_layer x dense layers + per_sparse_layer x sparse layers, counted with OpTrace on the static
step (tools/plan/step_probe.py; it reproduces docs/static-step.md's 1,333 ops for SmolLM2 at 30 layers). On CUDA
the kernel count is taken equal to that op count (an estimate until `make gpu-check` counts launches there).
Every figure says whether it was measured (here or by the cited source) or is an estimate, and where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

MEASURED, ESTIMATE = "measured", "estimate"
GRAPHED, EAGER, STATIC_EAGER = "graphed", "eager", "static eager"
PROBE = "this repo: .venv/bin/python -m oval_edge.tools.plan.step_probe --steps 300 (2-core AMD EPYC x86-64, 1 thread)"
OCANNL = "https://github.com/ahrefs/ocannl/issues/488"  # N no-op kernels launched vs replayed, RTX 5070 Ti Laptop
REALIZAR = "https://github.com/paiml/realizar/issues/121"  # per-token timing of a CUDA-graph decode on an Orin Nano
SMOLHUB = "https://www.smolhub.com/posts/jetson-nano-super-benchmark-non-reasoning/"  # llama.cpp on Orin Nano Super
# Host-speed ratio of an Orin's Cortex-A78AE (1.5 GHz on the Orin Nano 8GB, Jetson Orin Nano Series data sheet) to
# this machine's Zen 4 EPYC (2.6 GHz, /proc/cpuinfo): the clock ratio 1.7 times ~1.3 for the wider core. An estimate.
ORIN_HOST_SLOWDOWN = 2.25


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    kind: str  # MEASURED or ESTIMATE
    source: str  # a URL, or "this repo: <command>", with how the value follows from it

    def __post_init__(self) -> None:
        if self.kind not in (MEASURED, ESTIMATE):
            raise ValueError(f"Figure kind {self.kind!r} must be {MEASURED!r} or {ESTIMATE!r}")
        if not self.value >= 0:
            raise ValueError(f"Figure value {self.value!r} must be a number >= 0")
        if not self.source.strip():
            raise ValueError("a Figure needs its source: a URL or 'this repo: <command>'")

    def as_dict(self) -> dict:
        return {"value": self.value, "unit": self.unit, "kind": self.kind, "source": self.source}

    def label(self) -> str:
        return f"{self.value:g} {self.unit} ({self.kind})"


@dataclass(frozen=True)
class OpCount:
    """Ops dispatched by one static decode step, affine in the layer count (the same at every context and batch
    of a bucket: tests/test_static_step.py)."""

    quant: str
    base: Figure
    per_dense_layer: Figure
    per_sparse_layer: Figure

    def ops(self, layers: int, dense_layers: int) -> int:
        dense = min(dense_layers, layers)
        return round(self.base.value + self.per_dense_layer.value * dense
                     + self.per_sparse_layer.value * (layers - dense))


@dataclass(frozen=True)
class DeviceStepCost:
    """The per-step figures of one device kind (ModuleSpec.kind) and the path its server runs."""

    kind: str
    host: str  # the processor the host figures are for
    served: str  # the path serve runs: GRAPHED on CUDA (issue #19), STATIC_EAGER on a CPU
    op_host_us: Figure  # host time per dispatched op, eager
    step_host_us: Figure  # the step's host side: input packing, the one read back, sampling, scheduling
    graph_launch_us: Figure | None = None  # one CUDA-graph replay's host cost
    node_gpu_us: Figure | None = None  # per kernel, on the GPU, beyond its bytes: launch gap and tail

    def __post_init__(self) -> None:
        if self.served not in (GRAPHED, STATIC_EAGER):
            raise ValueError(f"served={self.served!r} must be {GRAPHED!r} or {STATIC_EAGER!r}")
        if self.served == GRAPHED and (self.graph_launch_us is None or self.node_gpu_us is None):
            raise ValueError(f"device kind {self.kind!r} serves graphed steps: give graph_launch_us and node_gpu_us")

    @property
    def gpu(self) -> bool:
        return self.node_gpu_us is not None

    def figures(self) -> dict:
        named = {"op_host_us": self.op_host_us, "step_host_us": self.step_host_us,
                 "graph_launch_us": self.graph_launch_us, "node_gpu_us": self.node_gpu_us}
        return {name: f.as_dict() for name, f in named.items() if f is not None}


@dataclass(frozen=True)
class StepPrediction:
    path: str  # STATIC_EAGER, EAGER or GRAPHED
    served: bool  # the path serve runs on this device
    ops: int
    bytes_s: float | None  # bytes per step / bandwidth; None when the bandwidth is unknown
    fixed_s: float
    parts_s: tuple[tuple[str, float], ...]  # what the fixed cost is made of
    batch: int

    @property
    def step_s(self) -> float | None:
        return None if self.bytes_s is None else self.bytes_s + self.fixed_s

    @property
    def tok_s(self) -> float | None:  # whole batch
        return None if self.step_s is None else self.batch / self.step_s

    @property
    def tok_s_per_sequence(self) -> float | None:
        return None if self.step_s is None else 1 / self.step_s

    def as_dict(self) -> dict:
        return {"path": self.path, "served": self.served, "ops_per_step": self.ops, "bytes_ms": _ms(self.bytes_s),
                "fixed_ms": _ms(self.fixed_s), "fixed_parts_ms": {k: _ms(v) for k, v in self.parts_s},
                "step_ms": _ms(self.step_s), "tok_s": self.tok_s, "tok_s_per_sequence": self.tok_s_per_sequence}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)


@dataclass(frozen=True)
class StepCostTable:
    op_counts: tuple[OpCount, ...]
    devices: tuple[DeviceStepCost, ...]

    def for_kind(self, kind: str) -> DeviceStepCost:
        for device in self.devices:
            if device.kind == kind:
                return device
        raise ValueError(f"no step-cost figures for device kind {kind!r}; known: "
                         f"{', '.join(d.kind for d in self.devices)}")

    def op_count(self, quant: str) -> OpCount:
        """The quant's count; others fall back to nf4's (labelled in the output by its quant)."""
        return next((c for c in self.op_counts if c.quant == quant),
                    next(c for c in self.op_counts if c.quant == "nf4"))

    def predict(self, kind: str, quant: str, layers: int, dense_layers: int, step_bytes: int,
                bandwidth_gbps: float | None, batch: int) -> tuple[StepPrediction, ...]:
        """The eager prediction, then the graphed one where the device kind has a GPU; `served` marks serve's."""
        cost = self.for_kind(kind)
        ops = self.op_count(quant).ops(layers, dense_layers)
        bytes_s = step_bytes / (bandwidth_gbps * 1e9) if bandwidth_gbps else None
        launch = ops * cost.op_host_us.value * 1e-6
        host = cost.step_host_us.value * 1e-6
        if not cost.gpu:
            eager = StepPrediction(STATIC_EAGER, cost.served == STATIC_EAGER, ops, bytes_s, launch + host,
                                   (("ops x op_host", launch), ("step_host", host)), batch)
            return (eager,)
        gaps = ops * cost.node_gpu_us.value * 1e-6
        # Launching runs ahead of the GPU: the step lasts the longer of the host's launching and the GPU's work
        # (bytes + gaps), so beyond bytes/bw it adds max(launching - bytes/bw, gaps).
        beyond = launch - (bytes_s or 0.0)
        core = (("ops x op_host - bytes/bw (host-bound)", beyond) if beyond > gaps
                else ("ops x node_gpu (GPU-bound)", gaps))
        eager_parts = (core, ("step_host", host))
        eager = StepPrediction(EAGER, cost.served == EAGER, ops, bytes_s, core[1] + host, eager_parts, batch)
        graph_parts = (("graph_launch", cost.graph_launch_us.value * 1e-6), ("ops x node_gpu", gaps),
                       ("step_host", host))
        graphed = StepPrediction(GRAPHED, cost.served == GRAPHED, ops, bytes_s, sum(v for _, v in graph_parts),
                                 graph_parts, batch)
        return eager, graphed


def _ops(quant: str, per_dense: int, per_sparse: int, base: int = 145, probed_as: str | None = None) -> OpCount:
    how = (f"{PROBE} --quant {probed_as or quant}: OpTrace over one static step of random 3- and 6-layer Llamas (and 6 "
           "layers with 1 dense layer), fitted exactly; at 30 layers, 2 dense, nf4 it gives docs/static-step.md's 1,333")
    return OpCount(quant, Figure(base, "ops", MEASURED, how), Figure(per_dense, "ops/layer", MEASURED, how),
                   Figure(per_sparse, "ops/layer", MEASURED, how))


_CPU_OP = Figure(4.3, "us", MEASURED, f"{PROBE}: static step wall time / its op count, median of the runs "
                 "(3.7-4.5 us; docs/static-step.md: ~3-4 us per op on this CPU)")
_CPU_STEP_HOST = Figure(200, "us", MEASURED, f"{PROBE}: median engine time per token minus the step's own "
                        "(input packing, the stats read back, sampling, detokenizing; noisy here: 0.1-0.6 ms)")

STEP_COSTS = StepCostTable(
    # grouped projections (gguf, int4: one registered op a projection, no dtype conversions around it), probed as
    # int4 on 2026-12-06 (the random models are folders; a GGUF's blocks run the same op)
    op_counts=(_ops("nf4", 34, 40), _ops("fp4", 34, 40), _ops("none", 30, 36), _ops("gguf", 30, 34, 141, "int4"),
               _ops("int4", 30, 34, 141)),
    devices=(
        DeviceStepCost("cpu", "this repo's 2-core AMD EPYC (x86-64); other CPUs differ", STATIC_EAGER,
                       _CPU_OP, _CPU_STEP_HOST),
        DeviceStepCost(
            "jetson", "Orin Cortex-A78AE", GRAPHED,
            op_host_us=Figure(15, "us", ESTIMATE,
                              f"(this CPU's 4.3 us dispatch + 2.65 us per cudaLaunchKernel enqueue measured on a "
                              f"desktop, {OCANNL}) x {ORIN_HOST_SLOWDOWN} for the A78AE = 15.6 us; the project's "
                              "issue #18 puts eager launches on Orin's ARM cores at 10-20 us"),
            step_host_us=Figure(500, "us", ESTIMATE, f"this CPU's measured 200 us ({PROBE}) x {ORIN_HOST_SLOWDOWN}"),
            graph_launch_us=Figure(318, "us", MEASURED, f"{REALIZAR}: 'launch=318µs' of a whole-token CUDA graph "
                                   "on an Orin Nano 8GB (CUDA 12.6), a third-party decoder's graph"),
            node_gpu_us=Figure(3, "us", ESTIMATE,
                               f"0.58 us per replayed node measured on a desktop GPU ({OCANNL}) x ~3.7 for the "
                               "Orin Nano's GPU clock (625 MHz at 15 W against ~2.3 GHz) = 2.1 us, rounded up for "
                               "kernels too small to reach the DRAM bandwidth; sanity check: with it plan predicts "
                               f"~169-171 tok/s for SmolLM2 (int8 head) on the Orin Nano Super, where llama.cpp measures 165.2 "
                               f"({SMOLHUB}, 25 W)"),
        ),
        DeviceStepCost(
            "cuda", "a desktop x86 host", GRAPHED,
            op_host_us=Figure(7, "us", ESTIMATE, f"this x86 CPU's measured 4.3 us of dispatch per op ({PROBE}) + "
                              f"2.65 us per cudaLaunchKernel enqueue measured on a desktop ({OCANNL})"),
            step_host_us=Figure(200, "us", ESTIMATE, f"this x86 CPU's measured step host side ({PROBE})"),
            graph_launch_us=Figure(15, "us", MEASURED, f"{OCANNL}: a replay costs ~15 us fixed plus ~0.58 us per "
                                   "node (RTX 5070 Ti Laptop, CUDA 13.3)"),
            node_gpu_us=Figure(0.58, "us", MEASURED, f"{OCANNL}: per replayed node (no-op kernels)"),
        ),
    ),
)
