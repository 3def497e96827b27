"""The sparse decode step's kernels as opaque torch operators, so a whole step traces as one graph ([R-static-step]).

`torch.compile` cannot trace into the native CPU kernels (ctypes calls) nor keep the KV write in place through its
own tracing of `index_copy_` on a view of the pool. Registered as operators with a fake (shape-only)
implementation, each is one node of the traced graph, with the CPU or Triton kernel, or the torch reference, inside:

    oval_edge::write_kv(k(a!), v(b!), layer, slots, k_new, v_new)       store one step's keys/values in the pool
    oval_edge::page_scores(q, mean, basis, coords, scales?, layer, table, counts, scale)  oval page scores (records)
    oval_edge::attend_slots(q, k, v, layer, flat, valid, limits, scale, softcap)  exact attention over the selected rows

The page selection needs no operator: under tracing it is torch code the compiler fuses; eager, on a CPU, one
native kernel call (the ops table's `select`, step_ops_table.py).

The pool tensors go in whole (k, v [layers, pages, Hkv, P, D]; the oval records head-major per layer) with the layer
as an integer, so a compiled step has one graph input per pool tensor rather than one aliasing view per layer.

The wrappers `write_kv`, `page_scores`, `attend_slots` (below) take the pool and go through the operators only
under tracing. Eager code calls the implementations directly, on the pool's per-layer row views: a call through
the dispatcher costs ~1.7 us more (measured; `torch.library.custom_op`'s wrapper ~10 us), and the views of `k` it
would take cost two ops each: ~0.7 ms per decode step of a 30-layer model on a CPU.
"""

from __future__ import annotations

import torch

from oval_edge.kernels.cpu import decode_kernels
from oval_edge.kv.records.page_record import RECORD_NAMES, LayerRecords

from .attention import as_dtype, attend_rows, torch_attend
from .scoring import record_scores, score_pages

# The operator registry handle: it must live as long as the process, so it is module-level (never mutated after).
_LIBRARY = torch.library.Library("oval_edge", "FRAGMENT")
_LIBRARY.define("write_kv(Tensor(a!) k, Tensor(b!) v, int layer, Tensor slots, Tensor k_new, Tensor v_new) -> ()")
_LIBRARY.define("page_scores(Tensor q, Tensor mean, Tensor basis, Tensor coords, Tensor? scales, int layer, "
                "Tensor page_table, Tensor counts, float scale, int? body=None) -> Tensor")
_LIBRARY.define("attend_slots(Tensor q, Tensor k, Tensor v, int layer, Tensor flat, Tensor valid, Tensor? limits, "
                "float scale, float softcap=0.0, int? body=None) -> Tensor")
# An operator's body, resolved when a traced step's ops table is built (step_ops_table.py) and passed as `body`:
# the index of its kind here. None: the caller resolved nothing (the kernels where they take the inputs, else torch).
OP_BODIES = ("torch", "C", "Triton")


def _write_kv(k: torch.Tensor, v: torch.Tensor, layer: int, slots: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor) -> None:
    """k_new, v_new [N, Hkv, D] into rows `slots` [N * Hkv] of the layer's [pages * Hkv * P, D] view."""
    d = k.shape[-1]
    k[layer].view(-1, d).index_copy_(0, slots, as_dtype(k_new.reshape(-1, d), k.dtype))
    v[layer].view(-1, d).index_copy_(0, slots, as_dtype(v_new.reshape(-1, d), v.dtype))


def _page_scores(q: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, coords: torch.Tensor,
                 scales: torch.Tensor | None, layer: int, page_table: torch.Tensor, counts: torch.Tensor,
                 scale: float, body: int | None = None) -> torch.Tensor:
    """q [B, Hkv, G, D] -> [B, Hkv, Np] fp32 over the pages of page_table [B, Np] from the pool's oval records
    (page_record.py); pages past counts[b] are not candidates of row b (the native kernel does not read them)."""
    if body is None:
        records = {"mean": mean, "basis": basis, "coords": coords} | ({} if scales is None else {"scales": scales})
        return score_pages("oval", q, records, layer, page_table, scale, counts)
    records = LayerRecords(mean[layer], basis[layer], coords[layer], None if scales is None else scales[layer])
    if OP_BODIES[body] == "torch":
        return record_scores(q, records, page_table, scale)
    kernels = decode_kernels(q.device)
    bound = kernels.bind_oval_scores(records, q.shape[2]) if OP_BODIES[body] == "C" else kernels.bind_oval_scores(
        records)
    return _resolved(bound, "page_scores", body)(q, page_table, scale, counts)


