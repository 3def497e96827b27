"""Prometheus metrics of one server: its own CollectorRegistry (no global registry, so apps never collide).

Engine figures (pages, queue, tokens, decode speed, what OVAL read) are read from the engine at scrape time by a
custom collector, so /metrics is never stale and the engine keeps no second copy of them. Request timings that
only the HTTP layer sees (time to first token, duration, outcome) are ordinary histograms and counters.

LLM-aware routers (the llm-d / Gateway API Inference Extension endpoint picker, by default) read a few gauges under
vLLM's names; `_router_metrics` publishes those from the same counters, so a pool of oval-edge servers is scored
without any metric mapping. Their parser (Go expfmt) reads a gauge's value and `cache_config_info`'s labels as
decimal integers; tests/test_router_metrics.py checks our output the same way.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from oval_edge.kv.store.stats import RECALL_BUCKETS, StoreStats

PREFIX = "oval_edge"
ROUTER_PREFIX = "vllm"  # the names routers expect by default (vLLM's), not ours
# Seconds; CPU decode of a small model and Orin decode of a 7B model both land inside this range.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    """Yields the engine's gauges and counters when asked; `status()` -> (status string, engine or None)."""

    def __init__(self, status: Callable[[], tuple[str, object]]):
        self._status = status

    def collect(self):
        status, engine = self._status()
        yield _gauge("ready", "1 when the model is loaded and requests are admitted", 1.0 if status == "ready" else 0.0)
        yield _gauge("draining", "1 after SIGTERM: no new requests, running ones finish", float(status == "draining"))
        if engine is None:
            return
        pool, stats = engine.pool, engine.stats
        total, free = pool.num_pages, pool.num_free  # read the pool itself: a cancel frees pages between steps
        yield _gauge("kv_pages_used", "KV pages held by requests", total - free)
        yield _gauge("kv_pages_free", "KV pages a request can take: the free list and the cached pages (below)", free)
        yield _gauge("kv_usage_ratio", "used / total KV pages", (total - free) / total if total else 0.0)
        rings = pool.rings
        if rings is not None:
            yield _gauge("kv_rings_used", "rings held by requests", rings.sequences - rings.num_free)
        if pool.states is not None:
            yield _gauge("state_slots_used", "state slots held by requests", pool.states.slots - pool.states.num_free)
        yield _gauge("requests_running", "requests in prefill or decode", stats.running)
        yield _gauge("requests_waiting", "requests queued for pages or a batch slot", stats.waiting)
        yield _counter("requests_refused", "requests the engine refused (too long, or the queue was full)",
                       stats.refused)
        yield _counter("requests_cancelled", "requests cancelled (client disconnect, shutdown)", stats.cancelled)
        yield _counter("requests_preempted", "times a request's pages were freed to let older rows grow (it recomputed "
                       "them when readmitted)", stats.preemptions)
        yield _counter("mixed_steps", "engine steps that carried decode rows and prompt chunks in one forward",
                       stats.mixed_steps)
        yield _counter("engine_errors", "engine steps that failed (their requests got an error)", stats.errors)
        yield _counter("prompt_tokens", "prompt tokens prefilled", stats.prompt_tokens)
        yield _counter("generation_tokens", "tokens generated", stats.generated_tokens)
        yield _counter("decode_steps", "batched decode steps run", stats.decode_steps)
        yield _gauge("decode_tokens_per_second", "tokens per second over the last 64 decode steps",
                     stats.decode_tokens_per_second)
        yield _gauge("attended_tokens_per_layer", "mean tokens attended per row, layer and KV head (last step)",
                     stats.attended_per_row_layer)
        yield _gauge("window_tokens_mean", "mean local window length in sparse layers (last step)", stats.window_mean)
        yield _gauge("kv_bytes_read_last_step", "bytes of K and V gathered by the last decode step, all layers",
                     stats.kv_bytes_last_step)
        yield _gauge("summary_bytes_read_last_step", "bytes of page records (summaries) the last decode step's "
                     "scoring read, all layers", stats.summary_bytes_last_step)
        yield _gauge("state_bytes_read_last_step", "bytes of a hybrid model's layer states (conv and recurrent) the "
                     "last decode step read, all rows", stats.state_bytes_last_step)
        yield _counter("sparse_layer_steps", "layer-steps decoded with OVAL page selection", stats.sparse_layer_steps)
        yield from _reuse_metrics(getattr(engine, "reuse", None))
        yield from _prefix_metrics(pool)
        yield from _group_metrics(pool)
        yield from _store_metrics(pool)
        yield from _router_metrics(stats, total, free)


