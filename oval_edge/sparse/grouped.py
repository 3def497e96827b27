"""Two-level page scoring: coarse group records first, fine page records only inside the best groups.

Flat scoring reads every sealed page's record at every step, so its cost grows with the context. With
config.group_pages = G > 0 the pool also keeps one coarse record per G logical pages (oval_edge/kv/records/group_record.py);
a step then scores

    1. every complete group of a row by its coarse bound (logsumexp over the group's query heads, then over the
       KV heads: one choice of groups per row, so the fine table stays one [B, F] table the kernels take); a group
       the pool had no record slot for (kv/records/group_slots.py) bounds at +inf: it is always kept,
    2. the fine records of the pages of the row's top_groups groups plus the pages of its unfinished group (sealed
       pages not yet in a complete group), F = (top_groups + 1) * G pages,

and returns page scores [B, Hkv, Np] with -inf outside those pages, which the selection masks like any
non-candidate. Every shape depends only on B, Np and the config (no host sync: the static step can run it).
With at most top_groups groups in the table the two levels would read more than flat scoring: flat it is.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from oval_edge.kernels.cpu import decode_kernels
from oval_edge.kv.records.group_record import GROUP_SLOT, float_basis, layer_coarse
from oval_edge.kv.records.page_record import layer_records

LOG2_E, LN_2 = 1.0 / math.log(2.0), math.log(2.0)  # base-2 logits as in scoring.oval_scores (exp2 is cheaper)

FineScorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (table [B, F], counts [B]) -> [B, Hkv, F]


def uses_groups(num_pages: int, group_pages: int, top_groups: int) -> bool:
    """Whether a page table this wide is scored in two levels (more complete groups than are kept)."""
    return group_pages > 0 and num_pages // group_pages > top_groups


def coarse_scores(q: torch.Tensor, mean: torch.Tensor, basis_t: torch.Tensor, bounds: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Each group's bound on its keys' logits, combined over the group's query heads by logsumexp.

    q [B, Hkv, G, D]; mean [B, Ng, Hkv, D]; basis_t [B, Ng, Hkv, r, D]; bounds [B, Ng, Hkv, 2, r] -> [B, Hkv, Ng]."""
    qs = q.float() * (scale * LOG2_E)  # base-2 logits, as scoring.oval_scores
    proj = torch.einsum("bhgd,bnhrd->bhngr", qs, basis_t.float())  # p = B^T q: [B, Hkv, Ng, G, r]
    centre = torch.einsum("bhgd,bnhd->bhng", qs, mean.float())  # mu . q: [B, Hkv, Ng, G]
    box = bounds.float().permute(0, 2, 1, 3, 4)[:, :, :, None]  # [B, Hkv, Ng, 1, 2, r]
    top = torch.maximum(proj * box[..., 0, :], proj * box[..., 1, :]).sum(-1)  # [B, Hkv, Ng, G]
    return torch.logsumexp((centre + top) * LN_2, dim=-1)


def grouped_scores(q: torch.Tensor, summaries: dict[str, torch.Tensor], layer: int, page_table: torch.Tensor,
                   sealed: torch.Tensor, scale: float, group_pages: int, top_groups: int,
                   fine: FineScorer) -> torch.Tensor:
    """Page scores [B, Hkv, Np] of q [B, Hkv, G, D] over page_table [B, Np] (sealed [B] pages have records), in two
    levels; `layer` indexes the pool's paged tensors; `fine` scores a [B, F] table of physical pages.
    On a CPU (eager) the whole of it is one call of group_kernels.c; grouped_reference (torch) is the fallback and
    what torch.compile traces."""
    if not torch.compiler.is_compiling():
        kernels = decode_kernels(q.device)
        if kernels is not None:  # coarse bounds, the choice of groups and the fine records, read in place
            scores = kernels.grouped_scores(q, layer_coarse(summaries, layer), layer_records(summaries, layer),
                                            page_table, sealed, scale, group_pages, top_groups)
            if scores is not None:
                return scores
    return grouped_reference(q, summaries, layer, page_table, sealed, scale, group_pages, top_groups, fine)


def grouped_reference(q: torch.Tensor, summaries: dict[str, torch.Tensor], layer: int, page_table: torch.Tensor,
                      sealed: torch.Tensor, scale: float, group_pages: int, top_groups: int,
                      fine: FineScorer) -> torch.Tensor:
    """grouped_scores in torch ops (the kernels' reference): same arguments, same result."""
    b, num_pages = page_table.shape
    size = group_pages
    groups = num_pages // size
    dev = page_table.device
    last = page_table[:, size - 1 : groups * size : size]  # [B, Ng] each group's last physical page
    slot = summaries[GROUP_SLOT].index_select(0, last.reshape(-1))  # [B*Ng] its record's slot, -1: none
    flat = slot.clamp(min=0)

    def gather(name: str) -> torch.Tensor:
        table = summaries[name][layer]  # [slots, Hkv, ...]
        return table.index_select(0, flat).view(b, groups, *table.shape[1:])

    basis_t = float_basis(gather("group_basis"), gather("group_scales"))
    coarse = coarse_scores(q, gather("group_mean"), basis_t, gather("group_bounds"), scale)  # [B, Hkv, Ng]
    coarse = coarse.masked_fill((slot < 0).view(b, 1, groups), float("inf"))  # no record: always kept
    complete = sealed // size  # [B] groups whose last page has sealed
    per_row = torch.logsumexp(coarse, dim=1)  # [B, Ng]: the row's estimated mass in each group, all KV heads
    per_row = per_row.masked_fill(torch.arange(groups, device=dev) >= complete[:, None], float("-inf"))
    best, picked = per_row.topk(top_groups, dim=-1)  # [B, m]
    offsets = torch.arange(size, device=dev)
    logical = torch.cat([(picked[..., None] * size + offsets).flatten(1),  # [B, m*G] pages of the top groups
                         complete[:, None] * size + offsets], dim=1)  # [B, G] pages of the unfinished group
    ok = torch.cat([(best > float("-inf"))[..., None].expand(-1, -1, size).flatten(1),
                    complete[:, None] * size + offsets < sealed[:, None]], dim=1)  # [B, F]
    logical = logical.clamp(max=num_pages - 1)
    table = page_table.gather(1, logical)  # [B, F] physical
    counts = torch.full((b,), table.shape[1], dtype=torch.long, device=dev)
    scores = fine(table, counts).float().masked_fill(~ok[:, None, :], float("-inf"))  # [B, Hkv, F]
    out = torch.full((b, scores.shape[1], num_pages), float("-inf"), device=dev)
    # amax: a clamped or unused slot (-inf) never overwrites a real page's score at the same index
    return out.scatter_reduce(2, logical[:, None, :].expand_as(scores), scores, "amax", include_self=True)