def _attend_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, flat: torch.Tensor,
                  valid: torch.Tensor, limits: torch.Tensor | None, scale: float, softcap: float = 0.0,
                  body: int | None = None) -> torch.Tensor:
    """q [B, Hq, D] over the valid slots flat [B, Hkv, T] (the first limits[b] of them) of one layer -> [B, Hq, D]."""
    d = k.shape[-1]
    k_rows, v_rows = k[layer].view(-1, d), v[layer].view(-1, d)
    if body is None:
        return attend_rows(q, k_rows, v_rows, flat, valid, scale, limits, softcap)
    if OP_BODIES[body] == "torch":
        return torch_attend(q, k_rows, v_rows, flat, valid, scale, limits, softcap)
    kernels = decode_kernels(q.device)
    bound = (kernels.bind_attend(k_rows, v_rows, None, flat.shape[1], q.shape[1] // flat.shape[1])
             if OP_BODIES[body] == "C" else kernels.bind_attend(k_rows, v_rows))
    return _resolved(bound, "attend_slots", body)(q, flat, valid, scale, limits)


def _resolved(bound, op: str, body: int):
    """The kernel a traced step's table resolved `op` to when it was built; it cannot decline now."""
    if bound is None:
        raise RuntimeError(f"{op}: the {OP_BODIES[body]} body chosen when the step was built does not take these "
                           "tensors (a bug: report it; decode_step='static' runs without torch.compile)")
    return bound


_LIBRARY.impl("write_kv", _write_kv, "CompositeExplicitAutograd")
_LIBRARY.impl("page_scores", _page_scores, "CompositeExplicitAutograd")
_LIBRARY.impl("attend_slots", _attend_slots, "CompositeExplicitAutograd")


@torch.library.register_fake("oval_edge::write_kv")
def _write_kv_fake(k, v, layer, slots, k_new, v_new) -> None:
    return None


@torch.library.register_fake("oval_edge::page_scores")
def _page_scores_fake(q, mean, basis, coords, scales, layer, page_table, counts, scale, body=None):
    return q.new_empty((q.shape[0], q.shape[1], page_table.shape[1]), dtype=torch.float32)


@torch.library.register_fake("oval_edge::attend_slots")
def _attend_slots_fake(q, k, v, layer, flat, valid, limits, scale, softcap=0.0, body=None):
    return torch.empty_like(q)


def _storage(pool, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(k, v, row) holding model layer `layer`: the paged tensors, or a sliding layer's rings (oval_edge/kv/ring.py);
    a layer reading another's K/V (Gemma 4), its source's."""
    row = pool.paged_index[layer]
    if row >= 0:
        return pool.k, pool.v, row
    return pool.rings.k, pool.rings.v, pool.rings.index[pool.geometry.kv_source(layer)]


def write_kv(pool, layer: int, slots: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    """Store k_new, v_new [N, Hkv, D] at rows `slots` of the pool's layer: [N * Hkv], or [N, Hkv] (one per head).

    With [N, Hkv] slots and a float pool without a page store, k_new and v_new are written as they are, strided
    slices of the fused q|k|v projection included: one index_put_ each, where flattening them for index_copy_
    copies each first (two more kernels per layer)."""
    if torch.compiler.is_compiling():
        torch.ops.oval_edge.write_kv(*_storage(pool, layer), slots.reshape(-1), k_new, v_new)
        return
    if slots.dim() == 2 and pool.scale_rows[layer] is None and pool.store is None:
        for rows, new in ((pool.k_rows[layer], k_new), (pool.v_rows[layer], v_new)):
            rows.index_put_((slots,), new if new.dtype == rows.dtype else new.to(rows.dtype))
        return
    pool.write_rows(layer, slots.reshape(-1), k_new, v_new)  # on the pool's per-layer views: no view op per call


def page_scores(pool, layer: int, q: torch.Tensor, page_table: torch.Tensor, counts: torch.Tensor,
                scale: float, body: int | None = None) -> torch.Tensor:
    """oval page scores [B, Hkv, Np] of q [B, Hkv, G, D] from the pool's records of one layer; body: an index of
    OP_BODIES (a traced step's table resolved it), None: the kernels where they take the inputs, else torch."""
    records = [pool.summaries.get(name) for name in RECORD_NAMES]  # mean, basis, coords, scales (None: float)
    layer = pool.paged_index[layer]
    if torch.compiler.is_compiling():
        return torch.ops.oval_edge.page_scores(q, *records, layer, page_table, counts, scale, body)
    return _page_scores(q, *records, layer, page_table, counts, scale, body)


def attend_slots(pool, layer: int, q: torch.Tensor, flat: torch.Tensor, valid: torch.Tensor,
                 limits: torch.Tensor | None, scale: float, softcap: float = 0.0,
                 body: int | None = None) -> torch.Tensor:
    """q [B, Hq, D] over the valid slots `flat` [B, Hkv, T] of one layer of the pool -> [B, Hq, D] (logits
    soft-capped when softcap > 0); body as in page_scores."""
    if torch.compiler.is_compiling():
        return torch.ops.oval_edge.attend_slots(q, *_storage(pool, layer), flat, valid, limits, scale, softcap, body)
    if body is not None:
        return _attend_slots(q, *_storage(pool, layer), flat, valid, limits, scale, softcap, body)
    return attend_rows(q, pool.k_rows[layer], pool.v_rows[layer], flat, valid, scale, limits, softcap,
                       pool.scale_rows[layer])
