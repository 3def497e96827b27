"""Estimate how much attention each page would receive from the current query ([R-page-score]).

For GQA the G = q_heads / kv_heads query heads that share a KV head are scored together, so one selection
serves the whole group. Both scorers return log-scale scores [B, kv_heads, pages]: a softmax over them is an
estimated distribution of attention mass over pages, which the adaptive window reads its entropy from.
"""

from __future__ import annotations

import torch

from oval_edge.kernels.cpu import decode_kernels
from oval_edge.kv.records import page_record
from oval_edge.kv.records.page_record import LayerRecords

from .grouped import LN_2, LOG2_E, grouped_scores, uses_groups


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [B, Hq, D] -> [B, kv_heads, G, D]; query head i belongs to KV head i // G (transformers' layout)."""
    b, hq, d = q.shape
    return q.reshape(b, kv_heads, hq // kv_heads, d)


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float) -> torch.Tensor:
    """Quest's upper bound on each page's largest logit, combined over the group by logsumexp.

    q [B, Hkv, G, D]; kmin, kmax [B, Np, Hkv, D] (summaries gathered by page table) -> [B, Hkv, Np].
    sum_d max(q_d * kmax_d, q_d * kmin_d) >= q . k for every key k of the page.
    """
    qe = q[:, None]  # [B, 1, Hkv, G, D]
    bound = torch.maximum(qe * kmax[:, :, :, None, :], qe * kmin[:, :, :, None, :]).sum(-1)  # [B, Np, Hkv, G]
    return torch.logsumexp(scale * bound.float(), dim=-1).transpose(1, 2)


def oval_scores(q: torch.Tensor, mean: torch.Tensor, basis_t: torch.Tensor, coords_t: torch.Tensor, scale: float,
                sets: int | None = None) -> torch.Tensor:
    """logsumexp over a page's tokens and the group's heads of scale * (mu . q + R_t . (B^T q)): the page's
    estimated log-mass under its record (page_record.py).

    q [B, Hkv, G, D]; mean mu [B, Hkv, Np, D]; basis_t B^T [B, Hkv, Np, r, D]; coords_t R^T [B, Hkv, Np, r, P]
    (float records, gathered and decoded) -> [B, Hkv, Np].
    sets=S: the G axis holds S groups of G/S query heads one after another (S decode steps over the same pages,
    as calibrate scores them), each scored on its own -> [B, Hkv, Np, S].
    One matmul projects the group's queries onto every page's basis and mean at once ([G, D] x [D, Np*(r+1)] per KV
    head). The second product is r broadcast multiply-adds with page_size-long inner loops: as a batched matmul it
    would be Np*Hkv tiny [G, r] x [r, P] products, which cost ~4x more on a CPU (measured at Np=256, r=4).
    """
    b, h, n, r, d = basis_t.shape
    rows = torch.cat((basis_t.float(), mean.float()[..., None, :]), dim=-2).reshape(b, h, n * (r + 1), d)
    # Logits in base-2 units (scale * log2 e): torch's exp2 runs ~3x faster than exp on CPUs (measured 23 vs 63 us
    # for one layer's 73k logits at 8k context), and the log-sum-exp is most of this function's time.
    proj = torch.matmul(q.float() * (scale * LOG2_E), rows.transpose(-1, -2))  # [B, Hkv, G, Np*(r+1)]
    proj = proj.view(b, h, -1, n, r + 1).permute(0, 1, 3, 2, 4).contiguous()  # [B, Hkv, Np, G, r+1]
    coord_rows = coords_t.float().unsqueeze(3).unbind(-2)  # r x [B, Hkv, Np, 1, P]
    proj_cols = proj.unsqueeze(-1).unbind(-2)  # (r+1) x [B, Hkv, Np, G, 1]; the last: mu . q
    logits = proj_cols[r].expand(*proj_cols[r].shape[:-1], coords_t.shape[-1]).clone()  # [B, Hkv, Np, G, P]
    for i in range(r):
        logits.addcmul_(proj_cols[i], coord_rows[i])
    flat = logits.view(b, h, n, -1) if sets is None else logits.view(b, h, n, sets, -1)  # [B, Hkv, Np, (S,) G*P] log2
    peak = flat.amax(dim=-1, keepdim=True)
    return (torch.exp2(flat.sub_(peak)).sum(dim=-1).log2_() + peak.squeeze(-1)) * LN_2  # natural-log units


def record_scores(q: torch.Tensor, records: LayerRecords, page_table: torch.Tensor, scale: float) -> torch.Tensor:
    """oval_scores of the pages page_table [B, Np] lists from one layer's stored records (gathered, decoded)."""
    return oval_scores(q, *page_record.decode(*page_record.gather(records, page_table)), scale)


def score_pages(
    scorer: str,
    q: torch.Tensor,
    summaries: dict[str, torch.Tensor],
    layer: int,
    page_table: torch.Tensor,
    scale: float,
    counts: torch.Tensor | None = None,
    sealed: torch.Tensor | None = None,
    groups: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """Score every page of every sequence's page table with the chosen scorer.

    q [B, Hkv, G, D]; page_table [B, Np] physical pages -> scores [B, Hkv, Np] (callers mask non-candidates).
    Only the summaries of the listed pages are read, never their keys. counts [B] int64 (optional): pages at or past
    counts[b] are not candidates of row b (the static step's padded tables); the native and Triton kernels skip
    them, the torch ops score them anyway (same shapes, and the caller masks them). The kernels read the records in
    place: the C ones on a CPU (oval only), the Triton ones on CUDA (oval_edge/kernels/gpu.py).
    groups (group_pages, top_groups) with sealed [B]: two-level oval scoring (grouped.py) once the table holds more
    than top_groups groups; pages outside the groups it keeps score -inf.
    """
    def gather(name: str) -> torch.Tensor:  # index_select on a flat index: far cheaper than advanced indexing
        table = summaries[name][layer]
        return table.index_select(0, page_table.reshape(-1)).view(*page_table.shape, *table.shape[1:])

    if scorer not in ("oval", "quest"):
        raise ValueError(f"scorer={scorer!r} is unknown; allowed: oval, quest")
    kernels = decode_kernels(q.device)
    if scorer == "oval" and sealed is not None and uses_groups(page_table.shape[1], *groups):
        return grouped_scores(q, summaries, layer, page_table, sealed, scale, *groups,
                              lambda table, n: score_pages("oval", q, summaries, layer, table, scale, n))
    if scorer == "oval":
        records = page_record.layer_records(summaries, layer)
        if kernels is not None:  # one pass over the listed pages' records, read in place
            scores = kernels.oval_scores(q, records, page_table, scale, counts)
            if scores is not None:
                return scores
        return record_scores(q, records, page_table, scale)
    if kernels is not None:  # Triton only (the C kernels have none for quest)
        scores = kernels.quest_scores(q, summaries["kmin"][layer], summaries["kmax"][layer], page_table, scale,
                                      counts)
        if scores is not None:
            return scores
    return quest_scores(q, gather("kmin"), gather("kmax"), scale)
