"""The measuring tools' shared clock and statistics (tools/timing.py), and the standing check that the tools use it
rather than keeping their own copies ([R-measuring])."""

from __future__ import annotations

import ast
import random
import statistics
from pathlib import Path

import pytest

from oval_edge.tools import timing
from oval_edge.tools.timing import (
    Stopwatch, device_sync, gaps, median, numbers, percentile, quartiles, rate, repeat_times, time_call,
)

TOOLS = Path(__file__).resolve().parents[1] / "tools"
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "process_time"}
# Files that still read the clock or summarise by themselves, each with what holds it there: it moves onto
# tools/timing.py when its owner next changes it (the test below fails once a file no longer needs its entry).
PENDING = {
    "calibrate/run.py": "phase timings; being rewritten with the static step (#52 item 1)",
    "calibrate/command.py": "the command's total time; calls run.py, rewritten with it",
    "eval/command.py": "the command's total time; calls runtime.py / fidelity.py, being rewritten (#52 item 1)",
    "store_check/io_compare.py": "its own median and p90 (statistics.quantiles' exclusive method)",
    "store_check/runs.py": "a teacher-forced pass's wall time",
    "store_check/command.py": "the logits task's wall time",
    "gpu_check.py": "the check's total and per-step times",
    "export_onnx.py": "the export's total time",
    "board_check/__main__.py": "the resolution's total time",
}


def own_timing(path: Path) -> list[str]:
    """What in one file reads a clock of the time module or imports statistics (as `file:line what`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr in CLOCKS and getattr(node.value, "id", None) == "time":
            found.append(f"{node.lineno} time.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "statistics"):
            found.append(f"{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Import) and any(a.name == "statistics" for a in node.names):
            found.append(f"{node.lineno} import statistics")
    return found


def tools_timing_outside_the_core(root: Path) -> dict[str, list[str]]:
    """{file under root: its own clock reads and statistics imports}, the core itself left out."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name != "timing.py" and (found := own_timing(path)):
            out[name] = found
    return out


def test_the_measuring_tools_time_and_summarise_through_the_core():
    found = tools_timing_outside_the_core(TOOLS)
    copies = {name: lines for name, lines in found.items() if name not in PENDING}
    assert not copies, ("these files time or summarise on their own; use tools/timing.py (Stopwatch, time_call, "
                        f"repeat_times, median, percentile, quartiles, rate): {copies}")
    moved = sorted(set(PENDING) - set(found))
    assert not moved, f"{moved} no longer time on their own: take them out of PENDING"


def test_numbers_median_and_percentile_leave_out_missing_values():
    assert numbers([1, None, 2.5, True, "x"]) == [1, 2.5]
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, None, 2.0, 3.0]) == 2.5
    assert median([None]) is None and median([]) is None and median(iter([5.0])) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 95) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8) and percentile([], 50) is None
    assert percentile([5.0, None, 1.0], 0) == 1.0 and percentile([5.0, None, 1.0], 100) == 5.0
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 10, 17])
def test_quartiles_interpolate_as_statistics_inclusive_does(n):
    values = [random.Random(n).uniform(0, 10) for _ in range(n)]
    assert quartiles(values) == pytest.approx(tuple(statistics.quantiles(values, n=4, method="inclusive")))
    assert quartiles(values)[1] == statistics.median(values)


def test_quartiles_of_one_value_and_of_none():
    assert quartiles([7.0]) == (7.0, 7.0, 7.0)
    assert quartiles([None, None]) == (None, None, None)


def test_rate_and_gaps():
    assert rate(3, 2.0) == 1.5 and rate(3, 0.0) is None and rate(3, None) is None and rate(3, -1.0) is None
    assert gaps([1.0, 1.5, 3.0]) == [0.5, 1.5] and gaps([1.0]) == [] and gaps([]) == []


class ScriptedClock:
    """time.perf_counter for tools/timing.py: each read advances by `tick`; `log` records reads and syncs in order."""

    def __init__(self, tick: float = 1.0):
        self.now, self.tick, self.log = 0.0, tick, []

    def perf_counter(self) -> float:
        self.now += self.tick
        self.log.append("clock")
        return self.now


@pytest.fixture
def scripted(monkeypatch):
    fake = ScriptedClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


def test_time_call_syncs_before_starting_and_before_stopping(scripted):
    seconds = time_call(lambda: scripted.log.append("call"), sync=lambda: scripted.log.append("sync"))
    assert scripted.log == ["sync", "clock", "call", "sync", "clock"] and seconds == 1.0


def test_repeat_times_leaves_the_warm_up_untimed(scripted):
    calls = []
    times = repeat_times(lambda: calls.append(len(scripted.log)), repeats=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3
    assert calls[:2] == [0, 0]  # the warm-up calls ran before the clock was first read
    with pytest.raises(ValueError, match="repeats >= 1"):
        repeat_times(lambda: None, repeats=0)


def test_stopwatch_counts_from_when_it_was_made(scripted):
    watch = Stopwatch()
    assert watch.began == 1.0 and watch.seconds == 1.0 and watch.seconds == 2.0


def test_device_sync_waits_only_for_cuda():
    assert device_sync("cpu") is None
    torch = pytest.importorskip("torch")
    assert device_sync(torch.device("cpu")) is None
    assert callable(device_sync(torch.device("cuda", 0)))  # built without touching the device
