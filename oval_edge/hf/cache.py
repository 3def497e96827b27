"""A transformers `Cache` whose keys and values live in one OVAL `PagePool` ([R-pool, R-interfaces]).

transformers calls `cache.update(k, v, layer)` in every attention layer (keys already rotated, [B, Hkv, n, D]) and
then the registered attention function with what `update` returned. `OvalCache.update` writes the new tokens
into the pool and returns them tagged with an `OvalCall` (pool, config, layer, `StepIndex`): so the OVAL attention
function in `integration` finds the pool without global state. Batch rows are pool sequences; positions are the
pool's own lengths, so they stay absolute when generation continues from a cache.
"""

from __future__ import annotations

import math
import uuid
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from oval_edge.config import OvalConfig
from oval_edge.geometry import KVGeometry, kv_dims
from oval_edge.pool_sizing import size_pool
from oval_edge.kv.pool import PagePool
from oval_edge.kv.step_index import StepIndex
from oval_edge.kv.records.summaries import output_metric_sqrt
from oval_edge.sparse.selection import Selection

OVAL_ATTENTION_PREFIX = "oval"
# Attribute set on the key tensor `update` returns; read by the attention function.
OVAL_CALL_ATTR = "_oval_call"


def is_oval_attention(name: str | None) -> bool:
    """Names the OVAL attention is registered under: 'oval' (falls back to sdpa) or 'oval_<original>'."""
    return isinstance(name, str) and (name == OVAL_ATTENTION_PREFIX or name.startswith(OVAL_ATTENTION_PREFIX + "_"))


@dataclass
class OvalStats:
    """What the decode steps read. Slots are counted per KV head, summed over layers and rows."""

    prefill_tokens: int = 0
    decode_steps: int = 0  # forward passes with one new token per row
    sparse_layer_steps: int = 0  # (layer, row) decode attentions that selected pages
    dense_layer_steps: int = 0  # (layer, row) decode attentions over every position (dense layers, short rows)
    slots_read: int = 0  # K/V slots really attended at decode steps
    context_slots: int = 0  # what dense attention would have read at the same steps

    @property
    def read_fraction(self) -> float:
        return self.slots_read / self.context_slots if self.context_slots else 0.0


class OvalState:
    """One model's OVAL resources: the page pool (allocated once), the config, statistics and selection hooks."""

    def __init__(self, model_config, config: OvalConfig, pool: PagePool) -> None:
        self.model_config = model_config  # the transformers config: tells whether OVAL attention is still on
        self.config = config
        self.pool = pool
        self.stats = OvalStats()
        self._hooks: list[Callable[[int, Selection, StepIndex], None]] = []

    num_layers = property(lambda self: self.pool.geometry.layers)

    def add_selection_hook(self, hook: Callable[[int, Selection, StepIndex], None]) -> Callable[[], None]:
        """Call `hook(layer, selection, step)` after every decode attention; returns a function that removes it."""
        self._hooks.append(hook)
        return lambda: self._hooks.remove(hook) if hook in self._hooks else None

    def record_decode(self, layer: int, selection: Selection, step: StepIndex) -> None:
        stats = self.stats
        if layer == 0:
            stats.decode_steps += 1
        sparse = int(selection.sparse_rows.sum())
        stats.sparse_layer_steps += sparse
        stats.dense_layer_steps += selection.sparse_rows.numel() - sparse
        stats.slots_read += int(selection.valid.sum())
        stats.context_slots += int(step.lengths.sum()) * self.pool.geometry.kv_heads
        for hook in list(self._hooks):
            hook(layer, selection, step)

    def describe(self) -> str:
        pool = self.pool
        head = (f"OVAL page pool: {pool.num_pages} pages x {pool.page_size} tokens ({pool.nbytes()} bytes, K/V "
                f"{pool.geometry.kv_label})")
        return f"{head}; {pool.sizing.explain()}" if pool.sizing is not None else head


@dataclass
class OvalCall:
    """What the attention function needs for one layer of one forward step."""

    state: OvalState
    layer: int
    step: StepIndex


# kv_dtype='int8': staged open pages (kv/int8.py); more in one call are sealed from dequantized keys (misses)
HF_STAGE_PAGES = 64


def resolve_kv_dtype(config: OvalConfig, device: torch.device, model_dtype: torch.dtype) -> str:
    if config.kv_dtype not in ("auto", "int8"):
        return config.kv_dtype
    if device.type == "cuda":  # half precision on GPUs: the model's own if it is half, else float16
        return {torch.bfloat16: "bfloat16"}.get(model_dtype, "float16")
    return "float32"


def build_state(model, config: OvalConfig, num_pages: int | None = None) -> OvalState:
    """Allocate the pool once: `num_pages` if given, else from `config.memory_budget` minus the model's weights,
    else one sequence at the model's full context (`max_position_embeddings`)."""
    param, config = next(model.parameters()), config.for_context(model.config.max_position_embeddings)
    device = param.device
    geometry = KVGeometry.for_oval(*kv_dims(model.config), config, resolve_kv_dtype(config, device, param.dtype))
    sizing = None
    if num_pages is not None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages={num_pages!r} must be a positive integer (pages of {config.page_size} tokens)")
    elif config.memory_budget is not None:
        tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}  # tied weights count once
        weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        sizing = size_pool(config.memory_budget, weight_bytes, geometry)
        num_pages = sizing.pages
    else:
        num_pages = math.ceil(model.config.max_position_embeddings / config.page_size)
    pool = PagePool(geometry, num_pages, device=device, eta=config.eta, sizing=sizing,
                    stage_pages=min(num_pages, HF_STAGE_PAGES))
    if config.eta > 0 and "basis" in pool.summaries:  # records with eta > 0 weigh values by W_O ([R-page-score])
        c, project = model.config, lambda o_proj: (lambda x: o_proj(x.to(param.dtype)).float())
        pool.set_output_metric([output_metric_sqrt(project(layer.self_attn.o_proj), c.num_attention_heads,
                                                   geometry.kv_heads, geometry.head_dim, device)
                                for layer in model.model.layers])
    return OvalState(model.config, config, pool)


