"""`oval-edge profile`'s crossover: from which context length OVAL's decode step is not slower than the dense one on
this device, for the profiled model and the chosen page size and top-k ([R-dense-where-it-pays]). The result is
`oval_from` in the TOML's [server] section (EngineConfig.oval_from; runtime/engine/crossover.py has the rule).

How. Two engines over the same loaded weights, one per attention mode: `attention="oval"` with `oval_from=0` (OVAL
at every length, so the measurement is not steered by the crossover it measures) and `attention="dense"`, each with
a pool that holds the longest timed request. For each length, shortest first, both engines get the same prompt
(that many tokens of the calibration text) and prefill it with their own chunked prefill; the prompts are prefixes
of one another and the prefix cache is on, so each length prefills only the tokens past the previous one (the
previous request's full pages stay cached). Then `warmup + steps` greedy decode steps per engine, alternated
(OVAL, dense, then dense, OVAL, ...: load from other processes hits both alike), each timed on the wall clock
around engine.step() as measure.py's decode probe times them (forward, sealing, sampling; greedy sampling reads
the token back, so on CUDA the clock follows the device). The warm-up steps are dropped; tok/s = 1 / median step.

Clock. `wall` (the default) is what a client sees. On a CPU host that other processes load, the wall clock also
counts the time a step waits for a core, the same for both engines, which pulls their ratio towards 1 and moves
the crossover by a length or more from run to run; `cpu` times each step in the profiling thread's CPU time
(time.thread_time): with one torch thread every op of a CPU step runs on that thread, so waiting is not counted
(docs/crossover.md: the ratio at each length then repeats within 0.03 at load averages of 4 to 11).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from oval_edge.config import OvalConfig
from oval_edge.runtime.engine.crossover import NOISE_MARGIN, crossover_length
from oval_edge.tools.timing import Stopwatch, median, quartiles, rate, time_call

MODES = ("oval", "dense")
CLOCKS = ("wall", "cpu")


def thread_cpu_call(fn: Callable[[], object]) -> float:
    """Seconds of this thread's CPU time that one call of fn takes (the `cpu` clock above)."""
    began = time.thread_time()
    fn()
    return time.thread_time() - began


@dataclass
class LengthTimes:
    length: int
    oval_s: list[float]  # timed decode steps (seconds), warm-up dropped
    dense_s: list[float]
    oval_read: float = 0.0  # K/V tokens attended per row and layer at the last timed step (engine stats)
    dense_read: float = 0.0

    @property
    def oval_tps(self) -> float:
        return rate(1, median(self.oval_s))

    @property
    def dense_tps(self) -> float:
        return rate(1, median(self.dense_s))

    def record(self) -> dict:
        out = {"length": self.length, "oval_tok_s": round(self.oval_tps, 2), "dense_tok_s": round(self.dense_tps, 2),
               "oval_over_dense": round(self.oval_tps / self.dense_tps, 3), "steps": len(self.oval_s),
               "oval_tokens_read": round(self.oval_read, 1), "dense_tokens_read": round(self.dense_read, 1)}
        for mode, times in (("oval", self.oval_s), ("dense", self.dense_s)):
            p25, p50, p75 = quartiles(times)
            out[f"{mode}_ms_p25"], out[f"{mode}_ms_median"], out[f"{mode}_ms_p75"] = (
                round(p25 * 1e3, 3), round(p50 * 1e3, 3), round(p75 * 1e3, 3))
        return out


@dataclass
class Crossover:
    rows: list[LengthTimes]
    oval_from: int
    margin: float = NOISE_MARGIN
    seconds: float | None = None  # the measurement's wall time (engines, prefills, steps)
    clock: str = "wall"  # what timed each step (CLOCKS)

    def record(self) -> dict:
        return {"oval_from": self.oval_from, "noise_margin": self.margin, "seconds": self.seconds, "clock": self.clock,
                "rows": [r.record() for r in self.rows],
                "rule": "the shortest measured length from which OVAL's decode tok/s is at least (1 - noise_margin) "
                        "x dense's at every longer measured length; 0: at every one; longest + 1: at none"}

    def table(self) -> str:
        lines = [f"  {'context':>8}{'OVAL tok/s':>12}{'dense tok/s':>13}{'OVAL/dense':>12}{'read OVAL':>11}"
                 f"{'dense':>7}", "  " + "-" * 61]
        for r in self.rows:
            mark = "*" if r.length == self.oval_from or (self.oval_from == 0 and r is self.rows[0]) else " "
            lines.append(f"{mark} {r.length:>8}{r.oval_tps:>12.1f}{r.dense_tps:>13.1f}{r.oval_tps / r.dense_tps:>12.2f}"
                         f"{r.oval_read:>11.0f}{r.dense_read:>7.0f}")
        lines.append("  read: K/V tokens attended per layer (mean over layers) at the last timed step")
        lines.append(f"  {self.explain()}")
        return "\n".join(lines)

    def explain(self) -> str:
        longest = self.rows[-1].length
        within = f"within {self.margin:.0%}"
        if self.oval_from == 0:
            return f"oval_from = 0: OVAL is not slower than dense ({within}) at every measured length"
        if self.oval_from > longest:
            return (f"oval_from = {self.oval_from}: OVAL is slower than dense at {longest} tokens, the longest "
                    "measured; the dense step runs up to there")
        return (f"oval_from = {self.oval_from}: OVAL is not slower than dense ({within}) from {self.oval_from} "
                "tokens on; shorter steps run the dense step")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def usable_lengths(lengths: Sequence[int], token_limit: int, pool_tokens: int, decode_tokens: int) -> list[int]:
    """The lengths whose timed request fits: within the token limit, and both engines' pools (one such request
    each) together within the pool the budget buys, so the crossover never holds more K/V than serve would."""
    return [n for n in lengths if n + decode_tokens <= token_limit and 2 * (n + decode_tokens) <= pool_tokens]


