"""The static decode step captured into CUDA graphs, one per batch bucket (and page-table width), and replayed
(gpt-fast's recipe).

Why: an eager step of a 30-layer model launches ~1,300 kernels, each costing 10-20 us of Python, dispatcher and
driver work on a Jetson's ARM cores: the GPU then waits on the CPU for most of the step. A captured graph is one
launch (`torch.cuda.CUDAGraph.replay`) of the same kernels with their arguments frozen. This uses
`torch.cuda.CUDAGraph` directly, not `torch.compile(mode="reduce-overhead")`: compile needs Triton on CUDA, which
JetPack's torch wheels lack, and the graph over the static step's torch ops (gather + attention) is the path a stock
Jetson must run. Where Triton is installed its kernels are simply what the graph holds (oval_edge/kernels).

What makes a step capturable is StaticStep's contract: its inputs live in one preallocated buffer written before the
step (one host-to-device copy, outside the graph), its shapes do not follow the context, and nothing in it reads a
device value on the host. Its outputs (logits [B, vocab], stats [3]) are tensors the capture allocated: every replay
overwrites them in place, so a caller reads them (the engine samples, the stats are copied back) before the next step.

Capture happens at startup, while every page of the pool is free: the warm-up and capture inputs (`load_idle`) are
token 0 at position 0 of physical page 0, so the only thing they write is page 0's first K/V rows, which no sequence
owns yet and which prefill overwrites before anyone reads them. Buckets are captured largest first into one memory
pool shared by all graphs; sharing is safe because buckets never run concurrently and each replay's outputs are
consumed before the next replay of any graph.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from oval_edge.units import format_bytes

log = logging.getLogger("oval_edge.engine")
WARMUP_RUNS = 3  # eager runs before capture: lazy inits (cuBLAS workspaces, Triton's compiled kernels) happen here
StepOutputs = tuple[torch.Tensor, torch.Tensor]  # (logits [B, vocab] fp32, stats [3] int64)


class GraphBackend(Protocol):
    """What capturing needs from the device; CudaGraphs below on CUDA, a stand-in in the CPU tests."""

    def warmup(self, fn: Callable[[], StepOutputs], runs: int) -> None: ...

    def capture(self, fn: Callable[[], StepOutputs]) -> tuple[Callable[[], None], StepOutputs]: ...

    def held_bytes(self) -> int: ...


class CudaGraphs:
    """torch.cuda.CUDAGraph capture on one device: a side stream for warm-up and capture, one shared memory pool."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}; use decode_step='static' on {device.type}")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def warmup(self, fn: Callable[[], StepOutputs], runs: int) -> None:
        # On a side stream, as torch.cuda.graph itself captures: work queued on the default stream before capture
        # (the pool's zeroing, the weights' copies) must finish first, and the capture must not see it.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(runs):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def capture(self, fn: Callable[[], StepOutputs]) -> tuple[Callable[[], None], StepOutputs]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            outputs = fn()
        return graph.replay, outputs

    def held_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_reserved(self.device)


class GraphedStep:
    """A StaticStep whose `run` replays its captured graph. Built once per bucket by `capture_steps`."""

    def __init__(self, step, backend: GraphBackend, warmup_runs: int = WARMUP_RUNS) -> None:
        self.step = step
        step.load_idle()
        with torch.inference_mode():
            backend.warmup(step.forward, warmup_runs)
            self._replay, self.outputs = backend.capture(step.forward)
        self.replays = 0
        step.run = self.run  # the decoder calls step.run(): from now on a replay

    def run(self) -> StepOutputs:
        """Replay over the inputs `step.load` wrote; returns the same output tensors every time (overwritten)."""
        self._replay()
        self.replays += 1
        return self.outputs


@dataclass(frozen=True)
class CaptureReport:
    buckets: tuple[int, ...]
    seconds: float
    held_bytes: int  # device memory the graphs' pool and warm-up added (measured)
    widths: tuple[int, ...] = ()  # page-table widths per bucket (StaticDecoder.widths), when more than one

    def explain(self) -> str:
        widths = (f" x page-table widths {', '.join(map(str, self.widths))} "
                  f"({len(self.buckets) * len(self.widths)} graphs)") if len(self.widths) > 1 else ""
        return (f"CUDA graphs: buckets {', '.join(map(str, self.buckets))}{widths} captured in {self.seconds:.1f} s, "
                f"holding {format_bytes(self.held_bytes)}")


def capture_steps(decoder, backend: GraphBackend) -> CaptureReport:
    """Build and capture every (batch bucket, width) step of a StaticDecoder, largest first (the smaller ones reuse
    its pool blocks)."""
    began, before = time.perf_counter(), backend.held_bytes()
    for bucket in sorted(decoder.buckets, reverse=True):
        for width in sorted(decoder.widths, reverse=True):
            GraphedStep(decoder.step_for(bucket, width), backend)
    report = CaptureReport(tuple(decoder.buckets), time.perf_counter() - began, max(0, backend.held_bytes() - before),
                           tuple(decoder.widths))
    log.info(report.explain())
    return report
