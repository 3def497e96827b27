"""One benchmark run in its own process: `python -m oval_edge.tools.bench.worker JOB.json RESULT.json`.

A fresh process per (engine, context, run) makes the peak RSS (VmHWM) that engine's own: no other engine's
weights, allocator caches or threads share it. The worker imports only what its engine needs (the llama.cpp
worker never imports torch). It writes one JSON object; on failure it writes {"error": ...} and exits 1.

How time is split, the same for every engine: the clock starts just before the prompt goes in and ticks when
each generated token is available to the caller. prefill = start -> first token (prompt forward + first sample);
decode = first token -> last token over the N-1 steps between them. So decode tok/s = (N-1) / decode seconds.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback

from oval_edge.tools.timing import Stopwatch

from .meters import MemoryMeter, TokenClock


def runs_runtime(job: dict) -> bool:
    """oval, dense, oval+reuse@TAU (oval with reuse), oval+groups@G (two-level scoring) and oval+schema (oval under a
    grammar) are this runtime."""
    return (job.get("engine") in ("oval", "dense") or job.get("reuse_tau") is not None
            or job.get("schema") is not None or job.get("group_pages") is not None)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int | None) -> None:
    """Have Linux kill this worker when bench, its parent, ends however it ends (SIGKILL included). Why: a bench
    killed mid-run left its worker decoding for minutes beside the next bench's runs, which then measured a third of
    their speed. Elsewhere (no prctl) nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # it ended before the request, which then never fires
        os._exit(1)


def run_job(job: dict) -> dict:
    """Run one job (see runner.job_spec for its keys) and return its result row."""
    threads = int(job["threads"])
    engine = job["engine"]
    clock = TokenClock()
    uses_torch_cuda = job["device"] == "cuda" and engine != "llama.cpp"
    meter = MemoryMeter(cuda=uses_torch_cuda)
    watch = Stopwatch()
    if runs_runtime(job):
        from .runtime_engine import run_runtime

        extra = run_runtime(job, meter, clock)
    elif engine == "hf":
        from .peer_engines import run_hf

        extra = run_hf(job, meter, clock)
    elif engine == "llama.cpp":
        from .peer_engines import run_llamacpp

        extra = run_llamacpp(job, meter, clock)
    else:
        raise ValueError(f"engine {engine!r} is unknown")
    row = {"engine": engine, "context": job["context"], "run": job["run"], "device": job["device"],
           "threads": threads}
    row.update(clock.summary(len(job["prompt_ids"])))
    row.update(meter.finish())
    row.update(extra)
    row["wall_s"] = watch.seconds
    row["torch_imported"] = "torch" in sys.modules  # False for llama.cpp: its RSS holds no torch
    return row


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m oval_edge.tools.bench.worker JOB.json RESULT.json", file=sys.stderr)
        return 2
    job_path, result_path = argv
    with open(job_path, encoding="utf-8") as handle:
        job = json.load(handle)
    die_with_parent(job.get("parent_pid"))
    # the runtime's engines run as `oval-edge serve` does (before bitsandbytes loads)
    if runs_runtime(job):
        from oval_edge.cli import prepare_runtime_process

        prepare_runtime_process()
    try:
        result, status = run_job(job), 0
    except Exception as exc:  # noqa: BLE001 - the parent reports the failure in its table and carries on
        traceback.print_exc()
        result = {"engine": job.get("engine"), "context": job.get("context"), "run": job.get("run"),
                  "error": f"{type(exc).__name__}: {exc}"}
        status = 1
    tmp = result_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    os.replace(tmp, result_path)
    return status


if __name__ == "__main__":
    sys.exit(main())