def _engine_facts(engine):
    """What cannot change once the engine is loaded (the pool is allocated once): rendered once per engine."""
    pool = engine.pool
    yield _gauge("kv_pages_total", "KV pages in the pool (allocated once at startup)", pool.num_pages)
    yield _gauge("kv_page_size_tokens", "tokens per KV page", pool.page_size)
    yield _gauge("kv_pool_bytes", "bytes of the KV pool (K, V and page summaries; the rings below included)",
                 pool.nbytes())
    g, rings = pool.geometry, pool.rings
    yield _gauge("kv_paged_layers", "layers whose K/V live in pages (OVAL-scored)", g.paged_layers)
    yield _gauge("kv_sliding_layers", "sliding-window layers whose K/V live in per-sequence rings", len(g.ring_layers))
    if rings is not None:
        yield _gauge("kv_rings_total", "per-sequence rings of the sliding layers (allocated once)", rings.sequences)
        yield _gauge("kv_ring_pages_per_sequence", "pages one ring holds per sliding layer", g.ring_pages)
        yield _gauge("kv_ring_snapshots_total", "ring copies kept for prefix caching (allocated once; state_snapshots)",
                     rings.snapshots)
        yield _gauge("kv_ring_bytes", "bytes of all rings and their snapshots", rings.nbytes())
    states = pool.states
    yield _gauge("state_layers", "a hybrid's layers that keep a fixed state per sequence (linear attention, short "
                 "conv) instead of K/V", len(g.state_layers))
    if states is not None:
        yield _gauge("state_slots_total", "per-sequence state slots (allocated once, one per running sequence)",
                     states.slots)
        yield _gauge("state_bytes_per_sequence", "conv and recurrent state bytes of one sequence, all state layers",
                     g.state_bytes_per_sequence)
        yield _gauge("state_snapshots_total", "state copies kept for prefix caching (allocated once)",
                     states.snapshots)
        yield _gauge("state_bytes", "bytes of all state slots and snapshots", states.nbytes())
    yield _gauge("token_limit", "longest prompt + max_tokens one request may have", engine.token_limit())
    if pool.sizing is not None:
        yield _gauge("memory_budget_bytes", "the budget the pool was sized from", pool.sizing.budget_bytes)
    yield _gauge("weight_bytes", "bytes of model weights as loaded (4-bit codes + scales + the rest)",
                 engine.loaded.weight_bytes)
    yield _gauge("prefix_cache_enabled", "1 when full pages are shared between requests by prefix",
                 float(pool.ledger.enabled))
    tier = pool.store
    yield _gauge("kv_store_enabled", "1 when sealed pages beyond the in-memory pool go to a page store on disk",
                 float(tier is not None))
    yield _gauge("kv_store_pages_total", "pages the page store holds (its file, allocated at startup)",
                 tier.blocks if tier is not None else 0)
    reuse = getattr(engine, "reuse", None)
    yield _gauge("selection_reuse_tau", "query cosine needed to reuse a recent page selection (0: reuse is off)",
                 reuse.tau if reuse is not None else 0.0)
    # Info-style: value 1, the facts in labels. block_size is tokens per page, num_gpu_blocks the pool's page count
    # (allocated once, so it never changes); the router's prefix model hashes prompts in blocks of this size.
    info = GaugeMetricFamily(f"{ROUTER_PREFIX}:cache_config_info", "KV cache geometry: tokens per page, pages",
                             labels=["block_size", "num_gpu_blocks"])
    info.add_metric([str(pool.page_size), str(pool.num_pages)], 1.0)
    yield info


class _Facts:
    def __init__(self, engine):
        self._engine = engine

    def collect(self):
        return _engine_facts(self._engine)


def _router_metrics(stats, total: int, free: int):
    """vLLM-named gauges for routers, from the figures above (read once per scrape, so both names agree)."""
    yield GaugeMetricFamily(f"{ROUTER_PREFIX}:num_requests_waiting", "requests queued (oval_edge_requests_waiting)",
                            value=float(stats.waiting))
    yield GaugeMetricFamily(f"{ROUTER_PREFIX}:num_requests_running", "requests in prefill or decode "
                            "(oval_edge_requests_running)", value=float(stats.running))
    # A fraction in 0..1, as vLLM's: pages held by requests over all pages; cached prefix pages count as free,
    # because an allocation may reclaim them (the same figure as oval_edge_kv_usage_ratio).
    yield GaugeMetricFamily(f"{ROUTER_PREFIX}:kv_cache_usage_perc", "KV pages held by requests / all KV pages (0..1)",
                            value=(total - free) / total if total else 0.0)


def _prefix_metrics(pool):
    """Prefix caching (oval_edge/kv/prefix_cache.py): always exported, zero when it is off."""
    ledger = pool.ledger
    stats = ledger.stats
    yield _gauge("kv_pages_cached", "pages no request holds, kept for prefix hits (reclaimed when needed)",
                 pool.num_cached)
    yield _counter("prefix_cache_queries", "prompts looked up in the prefix cache", stats.queries)
    yield _counter("prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache", stats.query_tokens)
    yield _counter("prefix_cache_hit_tokens", "prompt tokens mapped from cached pages instead of prefilled",
                   stats.hit_tokens)
    yield _counter("prefix_cache_evictions", "cached pages reclaimed for new allocations", stats.evictions)


