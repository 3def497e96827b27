"""The clock and the statistics of every measuring tool (bench, profile, load, plan's step probe, the experiments):
one wall clock, one median, one percentile rule and one rate, so that a figure named the same in two reports was
computed the same way ([R-measuring]).

Stdlib only: bench's llama.cpp worker, `plan` and the load client run without torch. A caller timing GPU work
passes `sync` (e.g. `lambda: torch.cuda.synchronize(device)`), so that the clock waits for the device.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable


def clock() -> float:
    """Seconds on the monotonic high-resolution clock (time.perf_counter): stamps are comparable only with each
    other, within one machine's boot (a child process's stamps too)."""
    return time.perf_counter()


class Stopwatch:
    """Seconds since it was made: `watch = Stopwatch(); ...; watch.seconds`."""

    def __init__(self) -> None:
        self.began = clock()

    @property
    def seconds(self) -> float:
        return clock() - self.began


def time_call(fn: Callable[[], object], sync: Callable[[], None] | None = None) -> float:
    """Seconds one call of fn takes; `sync` (if given) runs before the clock starts and before it stops."""
    if sync is not None:
        sync()
    began = clock()
    fn()
    if sync is not None:
        sync()
    return clock() - began


def repeat_times(fn: Callable[[], object], repeats: int, warmup: int = 0,
                 sync: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each of `repeats` calls of fn, after `warmup` untimed calls (lazy set-up, caches, allocator)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeat_times needs repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    return [time_call(fn, sync) for _ in range(repeats)]


def device_sync(device) -> Callable[[], None] | None:
    """The `sync` that makes the clock wait for a torch.device's queued work: its CUDA stream; None on a CPU, whose
    ops return when done (torch is imported only for CUDA)."""
    if getattr(device, "type", device) != "cuda":
        return None
    import torch

    return lambda: torch.cuda.synchronize(device)


def gaps(stamps: list[float]) -> list[float]:
    """The time between consecutive stamps (len(stamps) - 1 values): inter-token latencies from token stamps."""
    return [b - a for a, b in zip(stamps, stamps[1:])]


def rate(count: float, seconds: float | None) -> float | None:
    """count / seconds (tokens per second, steps per second); None when no time passed (or none was measured)."""
    if seconds is None or seconds <= 0:
        return None
    return count / seconds


def numbers(values: Iterable) -> list[float]:
    """The values that are numbers: None (a failed run, a figure not measured), bools and text left out."""
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def median(values: Iterable) -> float | None:
    """Median of the values that are numbers; None when there are none."""
    data = numbers(values)
    return statistics.median(data) if data else None


def percentile(values: Iterable, q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) of the values that are numbers, by linear interpolation between the
    closest ranks (numpy's default, statistics.quantiles' 'inclusive'); None when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q!r} must be in [0, 100]")
    data = sorted(numbers(values))
    if not data:
        return None
    position = (len(data) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return data[low] + (data[high] - data[low]) * (position - low)


def quartiles(values: Iterable) -> tuple[float | None, float | None, float | None]:
    """(p25, median, p75) of the values that are numbers; (None, None, None) when there are none."""
    data = numbers(values)
    return percentile(data, 25), median(data), percentile(data, 75)
