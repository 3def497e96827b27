"""Engine settings and the one-time sizing of the page pool from the memory budget (DESIGN §3)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from oval_edge.config import DEFAULT_PREFILL_CHUNK, OvalConfig
from oval_edge.geometry import (KVGeometry, decode_graph_bytes, kv_dims, prefill_workspace_bytes, ring_layout,
                                stage_pages_for)
from oval_edge.pool_sizing import size_pool
from oval_edge.kernels.cpu import describe_kernels
from oval_edge.kv.pool import PagePool
from oval_edge.runtime.model.loader import LoadedModel
from oval_edge.units import format_bytes

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
    num_pages     fix the pool size instead of deriving it from the budget (tests, eval)
    max_model_len cap on prompt + max_tokens (default: the model's context length)
    summary_kinds page summaries to keep (default: the configured scorer's); eval keeps both
    decode_step   'static' (default: the static step of static_step.py, run eager on a CPU and captured into
                  CUDA graphs on CUDA), 'compiled' (the same step through torch.compile, compiled once per batch
                  bucket on first use), 'eager' (the flexible forward that follows the context's shape; used anyway
                  while a decode hook is installed)
    cuda_graphs   on CUDA, capture the static step of every batch bucket at startup and replay it (cuda_graph.py);
                  False runs it eager (A/B measurements, debugging)
    prefix_cache  map a new prompt's longest run of full pages already in the pool (oval_edge/kv/prefix_cache.py)
                  and prefill only the rest; pages a request leaves stay cached until the room is needed
    """

    max_batch: int = 4
    max_queue: int = 64
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_step_tokens: int | None = None
    attention: str = "oval"
    num_pages: int | None = None
    max_model_len: int | None = None
    summary_kinds: tuple[str, ...] | None = None
    decode_step: str = "static"
    cuda_graphs: bool = True
    prefix_cache: bool = True

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
        if self.decode_step not in DECODE_STEPS:
            raise ValueError(f"decode_step={self.decode_step!r} is unknown; allowed: {', '.join(DECODE_STEPS)}")
        for name in ("cuda_graphs", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 1):
            raise ValueError(f"num_pages={self.num_pages!r} must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be an integer >= 2")


    @property
    def step_tokens(self) -> int:
        """The per-step token budget (max_step_tokens, or its default)."""
        return self.max_step_tokens if self.max_step_tokens is not None else self.max_batch + self.prefill_chunk


def pool_geometry(model_config, oval: OvalConfig, config: EngineConfig, device: torch.device,
                  activations: torch.dtype | None = None) -> KVGeometry:
    """The pool's shape for this model, config and device (the planner predicts the same one)."""
    act = None if activations is None else str(activations).removeprefix("torch.")
    return KVGeometry.for_oval(*kv_dims(model_config), oval, oval.pool_dtype(device.type, act), config.summary_kinds,
                               ring_layout(model_config))


def uses_cuda_graphs(config: EngineConfig, device: torch.device) -> bool:
    """The static step is captured into CUDA graphs on CUDA unless turned off (runtime/engine/forward/cuda_graph.py)."""
    return device.type == "cuda" and config.decode_step == "static" and config.cuda_graphs


def build_pool(loaded: LoadedModel, oval: OvalConfig, config: EngineConfig, max_model_len: int) -> PagePool:
    c = loaded.config
    # Build (first run on this machine: a few seconds) and load the decode kernels now, not in the first request, and
    # before the reserve below is measured.
    log.info("decode kernels: %s", describe_kernels(loaded.device))
    geometry = pool_geometry(c, oval, config, loaded.device, loaded.dtype)
    salt = prefix_salt(loaded, oval, geometry) if config.prefix_cache else None
    if salt is not None and geometry.ring_layers:
        log.info("prefix cache: off (%d sliding-window layers keep only their window; a cached page's keys are "
                 "gone from their rings)", len(geometry.ring_layers))
        salt = None
    if config.num_pages is None and geometry.paged_layers == 0:
        # Every layer on a window (Mistral v0.1, Phi-3-mini-4k): pages hold no bytes, only positions; enough of them
        # for max_batch sequences at full length, and the rings are the whole KV cache.
        config = dataclasses.replace(config, num_pages=config.max_batch * -(-max_model_len // oval.page_size))
    if oval.kv_int8 and config.decode_step == "compiled":  # step_ops' traced operators take no int8 scales
        raise ValueError("decode_step='compiled' does not take kv_dtype='int8'; use decode_step='static' (the "
                         "default) or 'eager'")
    stage = stage_pages_for(geometry, config.max_batch, config.step_tokens)
    if config.num_pages is not None:
        pool = PagePool(geometry, config.num_pages, loaded.device, eta=oval.eta, prefix_salt=salt,
                        ring_sequences=config.max_batch, stage_pages=stage)
        log.info("KV pool: %d pages fixed by num_pages (%s)", config.num_pages, format_bytes(pool.nbytes()))
        return pool
    act_bytes = torch.finfo(loaded.dtype).bits // 8
    workspace = prefill_workspace_bytes(
        c.hidden_size, c.intermediate_size, c.num_attention_heads, geometry, config.prefill_chunk,
        max_model_len, act_bytes, step_tokens=config.step_tokens,
    )
    workspace += geometry.stage_bytes(stage)  # int8: open pages' keys kept for sealing (0 otherwise)
    if uses_cuda_graphs(config, loaded.device):  # the captured steps keep their blocks for the process's life
        workspace += decode_graph_bytes(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.vocab_size,
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
                                      + geometry.ring_bytes_per_sequence)
        held = loaded.weight_bytes + reserve  # already inside `available` accounting below
        budget = min(wanted, held + int(0.8 * available_bytes(loaded.device)))
    sizing = size_pool(budget, loaded.weight_bytes, geometry, workspace, reserve, ring_sequences=config.max_batch)
    log.info("KV pool: %s", sizing.explain())
    return PagePool(geometry, sizing.pages, loaded.device, eta=oval.eta, sizing=sizing, prefix_salt=salt,
                    ring_sequences=config.max_batch, stage_pages=stage)


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