def _group_metrics(pool):
    """Two-level scoring's coarse record slots (oval_edge/kv/records/group_slots.py): zero when scoring is flat."""
    slots = pool.group_slots
    yield _gauge("group_record_slots_used", f"coarse page-group records held, of {slots.count} slots", slots.used)
    yield _counter("group_records_missing", "page groups sealed with no free record slot (their pages are scored "
                   "finely every step instead)", slots.shortfalls)


def _store_metrics(pool):
    """The page store on disk (oval_edge/kv/store/): always exported, zero without a store, so series never vanish."""
    tier = pool.store
    stats = tier.stats if tier is not None else StoreStats()
    yield _gauge("kv_pages_resident", "in-memory KV frames held by requests (a shared prefix page counts once)",
                 pool.num_used)
    yield _gauge("kv_pages_stored", "page store blocks in use: pages written there, or reserved for a request's next "
                 "pages", tier.stored_pages() if tier is not None else 0)
    yield _counter("kv_store_spills", "sealed pages written to the page store to free a frame", stats.spills)
    yield _counter("kv_store_recall_hits", "stored page-layers a selection named that were still in the layer's "
                   "recall frames", stats.recall_hits)
    yield _counter("kv_store_recall_misses", "stored page-layers a selection named that were read from the drive "
                   "into a recall frame", stats.recall_misses)
    yield _counter("kv_store_transient_reads", "stored page-layers read for one wide read (a prompt chunk over a long "
                   "history, a selection beyond the recall frames), not kept", stats.transient_reads)
    yield _counter("kv_store_mirror_reads", "dense-layer reads served from the in-memory mirror of every page "
                   "(no disk read)", stats.mirror_reads)
    yield _counter("kv_store_read_bytes", "bytes read from the page store", stats.bytes_read)
    yield _counter("kv_store_written_bytes", "bytes written to the page store", stats.bytes_written)
    looked = stats.recall_hits + stats.recall_misses
    yield _gauge("kv_store_recall_hit_ratio", "recall hits / (hits + misses) since startup (0 before any recall)",
                 stats.recall_hits / looked if looked else 0.0)
    recent = stats.reads_per_step
    yield _gauge("kv_store_reads_per_step", "mean page-layers read from the store per step, over the last (at most "
                 "256) steps that read from it", sum(recent) / len(recent) if recent else 0.0)
    # latency: a count per bucket of RECALL_BUCKETS, the overflow, then the sum; Prometheus wants cumulative counts.
    counts, cumulative, buckets = stats.latency[:-1], 0.0, []
    for bound, count in zip((*RECALL_BUCKETS, float("inf")), counts):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    yield HistogramMetricFamily(f"{PREFIX}_kv_store_read_seconds", "time of one layer's reads from the page store "
                                "(a recall's misses, or a dense read's stored pages)", buckets=buckets,
                                sum_value=stats.latency[-1])


def _reuse_metrics(reuse):
    """Selection reuse (oval_edge/sparse/reuse.py): always exported, zero when reuse is off, so series never vanish."""
    counts = reuse.counts if reuse is not None else None
    yield _counter("selection_reuse_lookups", "sparse row-layer decode steps that looked for a reusable selection",
                   counts.lookups if counts else 0)
    yield _counter("selection_reuse_hits", "row-layer decode steps that reused a recent selection (not scored)",
                   counts.hits if counts else 0)
    yield _counter("selection_reuse_head_lookups", "KV heads looked up (lookups x KV heads)",
                   counts.head_lookups if counts else 0)
    yield _counter("selection_reuse_head_hits", "KV heads whose query matched a recent selection on their own",
                   counts.head_hits if counts else 0)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", documentation, value=float(value))


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", documentation, value=float(value))


class ServerMetrics:
    """One app's metrics. `status` returns (status, engine-or-None) each scrape."""

    def __init__(self, status: Callable[[], tuple[str, object]]):
        self._status = status
        self._facts: tuple[object, bytes] | None = None  # (engine, its facts rendered)
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(status))
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "from request arrival to the first generated token",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.request_duration = Histogram(
            f"{PREFIX}_request_duration_seconds", "from request arrival to its last byte of output",
            buckets=DURATION_BUCKETS, registry=self.registry,
        )
        self.requests = Counter(
            f"{PREFIX}_http_requests", "generation requests by endpoint and outcome "
            "(stop, length, disconnected, cancelled, error, rejected, busy, unavailable)",
            ["endpoint", "outcome"], registry=self.registry,
        )

    def observe(self, endpoint: str, outcome: str, ttft_s: float | None = None, total_s: float | None = None) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
        if total_s is not None:
            self.request_duration.observe(total_s)

    def render(self) -> tuple[bytes, str]:
        """The exposition text: the engine's fixed facts (rendered once per engine: a router scrapes every 50 ms
        and each scrape holds the GIL the engine thread needs), then everything that moves."""
        engine = self._status()[1]
        if engine is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        if self._facts is None or self._facts[0] is not engine:
            facts = CollectorRegistry(auto_describe=False)
            facts.register(_Facts(engine))
            self._facts = (engine, generate_latest(facts))
        return self._facts[1] + generate_latest(self.registry), CONTENT_TYPE_LATEST
