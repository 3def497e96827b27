"""What the static decode step's CUDA graphs keep: the step's shapes (batch and page-table width buckets) and the
bytes its widest graph allocates. No torch at import time (the planner uses it); oval_edge.geometry re-exports it.

A captured graph owns every block its step allocated, in one memory pool shared by all graphs: the pool holds about
the largest step's peak of temporaries plus every graph's outputs (logits [B, vocab] fp32 and a stats vector; each
graph's outlive its capture). The torch-ops step (CUDA without Triton) is the larger: it widens every listed
page's record and gathers the dense layers' K/V; the Triton kernels read both in place. Its peak, phase by phase
(runtime/engine/forward/static_step.py; tests/test_fake_cuda_step.py measures the step's allocations on a fake
CUDA device and holds this within STEP_BYTES_TOLERANCE of them):

    plan      for the whole step: every listed slot's pool index [B, Hkv, W * P] int64, two [B, W * P] masks
    scoring   a sparse layer's B * W pages' basis as int64 byte-pair codes (8 r D bytes a page and KV head), its
              levels in fp32 (4 r D) and the mean's term [G] fp32 (PackedScorer: the gathered bytes become the codes)
    dense     a dense layer's K and V gathered one KV head at a time past 2,048 slots (all heads below), in the
              pool's dtype (and again in the activations' when they differ), and three [B, Hq, T] logits buffers
    head      the head's logits [B, vocab] in the activation dtype before their fp32 copy (the output)
    rows      the residual stream, q/k/v and the MLP's [B, 3 x intermediate] of the rows
"""

from __future__ import annotations


# |formula - measured peak| / measured peak the fake-CUDA trace allows at batch 1 and 4, 2k and 8k tokens
STEP_BYTES_TOLERANCE = 0.10
PER_HEAD_SLOTS = 2048  # from this many slots per KV head the torch attention gathers one head at a time
STATS_BYTES = 3 * 8  # the step's statistics vector [3] int64


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_batch, then max_batch: the batch sizes a static decode step is built for."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


def width_buckets(max_width: int, min_width: int) -> tuple[int, ...]:
    """Page-table widths the static steps are built for where a step reads every listed page: min_width (rounded
    up to a power of two), doubling below max_width, then max_width."""
    sizes, size = [], 1 << max(0, min_width - 1).bit_length()
    while size < max_width:
        sizes.append(size)
        size *= 2
    return (*sizes, max_width)


def narrowest_width(config) -> int:
    """The narrowest page-table width bucket for an OvalConfig: a long row's selection (sink + top-k pages) and a
    short row's dense slots (the token budget) fit in it."""
    return max(config.sink_pages + config.top_k, -(-config.token_budget // config.page_size))


def decode_graph_bytes(
    hidden: int, intermediate: int, q_heads: int, vocab: int, geometry, max_batch: int, context: int,
    act_bytes: int, min_width: int = 8,
) -> int:
    """Device memory the CUDA graphs of the static decode step keep for their whole life: the widest graph's peak of
    temporaries (step_peak_bytes) plus every graph's outputs, one graph per batch bucket and page-table width
    bucket (the torch path's widths from min_width pages: the default OvalConfig's narrowest_width, rounded up).
    geometry: the pool's oval_edge.geometry.KVGeometry (not imported here: geometry imports this module)."""
    widths = width_buckets(-(-context // geometry.page_size), min_width)
    outputs = sum(batch_buckets(max_batch)) * len(widths) * (vocab * 4 + STATS_BYTES)
    return step_peak_bytes(hidden, intermediate, q_heads, vocab, geometry, max_batch, context, act_bytes) + outputs


def step_peak_bytes(hidden: int, intermediate: int, q_heads: int, vocab: int, geometry, batch: int,
                    context: int, act_bytes: int) -> int:
    """Peak bytes of the temporaries one torch-ops static step of `batch` rows allocates over page tables holding
    `context` tokens (the module doc's phases; the outputs not included)."""
    g = geometry
    hkv, dim, page, rank = g.kv_heads, g.head_dim, g.page_size, g.rank
    width = -(-context // page)
    slots = width * page
    plan = batch * hkv * slots * 8 + 2 * batch * slots
    pages = hkv * batch * width  # (KV head, listed page) pairs one sparse layer scores
    if g.record == "int4":
        scoring = pages * (12 * rank * dim + 4 * q_heads // hkv)
    else:  # the records widened to fp32 (scoring.record_scores), then each page's [P, G] logits
        scoring = pages * (g.oval_record_bytes() + 4 * (dim + rank * dim + rank * page) + 4 * page * q_heads // hkv)
    kv_bytes = 1 if g.kv_int8 else g.dtype_bytes
    heads = 1 if slots >= PER_HEAD_SLOTS else hkv
    gathered = 2 * batch * heads * slots * dim * (kv_bytes + (act_bytes if kv_bytes != act_bytes else 0))
    dense = gathered + batch * hkv * slots + 8 * slots + 3 * batch * q_heads * heads // hkv * slots * act_bytes
    rows = batch * (4 * hidden + (q_heads + 2 * hkv) * dim + 3 * intermediate) * act_bytes
    return plan + max(scoring, dense, batch * vocab * act_bytes) + rows
