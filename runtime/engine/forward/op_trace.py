"""Count what a decode step dispatches: every aten (and custom) op, with the shapes it saw (a TorchDispatchMode).

Why: on a Jetson each eager op costs 10-20 us of launch overhead, so ops per step bound decode speed before any
arithmetic does; a CUDA graph replays them without that cost. `oval-edge bench` reports the count of one step and
the static-step tests compare the sequence step by step (the same ops and shapes at every length) and check that
nothing in it reads a device value on the host or copies between devices.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that make the host wait for a device value (item(), bool(), nonzero's output size).
HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
                        "aten.nonzero.default", "aten.equal.default", "aten.unique.default",
                        "aten.masked_select.default"})


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}@{value.device.type}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    return type(value).__name__ if not isinstance(value, (int, float, bool, str)) else repr(value)


def _devices(args, kwargs) -> set[str]:
    found = set()
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.add(str(value.device))
        elif isinstance(value, torch.device):
            found.add(str(value))
    return found


class OpTrace(TorchDispatchMode):
    """While active, records each dispatched op's name (and, with shapes=True, its tensor arguments' shapes).

    host_reads: ops that synchronise the host with the device; device_copies: ops whose tensors span devices.
    """

    def __init__(self, shapes: bool = False) -> None:
        super().__init__()
        self.shapes = shapes
        self.calls: list[tuple[str, str]] = []
        self.host_reads: list[str] = []
        self.device_copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        self.calls.append((name, _describe(args) if self.shapes else ""))
        if name in HOST_READS:
            self.host_reads.append(name)
        if len(_devices(args, kwargs)) > 1 or (name in ("aten._to_copy.default", "aten.to.device")
                                               and "device" in kwargs):
            self.device_copies.append(name)
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return len(self.calls)

    def by_name(self) -> Counter:
        return Counter(name for name, _ in self.calls)


# Host calls that start work on a CUDA device: one per kernel in an eager step, one per replay of a captured graph.
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                          "cudaGraphLaunch", "cuGraphLaunch"})


class LaunchCount:
    """While active, counts the host's CUDA launch calls and the kernels the GPU ran (torch.profiler, CUPTI).

    Why not OpTrace: a graph replay dispatches no op, so on CUDA the figure that bounds a step is launches (eager: one
    per kernel; graphed: one per step) against kernels (the same work either way). count = launches, as OpTrace's.
    """

    def __init__(self) -> None:
        self.launches = self.kernels = 0
        self._profile = None

    def __enter__(self) -> "LaunchCount":
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self._profile.__exit__(*exc)
        events = self._profile.events()
        self.launches = sum(1 for event in events if event.name in LAUNCH_CALLS)
        self.kernels = sum(1 for event in events if event.device_type == torch.autograd.DeviceType.CUDA)

    @property
    def count(self) -> int:
        return self.launches
