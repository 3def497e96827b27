"""Coarse records of page groups, for two-level scoring (oval_edge/sparse/grouped.py).

A group is a run of G = geometry.group_pages consecutive logical pages of one sequence. When its last page seals,
one record is built from the keys of all G*P tokens, per layer and KV head, and stored in the record slot the
pool's GroupSlots map gives that last physical page (group_slots.py: about 2 slots per G pages, not one a page).
Keying by the last page keeps the record valid under prefix caching: a page's name hashes every page before it, so
a shared last page means a shared group.

The record is the group's centred key basis with a box around the coordinates:

    mu [D] (key mean), B^T [r, D] (top-r principal directions of K - mu), lo, hi [r] (min and max of (K - mu) B)

so that for every key k_t of the group q . k_t ~= mu . q + sum_i (B^T q)_i c_ti <= mu . q + sum_i max(p_i lo_i,
p_i hi_i) with p = B^T q: Quest's per-channel bound, taken in the group's principal axes, where the keys' spread
is concentrated (axis-aligned bounds over 512 tokens say little; rotated ones keep their shape).

The basis, r x D of the record's r x D + D + 2r values, is stored as int8 codes with one fp32 scale per row (a unit
row's largest entry over 127: ~0.4% of it at most): 704 instead of 1,184 bytes at D = 64, r = 8 beside bf16 mean
and box. The coarse level reads every group's record at every step, so on a CPU its cost was the bytes (at 32k, in
a real step, twice its in-cache time, measured); the slots also come out of the page budget.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...spectral import dominant_eigenvectors
from ..huge_pages import pool_tensor
from ..int8 import dequantize_rows, quantize_rows

# mean [D] and box [2, r] in the pool's dtype; basis B^T [r, D] int8 codes with a scale per row [r] fp32.
GROUP_NAMES = ("group_mean", "group_basis", "group_bounds", "group_scales")
GROUP_SLOT = "group_slot"  # the pool's page -> slot map [pages] int64 (GroupSlots.slot_of), -1: no record


def layer_coarse(summaries: dict[str, torch.Tensor], layer: int) -> tuple[torch.Tensor, ...]:
    """One layer's coarse records in GROUP_NAMES' order, then the pool's page -> slot map (what the two-level
    kernels take)."""
    return tuple(summaries[name][layer] for name in GROUP_NAMES) + (summaries[GROUP_SLOT],)


def allocate_group_records(geometry, slots: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """`slots` coarse record slots per layer and KV head, allocated once with the pool ({} if flat)."""
    g = geometry
    if not g.group_pages:
        return {}
    lead = (g.paged_layers, slots, g.kv_heads)
    return {
        "group_mean": pool_tensor(lead + (g.head_dim,), dtype, device),  # [L, slots, Hkv, D]
        # [L, slots, Hkv, r, D] int8 codes
        "group_basis": pool_tensor(lead + (g.rank, g.head_dim), torch.int8, device),
        "group_bounds": pool_tensor(lead + (2, g.rank), dtype, device),  # [L, slots, Hkv, 2, r]
        "group_scales": pool_tensor(lead + (g.rank,), torch.float32, device, fill=1.0),  # [L, slots, Hkv, r]
    }


def stored_group_record(mean: torch.Tensor, basis_t: torch.Tensor, bounds: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """group_record's (mu [..., D], B^T [..., r, D], bounds [..., 2, r]) as the pool stores them, in GROUP_NAMES'
    order: mean and bounds in dtype, the basis as int8 codes and its per-row fp32 scales [..., r]."""
    codes, scales = quantize_rows(basis_t.reshape(-1, basis_t.shape[-1]))
    return (mean.to(dtype), codes.view(basis_t.shape), bounds.to(dtype), scales.view(basis_t.shape[:-1]))


def float_basis(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The stored basis codes [..., r, D] and scales [..., r] -> B^T [..., r, D] fp32."""
    return dequantize_rows(codes, scales)


def group_record(keys: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [N, T, D] (T = G * P tokens of N groups) -> (mu [N, D], B^T [N, r, D], bounds [N, 2, r]) fp32.

    The basis comes from the D x D scatter matrix (T > D here, so this is the small side)."""
    k = keys.float()
    mean = k.mean(dim=1)  # [N, D]
    x = k - mean[:, None]  # [N, T, D]
    basis = dominant_eigenvectors(x.transpose(1, 2) @ x, rank)  # [N, D, r]
    coords = x @ basis  # [N, T, r]
    bounds = torch.stack((coords.amin(dim=1), coords.amax(dim=1)), dim=1)  # [N, 2, r]
    return mean, basis.transpose(1, 2).contiguous(), bounds


@torch.no_grad()
def seal_groups(pool, groups: Sequence[Sequence[int]]) -> None:
    """Build the coarse records of complete groups, each given as its G physical pages in logical order, every layer
    and KV head at once; the record lands in the slot pool.group_slots gives the group's last page (a group it has
    no slot for is left without: grouped.py then always scores its pages finely)."""
    g = pool.geometry
    if not groups or not g.paged_layers:
        return
    # a record may give way only where no sequence holds the page (free or cached; a later prefix hit rebuilds it)
    slots = pool.group_slots.assign([group[-1] for group in groups], lambda page: page not in pool.ledger.refs)
    groups = [group for group, slot in zip(groups, slots) if slot >= 0]
    slots = [slot for slot in slots if slot >= 0]
    per_batch = max(1, pool.seal_chunk // g.group_pages)  # bounded transient memory, as page sealing
    for i in range(0, len(groups), per_batch):
        batch = groups[i : i + per_batch]
        idx = torch.tensor([p for group in batch for p in group], dtype=torch.long, device=pool.device)
        # [L, n*G, Hkv, P, D]; int8 K/V: dequantized codes (the pages have sealed, their staged keys are gone; the
        # codes' rounding, <= scale / 2 per value, is small against the spread of a group's G*P keys)
        keys = pool.k.index_select(1, idx)
        if pool.int8 is not None:
            keys = dequantize_rows(keys, pool.int8.k_scale.index_select(1, idx))
        n = len(batch)
        keys = keys.view(g.paged_layers, n, g.group_pages, g.kv_heads, g.page_size, g.head_dim)
        keys = keys.permute(0, 1, 3, 2, 4, 5).reshape(-1, g.group_pages * g.page_size, g.head_dim)  # [L*n*Hkv, T, D]
        stored = stored_group_record(*group_record(keys, g.rank), pool.summaries["group_mean"].dtype)
        lead = (g.paged_layers, n, g.kv_heads)
        slot = torch.tensor(slots[i : i + per_batch], dtype=torch.long, device=pool.device)
        for name, value in zip(GROUP_NAMES, stored):
            pool.summaries[name].index_copy_(1, slot, value.view(*lead, *value.shape[1:]))


def completed_groups(table: Sequence[int], sealed_before: int, sealed_now: int, group_pages: int) -> list[list[int]]:
    """The groups of a page table whose last page sealed between sealed_before and sealed_now pages ([] if flat)."""
    if not group_pages:
        return []
    first = sealed_before // group_pages
    return [list(table[j * group_pages : (j + 1) * group_pages]) for j in range(first, sealed_now // group_pages)]
