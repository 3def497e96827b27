"""What a bench worker measures around one timed request: token timestamps and the process's peak memory.

No torch at import time (the llama.cpp worker must not load it): CUDA figures import it only when asked for.
"""

from __future__ import annotations

from oval_edge.runtime.engine.memory import peak_rss_bytes, process_rss_bytes
from oval_edge.tools.timing import clock, rate

MB = 2**20


class TokenClock:
    """Timestamps of the generated tokens of one timed request."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.times: list[float] = []
        self.token_ids: list[int] = []

    def begin(self) -> None:
        self.start = clock()

    def tick(self, token_id: int) -> None:
        self.times.append(clock())
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
            "prefill_tok_s": rate(prompt_tokens, prefill_s),
            "ttft_s": prefill_s,
            "decode_s": decode_s,
            "decode_steps": steps,
            "decode_tok_s": rate(steps, decode_s),
            "output_ids": self.token_ids[:16],  # lets a reader check that the engines agree on greedy tokens
        }


class MemoryMeter:
    """Peak RSS of the whole process (load included) and of the timed run alone (VmHWM reset after loading)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.fields: dict = {}
        self.frozen: dict | None = None

    def after_load(self) -> None:
        """Call after loading and warm-up, right before the timed request."""
        self.fields["load_peak_rss_mb"] = peak_rss_bytes() / MB
        self.fields["rss_after_load_mb"] = process_rss_bytes() / MB
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

    def freeze(self) -> None:
        """Take the figures now: what runs after (the runtime's op count, whose dispatch mode maps ~50 MB of torch's
        Python dispatch code) does not count."""
        self.frozen = self.finish()

    def finish(self) -> dict:
        if self.frozen is not None:
            return dict(self.frozen)
        run_peak = peak_rss_bytes() / MB
        out = dict(self.fields)
        out["run_peak_rss_mb"] = run_peak if out.pop("run_peak_reset", False) else None
        out["peak_rss_mb"] = max(run_peak, out.get("load_peak_rss_mb", 0.0))
        if self.cuda:
            import torch

            run_device = torch.cuda.max_memory_allocated() / MB
            out["run_peak_device_mb"] = run_device
            out["peak_device_mb"] = max(run_device, out.get("load_peak_device_mb", 0.0))
        return out
