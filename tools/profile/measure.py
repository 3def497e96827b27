"""What `oval-edge profile` measures on this device for each page size (and its top-k).

Memory (`pool_figures`). An Engine is built the way `oval-edge serve` builds one: runtime/engine/setup.build_pool
sizes its pool from the memory budget in this process (weights, prefill workspace and the process's resident
memory measured now), so `pages` is what serve allocates from that budget. Every page size is sized first, before
anything else is held, and each pool is freed before the next is built.

Speed (`DecodeProbe`, `measure_decode`). Decode latency does not depend on how many pages a pool has, only on
what a step reads, so each page size is timed on an engine whose pool (same geometry, dtype and code path) holds
just the timed request. That request's prompt is `context` tokens of the calibration text; the engine's own
chunked dense prefill fills the context, once per page size (each page size has its own pages and summaries, and
this is the path a served prompt takes). Then `warmup + steps` greedy decode steps run at positions context,
context+1, ... Each decode step is timed on the wall clock around engine.step() (forward, page sealing when a page
fills, sampling: a token as a client gets it); the warm-up steps are dropped and the median is reported with its
quartiles. Greedy sampling reads the token back to the host, so on CUDA the clock follows the device.
When the probes' pools together fit in the smallest pool the budget buys, all page sizes are prefilled first and
then stepped in turn (A B C A B C ..., the first one rotating each round), so that load from other processes
hits every page size alike; otherwise they run one after another, never holding more K/V than serve would.
After its prefill, each probe re-seals the prompt's sealed pages through PagePool.seal, which rebuilds the same
summaries from the same K/V: timed for the pages one prefill chunk seals (one batch, as the pool does it) and
for a single page (what a decode step pays each time a page fills).

Fidelity (`measure_fidelity`): the eval harness (tools/eval/fidelity.run_fidelity) with two rows, dense and OVAL
at this page size and top-k, teacher-forced over the calibration text with the same weights, so that the KL
measures what page selection costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from oval_edge.config import OvalConfig
from oval_edge.tools.timing import device_sync, median, repeat_times, time_call

SEAL_REPEATS = 5  # seal timings per page batch: the median of a few absorbs one-off allocator work
Advance = Callable[[int], None]  # progress: told of each prefill chunk, decode step and seal timing


@dataclass
class PoolFigures:
    pages: int
    bytes_per_page: int
    summary_bytes: int  # the whole pool's summaries
    summary_bytes_per_page: int
    pool_bytes: int
    token_limit: int  # longest prompt + max_tokens one request may have (pool and model limits)
    sizing: str  # the pool arithmetic, as serve prints it


@dataclass
class DecodeFigures:
    decode_ms: list[float] = field(default_factory=list)  # timed steps, warm-up dropped
    seal_ms: float | None = None
    seal_page_ms: float | None = None
    seal_pages: int | None = None
    kv_bytes_per_step: int | None = None  # K/V gathered at the last decode step, all layers (engine stats)
    interleaved: bool = False


def context_ids(text_ids: list[int], tokens: int) -> list[int]:
    """`tokens` prompt tokens: the text, repeated from its start when it is shorter than the context."""
    if not text_ids:
        raise ValueError("the calibration text has no tokens")
    repeats = -(-tokens // len(text_ids))
    return (list(text_ids) * repeats)[:tokens]


def decode_steps_needed(context: int, warmup: int, steps: int) -> int:
    """Tokens the timed request reserves: the prompt plus every generated token (see DecodeProbe)."""
    return context + warmup + steps + 2


def pool_figures(loaded, oval: OvalConfig, prefill_chunk: int) -> PoolFigures:
    """The pool serve would build from oval.memory_budget at this page size (built, read, freed)."""
    try:
        return _pool_figures(loaded, oval, prefill_chunk)
    finally:  # the engine is gone once _pool_figures returns: give its memory back before the next one
        _release_memory()


def _pool_figures(loaded, oval, prefill_chunk) -> PoolFigures:
    from oval_edge.runtime import Engine, EngineConfig

    engine = Engine(loaded, oval, EngineConfig(max_batch=1, max_queue=1, prefill_chunk=prefill_chunk))
    pool, g = engine.pool, engine.pool.geometry
    return PoolFigures(
        pages=pool.num_pages, bytes_per_page=g.bytes_per_page,
        summary_bytes=sum(t.numel() * t.element_size() for t in pool.summaries.values()),
        summary_bytes_per_page=g.summary_bytes_per_page, pool_bytes=pool.nbytes(), token_limit=engine.token_limit(),
        sizing=pool.sizing.explain() if pool.sizing is not None else f"{pool.num_pages} pages",
    )


def probe_pool_bytes(figures: PoolFigures, page_size: int, tokens: int) -> int:
    """Bytes of a probe's pool: the pages that hold `tokens` tokens at this page size."""
    return -(-tokens // page_size) * figures.bytes_per_page


class DecodeProbe:
    """One page size's engine, its pool just large enough for the timed request, prefilled to the context."""

    def __init__(self, loaded, oval: OvalConfig, prompt: list[int], warmup: int, steps: int, prefill_chunk: int,
                 advance: Advance):
        from oval_edge.runtime import Engine, EngineConfig, SamplingParams
        from oval_edge.runtime.engine.request import RUNNING

        need = decode_steps_needed(len(prompt), warmup, steps)
        self.warmup, self.advance = warmup, advance
        self.engine = Engine(loaded, oval.replace(memory_budget=None), EngineConfig(
            max_batch=1, max_queue=1, prefill_chunk=prefill_chunk, num_pages=-(-need // oval.page_size)))
        # The step that ends the prefill samples the first token; each timed step decodes one more.
        params = SamplingParams(max_tokens=warmup + steps + 1, temperature=0.0, ignore_eos=True)
        self.request = self.engine.submit(prompt, params, request_id="profile")
        while self.request.status != RUNNING and not self.request.finished:
            self.engine.step()
            advance(1)
        self._check()
        self.figures = DecodeFigures()
        f = self.figures
        f.seal_ms, f.seal_page_ms, f.seal_pages = _seal_times(self.engine.pool, "profile", prefill_chunk)
        advance(1)
        self._times: list[float] = []

    @property
    def done(self) -> bool:
        return self.request.finished

    def step(self) -> None:
        self._times.append(time_call(self.engine.step) * 1e3)
        self.advance(1)

    def finish(self, interleaved: bool) -> DecodeFigures:
        self._check()
        self.figures.decode_ms = self._times[self.warmup:]
        self.figures.kv_bytes_per_step = self.engine.stats.kv_bytes_last_step
        self.figures.interleaved = interleaved
        del self.engine, self.request
        _release_memory()
        return self.figures

    def _check(self) -> None:
        if self.request.finish_reason in ("error", "cancelled"):
            raise RuntimeError(f"the profiled request ended with {self.request.finish_reason}: {self.request.error}")


def measure_decode(loaded, configs: list[OvalConfig], prompt: list[int], warmup: int, steps: int,
                   prefill_chunk: int, interleave: bool, advance: Advance) -> list[DecodeFigures]:
    """Decode figures per config (same order): stepped in turn when `interleave`, else one after another."""
    if not interleave:
        out = []
        for config in configs:
            probe = DecodeProbe(loaded, config, prompt, warmup, steps, prefill_chunk, advance)
            while not probe.done:
                probe.step()
            out.append(probe.finish(False))
        return out
    probes = [DecodeProbe(loaded, c, prompt, warmup, steps, prefill_chunk, advance) for c in configs]
    turn = 0
    while not all(p.done for p in probes):
        for i in range(len(probes)):  # rotate who goes first, so no page size always follows the same one
            probe = probes[(turn + i) % len(probes)]
            if not probe.done:
                probe.step()
        turn += 1
    return [p.finish(True) for p in probes]


def _seal_times(pool, seq_id, prefill_chunk: int) -> tuple[float | None, float | None, int | None]:
    """(ms to seal one prefill chunk's pages as one call, ms to seal one page, pages in that chunk)."""
    sealed = pool.page_table(seq_id)[: pool.sealed_pages(seq_id)]
    if not sealed:
        return None, None, None
    chunk = sealed[: max(1, min(len(sealed), prefill_chunk // pool.page_size))]
    sync = device_sync(pool.device)
    batch = median(repeat_times(lambda: pool.seal(chunk), SEAL_REPEATS, sync=sync)) * 1e3
    one = median(repeat_times(lambda: pool.seal(chunk[:1]), SEAL_REPEATS, sync=sync)) * 1e3
    return batch, one, len(chunk)


def _release_memory() -> None:
    """Hand freed pools back to the OS, so that the next pool is sized from the same resident memory."""
    from oval_edge.runtime.model.heap import return_freed_memory

    return_freed_memory()  # gc.collect() + malloc_trim
    if torch.cuda.is_available():
        # On CUDA build_pool counts torch's reserved memory as in use: hand the freed pool's cached blocks back.
        torch.cuda.empty_cache()


@dataclass
class Fidelity:
    kl: float
    top1: float
    ppl: float
    steps: int


def measure_fidelity(loaded, ids: list[int], start: int, oval: OvalConfig, prefill_chunk: int,
                     show_progress: bool) -> Fidelity:
    """KL(dense || OVAL), top-1 agreement and perplexity over ids[start:] (ids[:start] prefilled densely)."""
    from oval_edge.tools.eval.fidelity import run_fidelity
    from oval_edge.tools.eval.policies import Policy

    policies = [Policy("dense"), Policy("oval", oval.top_k, float(oval.eta))]
    rows = run_fidelity(loaded, ids, start, oval, policies, [oval.page_size], prefill_chunk,
                        show_progress=show_progress)
    _release_memory()
    row = rows[1]
    return Fidelity(kl=row.kl, top1=row.top1, ppl=row.ppl, steps=row.steps)