class ModeEngine:
    """One attention mode's engine, its pool just large enough for the longest timed request."""

    def __init__(self, loaded, oval: OvalConfig, mode: str, tokens: int, prefill_chunk: int, clock: str = "wall"):
        from oval_edge.runtime import Engine, EngineConfig

        self.timed = thread_cpu_call if clock == "cpu" else time_call
        pages = -(-tokens // oval.page_size) + 1  # one page of slack: the previous length's cached pages
        self.engine = Engine(loaded, oval.replace(memory_budget=None), EngineConfig(
            max_batch=1, max_queue=1, prefill_chunk=prefill_chunk, attention=mode, num_pages=pages,
            oval_from=0 if mode == "oval" else None))
        self.request = None

    def start(self, prompt: list[int], decode_tokens: int, advance: Callable[[int], None]) -> None:
        from oval_edge.runtime import SamplingParams
        from oval_edge.runtime.engine.request import RUNNING

        # The step that ends the prefill samples the first token; each timed step decodes one more.
        params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
        self.request = self.engine.submit(prompt, params, request_id=f"crossover-{len(prompt)}")
        while self.request.status != RUNNING and not self.request.finished:
            self.engine.step()
            advance(1)
        self.check()

    def step(self) -> float:
        return self.timed(self.engine.step)

    def finish(self) -> None:
        while not self.request.finished:  # the last token's step, untimed
            self.engine.step()
        self.check()

    def check(self) -> None:
        if self.request.finish_reason in ("error", "cancelled"):
            raise RuntimeError(f"the crossover's request ended with {self.request.finish_reason}: {self.request.error}")


def measure_crossover(loaded, oval: OvalConfig, text_ids: list[int], lengths: Sequence[int], warmup: int, steps: int,
                      prefill_chunk: int, advance: Callable[[int], None] = lambda n: None,
                      clock: str = "wall") -> Crossover:
    """Decode tok/s of OVAL and dense at each length (increasing), and the crossover from them."""
    from .measure import context_ids

    lengths = sorted(lengths)
    if not lengths:
        raise ValueError("no crossover length fits the pool; lower --crossover-lengths or raise --memory-budget")
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r} is unknown; allowed: {', '.join(CLOCKS)}")
    if clock == "cpu" and (loaded.device.type != "cpu" or torch_threads() != 1):
        raise ValueError("--crossover-clock cpu times the profiling thread, so it needs --device cpu and --threads "
                         "1 (every op on that thread); use --crossover-clock wall")
    decode = warmup + steps
    engines = {mode: ModeEngine(loaded, oval, mode, lengths[-1] + decode + 2, prefill_chunk, clock)
               for mode in MODES}
    rows = []
    for length in lengths:
        prompt = context_ids(text_ids, length)
        for engine in engines.values():
            engine.start(prompt, decode, advance)
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for i in range(decode):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                seconds = engines[mode].step()
                if i >= warmup:
                    times[mode].append(seconds)
                advance(1)
        read = {mode: engines[mode].engine.stats.attended_per_row_layer for mode in MODES}
        for engine in engines.values():
            engine.finish()
        rows.append(LengthTimes(length, times["oval"], times["dense"], read["oval"], read["dense"]))
    return Crossover(rows, crossover_length(lengths, [r.oval_tps for r in rows], [r.dense_tps for r in rows]),
                     clock=clock)


def progress_steps(lengths: Sequence[int], warmup: int, steps: int, prefill_chunk: int) -> int:
    """About the progress units measure_crossover reports: prefill chunks (of the tokens past the previous length's,
    which the prefix cache holds) and decode steps, both engines."""
    lengths = sorted(lengths)
    return sum(2 * (-(-(n - prev) // prefill_chunk) + warmup + steps) for prev, n in zip([0, *lengths], lengths))


def profile_crossover(loaded, s: dict, rows, text_ids: list[int], show_progress: bool) -> Crossover | None:
    """The crossover for the page size and top-k `oval-edge profile` chose from `rows` (its settings `s`); None when
    nothing was chosen or no length fits (then the config gets no oval_from and serve uses the device's default)."""
    from tqdm import tqdm

    from .choice import NoConfiguration, rank

    try:
        chosen = rank(rows, s["max_kl"], s["tokens_per_step"], s["speed_tolerance"]).chosen
    except NoConfiguration:
        return None
    decode = s["warmup"] + s["steps"] + 2  # as measure_crossover's requests reserve them
    lengths = usable_lengths(s["crossover_lengths"], chosen.max_context, chosen.pool_tokens, decode)
    if not lengths:
        print(f"crossover: none of --crossover-lengths {s['crossover_lengths']} fits twice in the pool at page "
              f"{chosen.page_size} ({chosen.pool_tokens} tokens); no oval_from written (serve uses the device's "
              "default). Lower the lengths or raise --memory-budget", file=sys.stderr)
        return None
    oval = OvalConfig(page_size=chosen.page_size, top_k=chosen.top_k)
    watch = Stopwatch()
    with tqdm(total=progress_steps(lengths, s["warmup"], s["steps"], s["prefill_chunk"]), unit="step",
              desc=f"OVAL vs dense at {lengths[0]}..{lengths[-1]} tokens", disable=not show_progress) as bar:
        crossover = measure_crossover(loaded, oval, text_ids, lengths, s["warmup"], s["steps"], s["prefill_chunk"],
                                      bar.update, s.get("crossover_clock", "wall"))
    crossover.seconds = round(watch.seconds, 1)
    return crossover
