"""Engine settings and the one-time sizing of the page pool from the memory budget ([R-pool])."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from oval_edge.config import DEFAULT_PREFILL_CHUNK, OvalConfig
from oval_edge.geometry import (KVGeometry, decode_graph_bytes, kv_dims, kv_sharing, prefill_workspace_bytes,
                                ring_head_dim, ring_layout, stage_pages_for)
from oval_edge.pool_sizing import size_pool
from oval_edge.state_layout import state_layout
from oval_edge.kernels.cpu import describe_kernels
from oval_edge.kv.store.layout import StoreLayout
from oval_edge.kv.store.mirror import DenseMirror
from oval_edge.kv.store.page_file import PageStore, layer_bytes_for
from oval_edge.kv.pool import PagePool
from oval_edge.sparse.selection import window_slots
from oval_edge.runtime.model.loader import LoadedModel
from oval_edge.units import format_bytes

from .crossover import default_oval_from
from .memory import available_bytes, process_rss_bytes

log = logging.getLogger("oval_edge.engine")
DECODE_STEPS = ("static", "compiled", "eager")


@dataclass(frozen=True)
class EngineConfig:
    """max_batch     sequences decoded together in one step
    max_queue     requests that may wait for pages before new ones get 503
    prefill_chunk prompt tokens of one request per step (bounds prefill memory; long prompts interleave with decode)
    max_step_tokens tokens one step's forward carries: every running row's next token first, then prompt chunks
                  of one or more requests in the rest (vLLM's max_num_batched_tokens); default max_batch +
                  prefill_chunk. Lower it to shorten the pause a prompt causes in running streams
    attention     'oval' or 'dense' (dense reads every cached token: the baseline in the same runtime)
    oval_from     with attention='oval': a decode step whose longest row is shorter than this many tokens runs the
                  dense step (faster there: OVAL's scoring costs more than the pages it skips), OVAL from it on;
                  0 = OVAL at every length, None = the device's measured default (runtime/engine/crossover.py;
                  `oval-edge profile` measures this device's and writes it to the TOML)
    num_pages     fix the pool size instead of deriving it from the budget (tests, eval)
    max_model_len cap on prompt + max_tokens (default: the model's context length)
    summary_kinds page summaries to keep (default: the configured scorer's); eval keeps both
    decode_step   'static' (default: the static step of static_step.py, run eager on a CPU and captured into
                  CUDA graphs on CUDA), 'compiled' (the same step through torch.compile, compiled once per batch
                  bucket on first use), 'eager' (the same static step, never captured or compiled: the only
                  decode is the static step)
    cuda_graphs   on CUDA, capture the static step of every batch bucket at startup and replay it (cuda_graph.py);
                  False runs it eager (A/B measurements, debugging)
    prefix_cache  map a new prompt's longest run of full pages already in the pool (oval_edge/kv/prefix_cache.py)
                  and prefill only the rest; pages a request leaves stay cached until the room is needed
    pool_tokens   cap the in-memory pool at this many tokens, below what the budget allows (memory left to other
                  processes on the board; small pools to try the page store)
    kv_store      a file (or folder) on the NVMe drive for sealed pages beyond the pool (oval_edge/kv/store/page_file.py):
                  created at full size at startup, removed at exit; records stay in memory, selection recalls pages
    kv_store_size its size in bytes (default None: room for max_batch requests of max_model_len tokens; records
                  of every block stay in memory, so a store far larger than that only costs memory)
    recall_pages  frames per layer that stored pages are recalled into (default max_batch x KV heads x top_k: what
                  one step's selection can name)
    kv_store_checksums  crc32 every stored page and check it on every read (debug)
    state_snapshots  copies of what a sequence keeps beside its pages, for prefix caching: a hybrid model's
                  (Qwen3.5, LFM2) layer states, a sliding-window model's (Gemma 2/3/4) ring windows; taken where a
                  prompt's last full page ends and at the latest page boundary of each answer (oval_edge/kv/
                  snapshots.py); each costs one sequence's states and rings from the budget. Default None: 2 x
                  max_batch for a hybrid, 0 (prefix caching off) for sliding layers; 0 turns prefix caching off
    """

    max_batch: int = 4
    max_queue: int = 64
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_step_tokens: int | None = None
    attention: str = "oval"
    oval_from: int | None = None
    num_pages: int | None = None
    max_model_len: int | None = None
    summary_kinds: tuple[str, ...] | None = None
    decode_step: str = "static"
    cuda_graphs: bool = True
    prefix_cache: bool = True
    pool_tokens: int | None = None
    kv_store: str | None = None
    kv_store_size: int | None = None
    recall_pages: int | None = None
    kv_store_checksums: bool = False
    state_snapshots: int | None = None

    def __post_init__(self) -> None:
        for name, low, high in (("max_batch", 1, 1024), ("max_queue", 0, 1_000_000), ("prefill_chunk", 16, 65536)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name}={value!r} is out of range: allowed integers in [{low}, {high}]")
        if self.max_step_tokens is not None:
            value = self.max_step_tokens
            if isinstance(value, bool) or not isinstance(value, int) or not self.max_batch < value <= 1 << 20:
                raise ValueError(f"max_step_tokens={value!r} must be an integer above max_batch={self.max_batch}: "
                                 "every running row adds one token per step and prompts need the rest")
        if self.attention not in ("oval", "dense"):
            raise ValueError(f"attention={self.attention!r} is unknown; allowed: oval, dense")
        start = self.oval_from
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= 1 << 24):
            raise ValueError(f"oval_from={start!r} must be a context length in tokens in [0, {1 << 24}] (0: OVAL at "
                             "every length) or unset for the device's default; `oval-edge profile` measures it")
        if self.decode_step not in DECODE_STEPS:
            raise ValueError(f"decode_step={self.decode_step!r} is unknown; allowed: {', '.join(DECODE_STEPS)}")
        for name in ("cuda_graphs", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 1):
            raise ValueError(f"num_pages={self.num_pages!r} must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be an integer >= 2")
        snapshots = self.state_snapshots
        if snapshots is not None and (isinstance(snapshots, bool) or not isinstance(snapshots, int) or snapshots < 0):
            raise ValueError(f"state_snapshots={snapshots!r} must be an integer >= 0 (0: no prefix caching for a "
                             "hybrid or sliding-window model) or unset for the default")
        for name in ("pool_tokens", "recall_pages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.kv_store is not None and (not isinstance(self.kv_store, str) or not self.kv_store):
            raise ValueError(f"kv_store={self.kv_store!r} must be a path on the NVMe drive")
        size = self.kv_store_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"kv_store_size={size!r} must be a size in bytes, e.g. 16GiB (or unset: room for "
                             "max_batch requests of max_model_len tokens)")
        if not isinstance(self.kv_store_checksums, bool):
            raise ValueError(f"kv_store_checksums={self.kv_store_checksums!r} must be true or false")
        if self.kv_store is not None and self.decode_step == "compiled":
            raise ValueError("kv_store needs the eager decode (recalls are decided per layer on the host); use "
                             "decode_step='static' (it falls back to eager) or 'eager', not 'compiled'")


    @property
    def step_tokens(self) -> int:
        """The per-step token budget (max_step_tokens, or its default)."""
        return self.max_step_tokens if self.max_step_tokens is not None else self.max_batch + self.prefill_chunk


def resolve_oval_from(config: EngineConfig, device) -> int:
    """config.oval_from as the engine uses it: the configured length, or for None the device type's default
    (runtime/engine/crossover.py)."""
    return default_oval_from(device) if config.oval_from is None else config.oval_from


def pool_geometry(model_config, oval: OvalConfig, config: EngineConfig, device: torch.device,
                  activations: torch.dtype | None = None) -> KVGeometry:
    """The pool's shape for this model, config and device (the planner predicts the same one)."""
    act = None if activations is None else str(activations).removeprefix("torch.")
    oval = oval.for_context(model_config.max_position_embeddings)  # as Engine and the planner resolve it
    dtype = oval.pool_dtype(device.type, act)
    # a hybrid's conv states in the activations' dtype (the K/V's may be narrower), recurrent ones in fp32
    states = state_layout(model_config, act or dtype)
    return KVGeometry.for_oval(*kv_dims(model_config), oval, dtype, config.summary_kinds, ring_layout(model_config),
                               states, ring_head_dim(model_config), kv_sharing(model_config))


def uses_cuda_graphs(config: EngineConfig, device: torch.device) -> bool:
    """The static step is captured into CUDA graphs on CUDA unless turned off (runtime/engine/forward/cuda_graph.py)."""
    return device.type == "cuda" and config.decode_step == "static" and config.cuda_graphs


def describe_decode_step(engine) -> str:
    """Which decode step an Engine runs, for serve's startup report and bench's labels."""
    static = engine.static
    dense = f"; dense below {engine.oval_from} tokens" if engine.dense_static is not None else ""
    window = ", the window module's windows" if static.policy.window is not None else ""
    if engine.pool.store is not None:
        return f"static step, run eager (a page store: each layer recalls the stored pages its selection names){window}{dense}"
    if static.graphs is not None:
        return f"static step replayed from {static.graphs.explain()}{window}{dense}"
    if engine.config.decode_step == "compiled":
        return f"static step through torch.compile (inductor), compiled per batch bucket on first use{window}{dense}"
    off = " (CUDA graphs off)" if engine.loaded.device.type == "cuda" else ""
    return f"static step, run eager{off}{window}{dense}"


def build_pool(loaded: LoadedModel, oval: OvalConfig, config: EngineConfig, max_model_len: int) -> PagePool:
    c = loaded.config
    # Build (first run on this machine: a few seconds) and load the decode kernels now, not in the first request, and
    # before the reserve below is measured.
    log.info("decode kernels: %s", describe_kernels(loaded.device))
    geometry = pool_geometry(c, oval, config, loaded.device, loaded.dtype)
    salt = prefix_salt(loaded, oval, geometry) if config.prefix_cache else None
    snapshots = 0
    if salt is not None and (geometry.states is not None or geometry.ring_layers):
        # What a cached page chain does not give back, restored from copies taken at page boundaries: a hybrid's
        # layer states (default 2 x max_batch copies: they are small) and the sliding layers' windows (default
        # none: a copy is a whole ring per sliding layer, Gemma-3-4B 120 MiB at page 32)
        default = 2 * config.max_batch if geometry.states is not None else 0
        snapshots = default if config.state_snapshots is None else config.state_snapshots
        kept = " and ".join(what for what, present in (
            (f"the {len(geometry.state_layers)} state layers' states", geometry.states is not None),
            (f"the {len(geometry.ring_layers)} sliding layers' windows", bool(geometry.ring_layers))) if present)
        each = format_bytes(geometry.sequence_bytes)
        if snapshots == 0:
            log.info("prefix cache: off (%s at a cached page cannot be restored without snapshots; "
                     "state_snapshots = N keeps N copies of %s each)", kept, each)
            salt = None
        else:
            log.info("prefix cache: on, %d snapshots (%s each) restore %s where a cached prompt page ends",
                     snapshots, each, kept)
    if config.num_pages is None and geometry.paged_layers == 0:
        # Every layer on a window (Mistral v0.1, Phi-3-mini-4k): pages hold no bytes, only positions; enough of them
        # for max_batch sequences at full length, and the rings are the whole KV cache.
        config = dataclasses.replace(config, num_pages=config.max_batch * -(-max_model_len // oval.page_size))
    if oval.kv_int8 and config.decode_step == "compiled":  # step_ops' traced operators take no int8 scales
        raise ValueError("decode_step='compiled' does not take kv_dtype='int8'; use decode_step='static' (the "
                         "default) or 'eager'")
    stage = stage_pages_for(geometry, config.max_batch, config.step_tokens)
    store, tier = build_store(config, geometry, oval, max_model_len)
    if config.num_pages is not None:
        pages = check_resident(geometry, oval, config, store, config.num_pages)
        pool = PagePool(geometry, pages, loaded.device, eta=oval.eta, prefix_salt=salt,
                        ring_sequences=config.max_batch, stage_pages=stage, store=store,
                        state_snapshots=snapshots, **tier)
        log.info("KV pool: %d pages fixed by num_pages (%s)", pages, format_bytes(pool.nbytes()))
        return pool
    act_bytes = torch.finfo(loaded.dtype).bits // 8
    # the widest MLP (Gemma 4's KV-shared layers' are doubled); tools/plan reserves the same
    mlp = max(map(c.layer_intermediate, range(c.num_hidden_layers))) if hasattr(c, "layer_intermediate") \
        else c.intermediate_size
    workspace = prefill_workspace_bytes(
        c.hidden_size, mlp, c.num_attention_heads, geometry, config.prefill_chunk,
        max_model_len, act_bytes, step_tokens=config.step_tokens,
    )
    workspace += geometry.stage_bytes(stage)  # int8: open pages' keys kept for sealing (0 otherwise)
    if store is not None:  # recall frames, every stored page's record (records stay in memory), the dense mirror
        layout = tier["store_layout"]
        workspace += (layout.recall_pages * geometry.bytes_per_page + store.blocks * geometry.summary_bytes_per_page
                      + DenseMirror.bytes_for(geometry, layout.mirrored_layers, layout.recall_pages + store.blocks))
    if uses_cuda_graphs(config, loaded.device):  # the captured steps keep their blocks for the process's life
        workspace += decode_graph_bytes(c.hidden_size, mlp, c.num_attention_heads, c.vocab_size,
                                        geometry, config.max_batch, max_model_len, act_bytes)
    if loaded.device.type == "cuda":
        reserve = max(0, torch.cuda.memory_reserved(loaded.device) - loaded.weight_bytes)
    else:  # interpreter, torch, tokenizer: what this process holds besides the weights, measured now
        reserve = max(0, process_rss_bytes() - loaded.weight_bytes)
    budget = oval.memory_budget
    if budget is None:
        # Enough for max_batch sequences at full context, but never more than the memory there is.
        wanted = loaded.weight_bytes + workspace + reserve
        wanted += config.max_batch * (-(-max_model_len // oval.page_size) * geometry.bytes_per_page
                                      + geometry.sequence_bytes) + snapshots * geometry.sequence_bytes
        held = loaded.weight_bytes + reserve  # already inside `available` accounting below
        budget = min(wanted, held + int(0.8 * available_bytes(loaded.device)))
    sizing = size_pool(budget, loaded.weight_bytes, geometry, workspace, reserve, ring_sequences=config.max_batch,
                       state_snapshots=snapshots, ring_snapshots=snapshots if geometry.ring_layers else 0)
    log.info("KV pool: %s", sizing.explain())
    pages = sizing.pages
    mirror_per_frame = DenseMirror.bytes_for(geometry, tier["store_layout"].mirrored_layers, 1) if store else 0
    if mirror_per_frame:  # the dense mirror holds each frame's dense-layer rows too: fewer frames fit
        pages = max(1, pages * geometry.bytes_per_page // (geometry.bytes_per_page + mirror_per_frame))
        log.info("KV pool: %d pages once the dense layers' mirror of each frame is counted", pages)
    if config.pool_tokens is not None and config.pool_tokens < pages * oval.page_size:
        pages = max(1, config.pool_tokens // oval.page_size)
        log.info("KV pool: capped at %d pages by pool_tokens=%d", pages, config.pool_tokens)
    pages = check_resident(geometry, oval, config, store, pages)
    return PagePool(geometry, pages, loaded.device, eta=oval.eta, sizing=sizing, prefix_salt=salt,
                    ring_sequences=config.max_batch, stage_pages=stage, store=store, state_snapshots=snapshots, **tier)


def build_store(config: EngineConfig, geometry: KVGeometry, oval: OvalConfig,
                max_model_len: int) -> tuple[PageStore | None, dict]:
    """The page store (created now, at full size) and the pool's arguments for it; (None, {}) without one."""
    if config.kv_store is None:
        return None, {}
    g = geometry
    layer_bytes = layer_bytes_for(g.kv_heads, g.page_size, g.head_dim, 1 if g.kv_int8 else g.dtype_bytes, g.kv_int8)
    size = config.kv_store_size  # unset: every row at full length could live on disk
    if size is None:
        size = config.max_batch * -(-max_model_len // oval.page_size) * layer_bytes * g.paged_layers
    store = PageStore(config.kv_store, size, layer_bytes, g.paged_layers,
                      checksums=config.kv_store_checksums)
    recall = config.recall_pages or config.max_batch * g.kv_heads * max(oval.top_k, 1)
    keep_tail = -(-window_slots(oval) // oval.page_size) + 1  # the window's pages and the open one
    # Dense layers read every page every step: their rows of stored pages stay in memory (kv/store/mirror.py).
    mirrored = min(oval.dense_layers, g.paged_layers) if config.attention == "oval" else 0
    log.info("page store: %s; read %s/s (%d-byte reads); %d recall frames per layer; %d dense layers mirrored in "
             "memory (%s)", store.describe(), format_bytes(int(store.measure_read())), layer_bytes, recall, mirrored,
             format_bytes(DenseMirror.bytes_for(g, mirrored, recall + store.blocks)))  # frames' share: build_pool
    return store, {"store_layout": StoreLayout(recall, oval.sink_pages, keep_tail, mirrored)}


def check_resident(geometry: KVGeometry, oval: OvalConfig, config: EngineConfig, store, pages: int) -> int:
    """With a page store the frames must hold every row's kept pages (sink, window, open) and one prompt chunk."""
    if store is None:
        return pages
    keep = oval.sink_pages + -(-window_slots(oval) // oval.page_size) + 2
    need = config.max_batch * keep + -(-config.prefill_chunk // oval.page_size)
    if pages < need:
        raise ValueError(f"the in-memory pool holds {pages} pages, but with a page store it needs at least {need} "
                         f"({config.max_batch} rows x {keep} kept pages + one prompt chunk of {config.prefill_chunk} "
                         "tokens); raise memory_budget or pool_tokens, or lower max_batch or prefill_chunk")
    return pages


def prefix_salt(loaded: LoadedModel, oval: OvalConfig, geometry: KVGeometry) -> bytes:
    """What decides a page's K/V and summary besides its tokens: a cached page is only found by a request that would
    have computed the same (the model file, its quantization and dtypes, the page geometry, the record's eta)."""
    path = getattr(loaded.source, "path", None)
    try:
        stamp = os.stat(path)
        identity = f"{path}|{stamp.st_size}|{stamp.st_mtime_ns}"
    except (OSError, TypeError):  # no file behind the model (built in-process): this model object alone
        identity = f"{path or 'in-process model'}@{id(loaded.model)}"
    return "|".join((identity, loaded.quant, str(loaded.dtype), repr(geometry), f"eta={oval.eta}")).encode()