def shortfall_message(pool: PagePool, rows: int, tokens: int) -> str:
    """Why `rows` sequences of `tokens` tokens do not fit, and what to change."""
    return (
        f"the OVAL page pool cannot hold {rows} sequence(s) of {tokens} tokens: that needs "
        f"{rows * pool.pages_needed(tokens)} pages of {pool.page_size} tokens, the pool has {pool.num_pages} "
        f"({pool.num_free} free, the rest held by live OvalCaches). Raise num_pages= or "
        "OvalConfig(memory_budget=...) in apply_oval_to_model, shorten the prompt or max_new_tokens, or release "
        "caches you no longer need (OvalCache.release())"
    )


class _Sequences:
    """The pool sequences of one cache (one per batch row) and the step being run. Shared by the cache layers."""

    def __init__(self, state: OvalState) -> None:
        self.state = state
        self.ids: list[str] = []
        self.step: StepIndex | None = None

    def length(self) -> int:
        return self.state.pool.length(self.ids[0]) if self.ids else 0

    def _begin(self, batch: int, new: int) -> StepIndex:
        pool = self.state.pool
        if not self.ids:
            tag = uuid.uuid4().hex[:8]
            for row in range(batch):
                sid = f"hf-{tag}-{row}"
                if pool.allocate(sid, new) is None:
                    self.release()  # a fresh cache keeps nothing from a refused prefill
                    self._refuse(batch, new)
                self.ids.append(sid)
        elif batch != len(self.ids):
            raise ValueError(
                f"this OvalCache holds {len(self.ids)} sequences but the step has a batch of {batch}; "
                "a cache serves the same batch rows from prefill to the end (no beam search or batch reshaping)"
            )
        else:
            for sid in self.ids:
                if not pool.grow(sid, pool.length(sid) + new):
                    self._refuse(batch, new)
        return pool.prepare(self.ids, [new] * batch)

    def _refuse(self, batch: int, new: int) -> None:
        raise ValueError(shortfall_message(self.state.pool, batch, self.length() + new))

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state
        if not is_oval_attention(state.model_config._attn_implementation):
            raise ValueError(
                "this OvalCache belongs to a model whose attention is no longer OVAL "
                f"({state.model_config._attn_implementation!r}); call apply_oval_to_model(model, config) again, "
                "or generate without passing this cache"
            )
        batch, _, new, dim = keys.shape  # [B, Hkv, n, D], keys rotated
        if layer == 0:
            self.step = self._begin(batch, new)
        elif self.step is None:
            raise RuntimeError(f"OvalCache.update for layer {layer} before layer 0 of the same step")
        step = self.step
        # The pool wants rows concatenated: [B * n, Hkv, D]. Detached: the pool is storage, not part of a graph.
        state.pool.write(layer, step, _rows(keys).detach(), _rows(values).detach())
        if layer == state.num_layers - 1:
            # Every layer wrote: advance lengths and seal full pages. This step's selection keeps using the
            # `sealed` counts captured in `step`, so sealing before the last layer attends changes nothing.
            state.pool.commit(step)
            self.step = None
        tagged = keys.view_as(keys)
        setattr(tagged, OVAL_CALL_ATTR, OvalCall(state, layer, step))
        return tagged, values

    def release(self) -> None:
        for sid in self.ids:
            self.state.pool.free(sid)
        self.ids.clear()
        self.step = None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, n, D] -> [B * n, H, D], rows concatenated in order (the pool's StepIndex order)."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b * n, h, d)


class OvalLayer(CacheLayerMixin):
    """One layer's view of the shared sequences; it stores nothing itself."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, sequences: _Sequences, layer: int) -> None:
        super().__init__()
        self._sequences = sequences
        self._layer = layer  # is_initialized stays False: there are no per-layer tensors to offload or zero

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self._sequences.update(self._layer, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._sequences.length()

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # Older transformers passed cache_position (a tensor of the new positions) instead of the query length.
        new = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self._sequences.length() + new, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name before transformers 5.x renamed it

    def reset(self) -> None:
        self._sequences.release()

    def _unsupported(self, what: str):
        raise ValueError(
            f"OvalCache does not support {what}: its pages stay in the pool as written. Use greedy or sampling "
            "generation with num_beams=1 and no assistant model"
        )

    def reorder_cache(self, beam_idx):
        self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int):
        if tokens_to_remove:
            self._unsupported("cropping (assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int):
        self._unsupported("repeating batch rows")

    def batch_select_indices(self, indices):
        self._unsupported("selecting batch rows")


class OvalCache(Cache):
    """A transformers Cache backed by the OVAL page pool of `state`. Its pages return to the pool on `release()`
    or when the cache is garbage collected."""

    def __init__(self, state: OvalState) -> None:
        self._sequences = _Sequences(state)
        super().__init__(layers=[OvalLayer(self._sequences, i) for i in range(state.num_layers)])
        weakref.finalize(self, self._sequences.release)

    @property
    def state(self) -> OvalState:
        return self._sequences.state

    @property
    def sequence_ids(self) -> list[str]:
        return list(self._sequences.ids)

    def release(self) -> None:
        """Return this cache's pages to the pool; the cache is empty afterwards."""
        self._sequences.release()

    def __repr__(self) -> str:
        return f"OvalCache(rows={len(self._sequences.ids)}, tokens={self._sequences.length()})"
