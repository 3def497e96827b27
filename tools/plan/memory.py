"""Workspace, decode reads and predicted peak memory: the arithmetic around `size_pool` for one device.

Conventions: a = activation bytes (fp32 on CPU, fp16 on CUDA), kvb = KV pool dtype bytes, C = prefill chunk,
T = context (tokens of the longest sequence), B = batch, Hq/Hkv/D = heads / kv heads / head dim, I = ffn size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from oval_edge.config import OvalConfig
from oval_edge.geometry import (
    KVGeometry, decode_graph_bytes, kv_dims, kv_sharing, prefill_workspace_bytes, ring_head_dim, ring_layout,
    seal_chunk_pages, seal_workspace_bytes, stage_pages_for,
)

from .model import ModelShape
from .weights import ACTIVATION_BYTES, WeightBreakdown

ACTIVATION_DTYPES = {"cpu": "float32", "cuda": "bfloat16"}  # ACTIVATION_BYTES' dtypes: a hybrid's conv states

MiB = 2**20
# Resident bytes of a loaded server besides its weights: interpreter, torch, bitsandbytes, the tokenizer (with
# transformers' tokenizer classes), the HTTP stack and what loading leaves in the heap. This is what
# runtime/engine/setup.build_pool measures as its `reserve` on the CPU (process RSS - weight bytes). CPU: measured
# in this project as `oval-edge serve` prints it at startup (streaming loader, no transformers model classes, the
# GGUF's tokenizer read from its converted folder, the heap kept compact while loading) with torch 2.13 CPU,
# Python 3.11, x86-64: reserve 382-387 MiB in a just-installed virtual environment, 313-317 MiB in a long-used one.
# The difference is libtorch_cpu.so's pages mapped into the process (95 vs 48 MB), which depends on how much of the
# file is in the page cache; the planner takes the higher figure, so a fresh install is not over-committed.
# (A bare runtime.model.loader.load_model process holds 289 MiB in the long-used environment.) CUDA: an estimate -
# that host process plus ~300 MiB of CUDA context with lazy module loading (PyTorch maintainers,
# pytorch/pytorch#107667) plus cuBLAS workspaces; on a Jetson both live in the same DRAM. Override with
# --runtime-overhead after measuring on the board.
RUNTIME_OVERHEAD = {"cpu": 385 * MiB, "cuda": 800 * MiB}
# Loading's fixed transient above the loaded state: the GGUF reader's field objects and the header pages it
# touches, and the tensor index. Measured in a bare load_model process (tokenizer from its converted folder):
# load peak 492-496 MiB - loaded 397 MiB = 95-99 MiB, less 2 x 6.8 MiB (two 16-bit copies of a layer) and the
# 4 MiB chunk -> 78-81 MiB; 80 MiB kept. Safetensors folders parse only JSON: the same figure is an upper bound.
LOAD_FIXED_TRANSIENT = 80 * MiB
ATTENTION_TILE = 512  # kv tokens per block of the fused (flash / memory-efficient) SDPA kernels


CHUNKED_ROWS = 32  # rows up to which Chunked4bit avoids the dequantizing path (projections.chunk_rows, fused GEMM)


def target_of(kind: str) -> str:
    return "cpu" if kind == "cpu" else "cuda"


def geometry_for(shape: ModelShape, oval: OvalConfig, target: str) -> KVGeometry:
    """The pool geometry serve builds for this model on `target` (runtime/engine/setup.pool_geometry, with the same
    oval_edge.geometry formulas): pages of the full-attention layers that keep K/V (at Gemma 4's global_head_dim), per
    sequence a ring for each sliding layer that keeps K/V (oval_edge/kv/ring.py, at head_dim), nothing for a layer
    reading an earlier layer's K/V."""
    if shape.full_layers == 0:
        raise ValueError(f"{shape.path}: every layer is a sliding-window layer; plan needs at least one full layer")
    oval = oval.for_context(shape.max_context)  # as the engine: no coarse records where two levels never apply
    states = None  # a hybrid's conv states in the activations' dtype (the engine's), recurrent ones fp32
    if shape.states is not None:
        states = dataclasses.replace(shape.states, dtype=ACTIVATION_DTYPES[target])
    config = shape.kv_config()
    return KVGeometry.for_oval(*kv_dims(config), oval, oval.pool_dtype(target), ring=ring_layout(config),
                               states=states, ring_head_dim=ring_head_dim(config), shared=kv_sharing(config))


def tokens_read_per_layer(shape: ModelShape, oval: OvalConfig, context: int) -> list[int]:
    """Token positions one sequence's decode step reads in each layer: the whole context in the first
    `dense_layers` layers (and in every layer while the sequence fits the token budget), else the slots; a
    sliding layer reads its window; a hybrid's state layer reads no K/V (its state: decode_reads' state_bytes)."""
    sparse = min(context, oval.token_budget)  # sink + top-k pages + window (= selection.slots_per_step)
    window = min(context, shape.sliding_window)
    return [0 if kind == "state" else window if kind == "sliding" else context if layer < oval.dense_layers
            else sparse for layer, kind in enumerate(shape.kinds)]


def decode_reads(shape: ModelShape, oval: OvalConfig, geometry: KVGeometry, context: int, batch: int) -> dict:
    per_layer = tokens_read_per_layer(shape, oval, context)
    # K and V of one position in one layer (int8: + scales): a full layer's rows in the pages, a sliding layer's in
    # the rings (float only, at ring_dim); a layer sharing K/V reads its source's as it stores none of its own
    row = {"full": geometry.kv_row_bytes, "sliding": geometry.ring_dim * geometry.dtype_bytes, "state": 0}
    kv = batch * sum(tokens * 2 * shape.kv_heads * row[kind] for tokens, kind in zip(per_layer, shape.kinds))
    # Scoring reads the summary of every sealed page in each sparse layer once the row exceeds the budget.
    sparse_layers = sum(1 for layer, (t, kind) in enumerate(zip(per_layer, shape.kinds))
                        if layer >= oval.dense_layers and t < context and kind == "full")
    # (two-level scoring: every group's coarse record and a fixed set of fine records, geometry.scoring_bytes)
    summaries = batch * sparse_layers * shape.kv_heads * geometry.scoring_bytes(context // oval.page_size,
                                                                                 oval.top_groups)
    return {"tokens_per_layer_dense": per_layer[0] if per_layer else 0, "tokens_per_layer_sparse": min(context, oval.token_budget),
            "tokens_per_layer_sliding": min(context, shape.sliding_window) if shape.sliding_layers else 0,
            "tokens_per_step": sum(per_layer), "kv_bytes": kv, "summary_bytes": summaries,
            "state_bytes": batch * geometry.state_bytes_per_sequence}  # every row's state read (and written)


def reserved_workspace_bytes(shape: ModelShape, geometry: KVGeometry, target: str, chunk: int, context: int,
                             batch: int = 1) -> int:
    """The workspace serve sets aside when it sizes its pool (oval_edge.geometry.prefill_workspace_bytes, as
    runtime/engine/setup.build_pool calls it, plus on CUDA what the captured decode graphs of `batch` rows keep:
    oval_edge.geometry.decode_graph_bytes). It assumes materialised attention scores, so it is an upper bound on
    what `workspace_bytes` below expects to be really used."""
    act = ACTIVATION_BYTES[target]
    # serve's default step budget (EngineConfig.step_tokens): max_batch decode rows + one chunk
    mlp = widest_mlp(shape)  # Gemma 4's shared layers' doubled MLP, as setup.build_pool reserves for it
    reserved = prefill_workspace_bytes(shape.hidden, mlp, shape.heads, geometry, chunk, context, act,
                                       step_tokens=batch + chunk)
    reserved += geometry.stage_bytes(stage_pages_for(geometry, batch, batch + chunk))  # int8: open pages' keys
    if target == "cuda":  # serve captures the static step into CUDA graphs by default (runtime/engine/forward/cuda_graph.py)
        reserved += decode_graph_bytes(shape.hidden, mlp, shape.heads, shape.vocab, geometry, batch, context, act)
    return reserved


def widest_mlp(shape: ModelShape) -> int:
    """The widest MLP of any layer (Gemma 4's KV-shared layers' with use_double_wide_mlp; the config's elsewhere)."""
    return max((n for name, n, _ in shape.all_projections() if name == "gate_proj"), default=shape.intermediate)


def seal_transient_bytes(shape: ModelShape, geometry: KVGeometry, pages_per_step: int) -> int:
    """Memory the summaries of newly sealed pages take while they are built (PagePool.seal -> oval_summary).

    seal() summarises oval_edge.geometry.seal_chunk_pages(geometry) pages at a time across every layer and KV
    head, sized so the batch stays within SEAL_WORKSPACE_BYTES; fewer when a step fills fewer pages.
    'quest' summaries only take min/max per channel.
    """
    if "oval" not in geometry.summary_kinds:
        return 0
    full = seal_workspace_bytes(geometry)
    return full * min(seal_chunk_pages(geometry), max(pages_per_step, 1)) // seal_chunk_pages(geometry)


def workspace_bytes(shape: ModelShape, oval: OvalConfig, geometry: KVGeometry, target: str, context: int,
                    batch: int, chunk: int, layout: str) -> dict:
    """Transient bytes of the largest step: a prefill chunk of C tokens against T, a decode step, or the sealing
    of the pages a step fills.

    Layers run one after another, so one layer's transients plus the residual stream bound the peak.
    Attention assumes the fused SDPA path (flash on CPU and CUDA; measured: a 9-head 512x8192 masked SDPA on CPU
    allocates ~20 MiB, not the 144 MiB a score matrix would take). Logits are computed for the last position of
    each sequence only.
    """
    a, kvb = ACTIVATION_BYTES[target], geometry.kv_row_bytes // geometry.head_dim  # int8: 1 (scales are noise)
    # the paged layers' head dim (Gemma 4's full layers' global_head_dim, the widest) and the widest MLP (Gemma 4's
    # shared layers' with use_double_wide_mlp)
    widest = shape.projections()
    h, d, hq, hkv = shape.hidden, geometry.head_dim, shape.heads, shape.kv_heads
    i = max(n for name, n, _ in widest if name == "gate_proj")
    cast = a if kvb != a else 0  # k/v.to(q.dtype) makes a copy when the pool dtype differs

    def step(tokens: int, kv_tokens: int, rows: int) -> int:
        # residual, normed input, attention / MLP output; Gemma 4's per-layer inputs [tokens, layers x P] live
        # through the whole forward
        resid = (3 * h + shape.layers * shape.per_layer_input) * tokens * a
        qkv = 2 * tokens * (hq + 2 * hkv) * d * a  # projections and their rotated copies
        gathered = rows * 2 * hkv * kv_tokens * d * (kvb + cast)  # K, V copied out of the pool
        index = rows * hkv * kv_tokens * (8 + 8 + 1)  # positions, flat slot indices (int64), valid mask
        tile = rows * hq * min(tokens // max(rows, 1), 512) * min(kv_tokens, ATTENTION_TILE) * 4
        attention = qkv + gathered + index + tile + tokens * kv_tokens  # + bool causal mask
        mlp = 3 * tokens * i * a  # gate, up, act(gate) * up
        # bitsandbytes on CUDA dequantizes the whole weight for many rows (a prefill chunk); a decode step's rows go in
        # calls of <= 4 through its fused 4-bit GEMM up to CHUNKED_ROWS (runtime/model/projections.Chunked4bit);
        # the packed CPU kernel never dequantizes; without it a CPU prefill dequantizes as bitsandbytes does.
        dequant = max(n * k for _, n, k in widest) * 2 \
            if layout in ("nested", "cpu-unnested") and tokens > CHUNKED_ROWS else 0
        logits = rows * shape.vocab * 4
        return resid + max(attention, mlp) + dequant + logits

    prefill = step(min(chunk, context), context, 1)  # the last chunk of a prompt reads the whole context
    decode = step(batch, context, batch)  # dense layers read the whole context (the sparse ones read less)
    # Sealing runs after the forward (pool.commit), so it does not add to the step's transients.
    seal = seal_transient_bytes(shape, geometry, max(-(-min(chunk, context) // geometry.page_size), batch))
    return {"prefill": prefill, "decode": decode, "seal": seal, "total": max(prefill, decode, seal)}


def load_peak_bytes(shape: ModelShape, weights: WeightBreakdown, quant: str, target: str, overhead: int) -> int:
    """Peak resident bytes while loading: the loaded state (overhead + weights) plus what loading holds on top.

    runtime/model/decoder_build streams the checkpoint one decoder layer at a time: a layer's projections are read in
    16 bits (fp32 for quant none), stacked into the fused q/k/v and gate/up matrices (a second copy) and quantized,
    then dropped; GGUF tensors are dequantized 4 MiB of fp32 at a time and their file pages released as they are
    read. So the transient is two copies of the largest layer, one dequantization chunk and the fixed parse cost.
    """
    load = ACTIVATION_BYTES[target] if quant == "none" else 2
    layer = sum(n_out * n_in for _, n_out, n_in in shape.projections()) * load  # one decoder layer
    return overhead + weights.total + 2 * layer + 4 * MiB + LOAD_FIXED_TRANSIENT


@dataclass(frozen=True)
class PagePlan:
    page_size: int
    pages: int
    bytes_per_page: int
    pool_bytes: int
    tokens_in_pool: int
    max_context_per_sequence: int  # at the requested batch, capped by the model's context length
    fits: bool  # the requested context at the requested batch fits the pool
    pages_needed: int
    minimum_budget: int  # budget for the requested context and batch
    tokens_read_per_step: int  # one sequence, all layers
    kv_bytes_read_per_step: int  # whole batch
    summary_bytes_read_per_step: int
    bytes_per_step: int  # weights + KV + summaries streamed per decode step
    roofline_tok_s: float | None  # bytes / bandwidth alone, whole batch; None when the bandwidth is unknown
    decode_tok_s: float | None  # predicted for the path serve runs (step_cost.py), whole batch; None: no bandwidth
    decode_tok_s_per_sequence: float | None
    step_cost: dict  # the formula, the path served, and each path's fixed cost with its parts (step_cost.py)
    workspace_bytes: int  # set aside by this plan: max(serve's formula, the expected transient)
    serve_workspace_bytes: int  # what serve's own formula (geometry.prefill_workspace_bytes) sets aside
    transient_bytes: int  # expected to be really used by the largest step (peak prediction)
    seal_bytes: int  # of which the page-summary build (PagePool.seal), often the largest for big models
    serve_memory_budget: int  # the memory_budget to give serve so that it allocates `pages`
    predicted_serving_peak_bytes: int
    predicted_peak_bytes: int
    explain: str
    ring_bytes: int = 0  # sliding layers' rings for `batch` sequences, beside the pool (oval_edge/kv/ring.py)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
