"""KV geometry and the budget arithmetic that sizes the page pool ([R-pool]).

No torch at import time: the planner (`oval-edge plan`) uses this without loading any model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .record_layout import int4_coord_bytes, int5_row_bytes
from .state_layout import StateLayout
from .units import format_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SUMMARY_KINDS = ("oval", "quest")
# How an oval page record (mean, basis, coordinates) is stored: in the pool's dtype, or quantized with one fp16 scale
# per page and head for the mean and one per rank (oval_edge/kv/records/page_record.py). The coarse records of two-level
# scoring keep an fp32 scale per basis row (kv/records/group_record.py).
RECORD_FORMATS = ("float", "int8", "int4")
RECORD_SCALE_BYTES, GROUP_SCALE_BYTES = 2, 4
# Two-level scoring's coarse record slots (kv/records/group_slots.py): this many per group_pages pages, and an int64 entry
# per page in the page -> slot map.
SLOTS_PER_GROUP, GROUP_SLOT_MAP_BYTES = 2, 8
# kv_int8: each K and V row (one token, one KV head: head_dim values) is stored as int8 codes and one fp32 scale.
KV_SCALE_BYTES = 4


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one model's KV cache in pages; the unit every budget figure is computed from."""

    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float32"  # a key of DTYPE_BYTES
    summary_kinds: tuple[str, ...] = ("oval",)
    rank: int = 4
    record: str = "float"  # a RECORD_FORMATS entry: how oval records are stored
    # Sliding-window layers (Gemma): each keeps only the last `window` positions of a sequence, in a ring of
    # ring_pages pages per sequence (no summaries, never scored) outside the paged layers' pool. () = none.
    ring_layers: tuple[int, ...] = ()
    window: int = 0
    # Two-level scoring (oval_edge/sparse/grouped.py): each run of group_pages logical pages gets one coarse record
    # when its last page seals, stored in that page's slot. 0 = flat scoring (every page's record read every step).
    group_pages: int = 0
    # kv_dtype='int8': K/V as int8 codes + a scale per row; `dtype` is then that of the rest (kv/int8.py).
    kv_int8: bool = False
    # Hybrid models' state layers (Qwen3.5's linear attention, LFM2's conv; state_layout.py): a fixed state per
    # sequence, no K/V at all. None = none.
    states: StateLayout | None = None
    # Gemma 4: the sliding layers' head dim where it differs from the paged (full) layers' (256 against 512; 0 = the
    # same), and the layers that keep no K/V of their own but read an earlier layer's (transformers' "KV sharing":
    # (layer, source) pairs; the source is the last earlier non-shared layer of the same kind)
    ring_head_dim: int = 0
    shared: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r} is unknown; allowed: {', '.join(DTYPE_BYTES)}")
        bad = [k for k in self.summary_kinds if k not in SUMMARY_KINDS]
        if bad:
            raise ValueError(f"summary kind(s) {bad} unknown; allowed: {', '.join(SUMMARY_KINDS)}")
        if not 1 <= self.rank <= self.head_dim:
            raise ValueError(f"rank={self.rank} must be in [1, head_dim={self.head_dim}]")
        if "oval" in self.summary_kinds and self.rank > self.page_size - 1:
            # Centred keys of a page span at most P - 1 directions: a P-th one would be noise ([R-page-score]).
            raise ValueError(f"rank={self.rank} is above page_size - 1 = {self.page_size - 1}: a page's centred keys "
                             f"span at most page_size - 1 directions; lower rank or raise page_size")
        if self.record not in RECORD_FORMATS:
            raise ValueError(f"record={self.record!r} is unknown; allowed: {', '.join(RECORD_FORMATS)}")
        if self.record == "int4" and (self.head_dim % 8 or self.page_size % 8):
            raise ValueError(f"record='int4' packs basis rows and coordinate rows with fifth bits 8 values a byte: it "
                             f"needs a head_dim and a page_size that are multiples of 8 (got {self.head_dim}, "
                             f"{self.page_size}); use record='int8'")
        if self.group_pages and not (2 <= self.group_pages <= 256 and "oval" in self.summary_kinds):
            raise ValueError(f"group_pages={self.group_pages} needs the oval records and must be 0 (flat scoring) or "
                             "in [2, 256] pages per coarse group")
        if self.ring_layers and (self.window < 1 or sorted(set(self.ring_layers)) != list(self.ring_layers)
                                 or not all(0 <= i < self.layers for i in self.ring_layers)):
            raise ValueError(f"ring_layers={self.ring_layers} must be distinct increasing layer indices below "
                             f"layers={self.layers}, with a window >= 1 (got {self.window})")
        state_layers = set(self.states.indices) if self.states is not None else set()
        if state_layers & set(self.ring_layers) or any(i >= self.layers for i in state_layers):
            raise ValueError(f"state layers {sorted(state_layers)} must be layers below layers={self.layers} and "
                             f"not sliding ones ({self.ring_layers})")
        if self.ring_head_dim < 0 or self.ring_head_dim and not self.ring_layers:
            raise ValueError(f"ring_head_dim={self.ring_head_dim} must be 0, or the sliding layers' head dim when the "
                             "model has sliding layers")
        owners = set(self.ring_layers) | state_layers
        for layer, source in self.shared:
            if not 0 <= source < layer < self.layers or source in dict(self.shared) or layer in owners:
                raise ValueError(f"shared layer {layer} -> {source}: a layer sharing K/V must read an earlier layer "
                                 f"that keeps its own (below layers={self.layers}), and keep none itself")
        if self.kv_int8 and self.ring_layers:
            raise ValueError(f"kv_dtype='int8' does not take sliding-window layers (this model has "
                             f"{len(self.ring_layers)}; their rings are kept in the float dtype only); use "
                             "kv_dtype='auto' or 'bfloat16' for this model")

    @classmethod
    def for_oval(cls, layers: int, kv_heads: int, head_dim: int, oval, dtype: str,
                 summary_kinds: tuple[str, ...] | None = None,
                 ring: tuple[tuple[int, ...], int] = ((), 0), states: StateLayout | None = None,
                 ring_head_dim: int = 0, shared: tuple[tuple[int, int], ...] = ()) -> "KVGeometry":
        """The geometry an OvalConfig asks for (its page size and rank; its scorer's summaries unless told).
        ring: (sliding-window layers, window), ring_layout() of the model config. dtype: the float dtype
        (OvalConfig.pool_dtype); oval.kv_dtype == 'int8' stores K/V as int8 beside it. states: state_layout() of
        a hybrid model's config. head_dim, ring_head_dim, shared: kv_dims() and kv_sharing() of the config."""
        kinds = tuple(summary_kinds or (oval.scorer,))
        return cls(layers, kv_heads, head_dim, oval.page_size, dtype, kinds, oval.rank, oval.record, *ring,
                   group_pages=oval.group_pages if "oval" in kinds else 0, kv_int8=oval.kv_dtype == "int8",
                   states=states, ring_head_dim=ring_head_dim if ring[0] else 0, shared=shared)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Layers that keep a fixed per-sequence state instead of K/V (hybrid models)."""
        return self.states.indices if self.states is not None else ()

    @property
    def paged_layers(self) -> int:
        """Layers whose K/V live in pages of the pool (all but the sliding-window, the state and the shared ones)."""
        return self.layers - len(self.ring_layers) - len(self.state_layers) - len(self.shared)

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` reads: itself, or its source when it shares an earlier layer's."""
        return dict(self.shared).get(layer, layer)

    def paged_index(self, layer: int) -> int:
        """Model layer -> its index in the pool's paged tensors (identity with full attention only); a shared layer's
        is its source's."""
        layer = self.kv_source(layer)
        skipped = self.ring_layers + self.state_layers + tuple(shared for shared, _ in self.shared)
        return layer - sum(1 for other in skipped if other < layer)

    @property
    def ring_dim(self) -> int:
        """The head dim of the rings' K/V rows."""
        return self.ring_head_dim or self.head_dim

    @property
    def state_bytes_per_sequence(self) -> int:
        """The state layers' conv and recurrent state of one sequence (state_layout.py); 0 without any."""
        return self.states.bytes_per_sequence if self.states is not None else 0

    @property
    def sequence_bytes(self) -> int:
        """What each sequence the engine may run at once costs before any page: its rings and its states."""
        return self.ring_bytes_per_sequence + self.state_bytes_per_sequence

    @property
    def ring_pages(self) -> int:
        """Pages a sliding layer's ring holds per sequence: the window's positions [t - W + 1, t] span at most
        ceil((W - 1) / P) + 1 pages, and the page a step writes is never one the window still reads."""
        return -(-(self.window - 1) // self.page_size) + 1 if self.ring_layers else 0

    @property
    def ring_bytes_per_sequence(self) -> int:
        """K and V of one sequence's rings in every sliding layer."""
        return (self.ring_pages * self.page_size * 2 * len(self.ring_layers) * self.kv_heads * self.ring_dim
                * self.dtype_bytes)

    def describe_layers(self) -> str:
        """Where each layer's K/V live, in words (startup report), for a model with more than one kind."""
        parts = [f"{self.paged_layers} in pages (head dim {self.head_dim})"]
        if self.ring_layers:
            parts.append(f"{len(self.ring_layers)} sliding in rings of {self.window} tokens (head dim {self.ring_dim})")
        if self.state_layers:
            parts.append(f"{len(self.state_layers)} state layers (no K/V)")
        if self.shared:
            pairs = ", ".join(f"{layer}->{source}" for layer, source in self.shared)
            parts.append(f"{len(self.shared)} reading an earlier layer's K/V, stored once ({pairs})")
        return f"{self.layers}: " + ", ".join(parts)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one K (or V) row: one token, one KV head, head_dim values (int8: the codes and their scale)."""
        return self.head_dim + KV_SCALE_BYTES if self.kv_int8 else self.head_dim * self.dtype_bytes

    @property
    def kv_label(self) -> str:
        """The K/V storage in words (startup report, plan)."""
        return f"int8 + fp32 scale per row (summaries {self.dtype})" if self.kv_int8 else self.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token position in every paged layer and KV head."""
        return 2 * self.paged_layers * self.kv_heads * self.kv_row_bytes

    def stage_bytes(self, stage_pages: int) -> int:
        """kv_int8: the staged keys of `stage_pages` open pages + 1 overflow page (oval_edge/kv/int8.py); else 0."""
        if not self.kv_int8:
            return 0
        return (stage_pages + 1) * self.paged_layers * self.kv_heads * self.page_size * self.head_dim * self.dtype_bytes

    def oval_record_bytes(self) -> int:
        """Bytes of one oval record (one page, one KV head): mean mu [D], basis B^T [r, D], coordinates R^T [r, P],
        in the pool's dtype, or quantized with 1 + r fp16 scales (kv/records/page_record.py): int8, a byte a value; int4,
        the mean int8, basis rows of 5-bit values (D / 2 + D / 8 bytes each), coordinates 4-bit (P / 2 bytes a
        rank) with a fifth bit for the first record_layout.coord_fifth_ranks(r) ranks (P / 8 bytes each)."""
        d, p, r = self.head_dim, self.page_size, self.rank
        if self.record == "float":
            return (d + r * d + r * p) * self.dtype_bytes
        if self.record == "int8":
            packed = r * (d + p)
        else:
            packed = r * int5_row_bytes(d) + int4_coord_bytes(r, p)
        return d + packed + (1 + r) * RECORD_SCALE_BYTES

    def group_record_bytes(self) -> int:
        """Bytes of one coarse record (a group of group_pages pages, one KV head): the group's key mean [D] and the
        coordinates' min and max [2, r] in the pool's dtype, its basis B^T [r, D] as int8 codes with an fp32 scale
        per row (0 without groups)."""
        d, r = self.head_dim, self.rank
        return (d + 2 * r) * self.dtype_bytes + r * d + r * GROUP_SCALE_BYTES if self.group_pages else 0

    def summary_bytes_per_head(self) -> int:
        """Summary bytes scoring reads for one (layer, page, KV head) with flat scoring, for the kinds kept."""
        n = 0
        if "quest" in self.summary_kinds:
            n += 2 * self.head_dim * self.dtype_bytes  # per-channel min and max of the keys
        if "oval" in self.summary_kinds:
            n += self.oval_record_bytes()
        return n

    def scoring_bytes(self, pages: int, top_groups: int) -> int:
        """Summary bytes one KV head's scoring reads over a table of `pages` pages (one row, one layer): every
        page's record when flat; with groups (once there are more than top_groups of them, grouped.py) every
        group's coarse record plus the fine records of the top groups' pages and of the unfinished group."""
        groups = pages // self.group_pages if self.group_pages else 0
        if groups <= top_groups:
            return pages * self.summary_bytes_per_head()
        fine = min(pages, (top_groups + 1) * self.group_pages)
        return groups * self.group_record_bytes() + fine * self.summary_bytes_per_head()

    @property
    def summary_bytes_per_page(self) -> int:
        """Summaries stored per page: its records, and when grouped its share of the coarse record slots
        (kv/records/group_slots.py: SLOTS_PER_GROUP per group_pages pages, rounded up) and its entry in the slot map."""
        fine = self.paged_layers * self.kv_heads * self.summary_bytes_per_head()
        if not self.group_pages:
            return fine
        coarse = self.paged_layers * self.kv_heads * self.group_record_bytes() * SLOTS_PER_GROUP
        return fine + -(-coarse // self.group_pages) + GROUP_SLOT_MAP_BYTES

    @property
    def bytes_per_page(self) -> int:
        """K + V + summaries of one logical page across every paged layer (what one page of budget costs)."""
        return self.page_size * self.kv_bytes_per_token + self.summary_bytes_per_page


def head_dim_of(model_config) -> int:
    """A transformers-style config's head dim: `head_dim` when it has one, else hidden_size / attention heads."""
    return getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads


def kv_sharing(model_config) -> tuple[tuple[int, int], ...]:
    """(layer, source) of each layer that reads an earlier layer's K/V (Gemma 4's last `num_kv_shared_layers`, as
    transformers' Gemma4TextConfig.kv_sharing_modes: the source is the last non-shared layer of the same kind)."""
    shared = int(getattr(model_config, "num_kv_shared_layers", 0) or 0)
    layers = model_config.num_hidden_layers
    if not shared:
        return ()
    types = list(getattr(model_config, "layer_types", None) or ["full_attention"] * layers)
    first = layers - shared
    pairs = []
    for layer in range(first, layers):
        owners = [i for i in range(first) if types[i] == types[layer]]
        if not owners:
            raise ValueError(f"layer {layer} ({types[layer]}) shares K/V but no earlier layer of its kind keeps any "
                             f"(num_kv_shared_layers={shared} of {layers})")
        pairs.append((layer, owners[-1]))
    return tuple(pairs)


def ring_layout(model_config) -> tuple[tuple[int, ...], int]:
    """(sliding-window layer indices, window) of a config with transformers' `layer_types` / `sliding_window`: the
    sliding layers that keep a ring of their own (a layer sharing another's K/V reads its source's)."""
    types = getattr(model_config, "layer_types", None) or ()
    window = int(getattr(model_config, "sliding_window", 0) or 0)
    shared = dict(kv_sharing(model_config))
    layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention" and i not in shared)
    return (layers, window) if layers and window else ((), 0)


def kv_dims(model_config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers-style config (no num_key_value_heads: multi-head attention);
    head_dim is the paged (full-attention) layers': Gemma 4's global_head_dim where it has one."""
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    full = int(getattr(model_config, "global_head_dim", 0) or 0)
    return model_config.num_hidden_layers, kv_heads, full or head_dim_of(model_config)


def ring_head_dim(model_config) -> int:
    """The sliding layers' head dim where it differs from kv_dims()'s (Gemma 4), else 0."""
    full = int(getattr(model_config, "global_head_dim", 0) or 0)
    return head_dim_of(model_config) if full and full != head_dim_of(model_config) else 0


def stage_pages_for(geometry: KVGeometry, max_batch: int, step_tokens: int) -> int:
    """kv_int8 staging slots (kv/int8.py): each row's open page, and the pages one step fills (+1 a row mid-page)."""
    return 2 * max_batch + -(-step_tokens // geometry.page_size)


# Transient bytes one seal batch may hold; the pages per batch follow from it (seal_chunk_pages).
SEAL_WORKSPACE_BYTES = 32 * 2**20


def seal_chunk_pages(geometry: KVGeometry) -> int:
    """Pages summarised together at seal time, so that their fp32 work matrices stay within SEAL_WORKSPACE_BYTES.

    About six D x D fp32 matrices (the Gram matrix, the value-weighted one, their mix, eigh's workspace) and
    the page's fp32 keys/values live per (page, layer, KV head) while a batch is summarised.
    """
    g = geometry
    per_page = 6 * g.paged_layers * g.kv_heads * (g.head_dim * g.head_dim + g.page_size * g.head_dim) * 4
    return max(1, SEAL_WORKSPACE_BYTES // per_page) if per_page else 1  # no paged layer: nothing is summarised


def seal_workspace_bytes(geometry: KVGeometry) -> int:
    """Peak transient bytes of one seal batch (for the planner's workspace)."""
    g = geometry
    return seal_chunk_pages(g) * 6 * g.paged_layers * g.kv_heads * (g.head_dim * g.head_dim + g.page_size * g.head_dim) * 4


def prefill_workspace_bytes(
    hidden: int, intermediate: int, q_heads: int, geometry: KVGeometry, chunk: int, context: int, act_bytes: int,
    step_tokens: int | None = None,
) -> int:
    """Transient memory of one prefill chunk of `chunk` tokens against `context` cached tokens, in a step whose
    forward carries `step_tokens` tokens in all (default: the chunk alone; decode rows and other chunks add rows).

    Largest live set in a layer: the residual + normed input + q/k/v/o (≈ 6 x hidden), the MLP's gate/up/act
    (3 x intermediate), the K/V of the whole context gathered for the chunk (2 x kv_heads x context x D, fp32),
    and the attention scores when the kernel materialises them (q_heads x chunk x context, fp32).
    """
    per_token = (6 * hidden + 3 * intermediate) * act_bytes
    gathered = 2 * geometry.kv_heads * context * geometry.head_dim * 4
    scores = q_heads * chunk * context * 4
    return max(chunk, step_tokens or 0) * per_token + gathered + scores


# The decode step's graph memory and its buckets live in step_memory.py (re-exported: callers import them here)
from .step_memory import batch_buckets, decode_graph_bytes  # noqa: E402,F401
