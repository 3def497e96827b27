"""One benchmark run in its own process: `python -m oval_edge.tools.bench_worker JOB.json RESULT.json`.

A fresh process per (engine, context, run) makes the peak RSS (VmHWM) that engine's own: no other engine's
weights, allocator caches or threads share it. The worker imports only what its engine needs (the llama.cpp
worker never imports torch). It writes one JSON object; on failure it writes {"error": ...} and exits 1.

How time is split, the same for every engine: the clock starts just before the prompt goes in and ticks when
each generated token is available to the caller. prefill = start -> first token (prompt forward + first sample);
decode = first token -> last token over the N-1 steps between them. So decode tok/s = (N-1) / decode seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

MB = 2**20


class TokenClock:
    """Timestamps of the generated tokens of one timed request."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.times: list[float] = []
        self.token_ids: list[int] = []

    def begin(self) -> None:
        self.start = time.perf_counter()

    def tick(self, token_id: int) -> None:
        self.times.append(time.perf_counter())
        self.token_ids.append(int(token_id))

    def summary(self, prompt_tokens: int) -> dict:
        if self.start is None or len(self.times) < 2:
            raise RuntimeError(f"the engine produced {len(self.times)} token(s); decode speed needs at least 2")
        prefill_s = self.times[0] - self.start
        decode_s = self.times[-1] - self.times[0]
        steps = len(self.times) - 1
        return {
            "prompt_tokens": prompt_tokens,
            "gen_tokens": len(self.times),
            "prefill_s": prefill_s,
            "prefill_tok_s": prompt_tokens / prefill_s if prefill_s > 0 else None,
            "ttft_s": prefill_s,
            "decode_s": decode_s,
            "decode_steps": steps,
            "decode_tok_s": steps / decode_s if decode_s > 0 else None,
            "output_ids": self.token_ids[:16],  # lets a reader check that the engines agree on greedy tokens
        }


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class MemoryMeter:
    """Peak RSS of the whole process (load included) and of the timed run alone (VmHWM reset after loading)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.fields: dict = {}

    def after_load(self) -> None:
        """Call after loading and warm-up, right before the timed request."""
        self.fields["load_peak_rss_mb"] = (_status_kb("VmHWM") or 0) / 1024
        self.fields["rss_after_load_mb"] = (_status_kb("VmRSS") or 0) / 1024
        try:  # Linux >= 4.0: writing 5 resets VmHWM to the current RSS, so the next peak is the run's own
            with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
                handle.write("5")
            self.fields["run_peak_reset"] = True
        except OSError:
            self.fields["run_peak_reset"] = False
        if self.cuda:
            import torch

            self.fields["load_peak_device_mb"] = torch.cuda.max_memory_allocated() / MB
            torch.cuda.reset_peak_memory_stats()

    def finish(self) -> dict:
        run_peak = (_status_kb("VmHWM") or 0) / 1024
        out = dict(self.fields)
        out["run_peak_rss_mb"] = run_peak if out.pop("run_peak_reset", False) else None
        out["peak_rss_mb"] = max(run_peak, out.get("load_peak_rss_mb", 0.0))
        if self.cuda:
            import torch

            run_device = torch.cuda.max_memory_allocated() / MB
            out["run_peak_device_mb"] = run_device
            out["peak_device_mb"] = max(run_device, out.get("load_peak_device_mb", 0.0))
        return out


def run_job(job: dict) -> dict:
    """Run one job (see bench_runner.job_spec for its keys) and return its result row."""
    threads = int(job["threads"])
    engine = job["engine"]
    clock = TokenClock()
    uses_torch_cuda = job["device"] == "cuda" and engine != "llama.cpp"
    meter = MemoryMeter(cuda=uses_torch_cuda)
    began = time.perf_counter()
    if engine in ("oval", "dense") or job.get("reuse_tau") is not None:  # oval+reuse@TAU: oval with reuse
        from .bench_runtime import run_runtime

        extra = run_runtime(job, meter, clock)
    elif engine == "hf":
        from .bench_peers import run_hf

        extra = run_hf(job, meter, clock)
    elif engine == "llama.cpp":
        from .bench_peers import run_llamacpp

        extra = run_llamacpp(job, meter, clock)
    else:
        raise ValueError(f"engine {engine!r} is unknown")
    row = {"engine": engine, "context": job["context"], "run": job["run"], "device": job["device"],
           "threads": threads}
    row.update(clock.summary(len(job["prompt_ids"])))
    row.update(meter.finish())
    row.update(extra)
    row["wall_s"] = time.perf_counter() - began
    row["torch_imported"] = "torch" in sys.modules  # False for llama.cpp: its RSS holds no torch
    return row


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m oval_edge.tools.bench_worker JOB.json RESULT.json", file=sys.stderr)
        return 2
    job_path, result_path = argv
    with open(job_path, encoding="utf-8") as handle:
        job = json.load(handle)
    # the runtime's engines (oval, dense, oval+reuse@TAU) run as `oval-edge serve` does (before bitsandbytes loads)
    if job.get("engine") in ("oval", "dense") or job.get("reuse_tau") is not None:
        from oval_edge.runtime.cli import prepare_runtime_process

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
