"""fp64 references for the parity grid (tests/test_parity_grid.py), written from the definitions, not from the torch
bodies: the record formats unpacked from the byte layout oval_edge/kv/records/page_record.py documents, the oval and quest
scores, the two-level choice of groups, the selection rules (step_kernels.c's header states them) and attention,
each in float64 over the values as stored. Only the format's constants come from the package: the Hadamard
rotation H (page_record.rotation, checked orthonormal and symmetric here) and how many ranks carry a fifth bit."""

from __future__ import annotations

import torch

from oval_edge.kv.records.page_record import rotation
from oval_edge.record_layout import coord_fifth_ranks

F64 = torch.float64


def _nibbles(data: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` 4-bit values of bytes [..., n]: element 2j in the low nibble of byte j, 2j + 1 in its high."""
    data = data.long()
    return torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)[..., :count]


def _bits(data: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` bits of bytes [..., n]: bit i % 8 of byte i / 8."""
    return ((data.long()[..., :, None] >> torch.arange(8)) & 1).flatten(-2)[..., :count]


def decoded_records(records) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's stored records -> (mean [Hkv, N, D], basis [Hkv, N, r, D], coords [Hkv, N, r, P]) fp64 with every
    scale applied, so that a key of token p is ~ mean + sum_i coords[i, p] basis[i]."""
    mean, basis, coords, scales = records
    if scales is None:  # float records: as stored
        return mean.to(F64), basis.to(F64), coords.to(F64)
    s = scales.to(F64)  # [Hkv, N, 1 + r]: the mean's, then per rank basis x coordinate scale
    rank, dim = basis.shape[2], mean.shape[-1]
    if basis.dtype == torch.int8:
        return mean.to(F64) * s[..., :1], basis.to(F64) * s[..., 1:, None], coords.to(F64)
    # int4: basis rows of D / 2 nibble bytes then D / 8 fifth-bit bytes, 5-bit level = nibble + 16 * bit - 16,
    # stored rotated (b H): b = (b H) H
    h = rotation(dim).to(F64)
    assert torch.allclose(h @ h, torch.eye(dim, dtype=F64), atol=1e-12) and torch.equal(h, h.T)
    levels = (_nibbles(basis[..., : dim // 2], dim) + 16 * _bits(basis[..., dim // 2 :], dim) - 16).to(F64)
    real_basis = (levels @ h) * s[..., 1:, None]
    # coordinates: r * P / 2 bytes of rank-major nibbles, then P / 8 bytes of fifth bits for each of the first f ranks
    fifth = coord_fifth_ranks(rank)
    page = coords.shape[-1] * 8 // (4 * rank + fifth)
    nib = _nibbles(coords[..., : rank * page // 2], rank * page).view(*coords.shape[:-1], rank, page)
    bit = _bits(coords[..., rank * page // 2 :], fifth * page).view(*coords.shape[:-1], fifth, page)
    values = nib - 8
    values[..., :fifth, :] = nib[..., :fifth, :] + 16 * bit - 16
    return mean.to(F64) * s[..., :1], real_basis, values.to(F64)


def _lse(x: torch.Tensor, dims) -> torch.Tensor:
    return torch.logsumexp(x, dim=dims)


def oval_scores(q: torch.Tensor, records, table: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hkv, G, D] over table [B, W] -> [B, Hkv, W] fp64: logsumexp over the page's P tokens and the group's
    G heads of scale * (mean . q_g + sum_i (basis_i . q_g) coords[i, p])."""
    mean, basis, coords = decoded_records(records)
    q = q.to(F64)
    m, bs, c = mean[:, table], basis[:, table], coords[:, table]  # [Hkv, B, W, ...]
    centre = torch.einsum("hbwd,bhgd->bhwg", m, q)
    proj = torch.einsum("hbwrd,bhgd->bhwgr", bs, q)
    logits = centre[..., None] + torch.einsum("bhwgr,hbwrp->bhwgp", proj, c)
    return _lse(scale * logits, (-2, -1))


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Quest's bound sum_d max(q_d kmax_d, q_d kmin_d), logsumexp over the group: [B, Hkv, W] fp64.
    kmin, kmax [pages, Hkv, D]."""
    q = q.to(F64)[:, :, None]  # [B, Hkv, 1, G, D]
    lo, hi = (t.to(F64)[table].transpose(1, 2)[:, :, :, None] for t in (kmin, kmax))  # [B, Hkv, W, 1, D]
    return _lse(scale * torch.maximum(q * hi, q * lo).sum(-1), -1)


def two_level_scores(q: torch.Tensor, coarse, records, table: torch.Tensor, sealed: torch.Tensor, scale: float,
                     size: int, keep: int) -> torch.Tensor:
    """grouped.py's rule in fp64: each complete group (sealed // size of a row's) bounded by its coarse record
    (logsumexp over G of scale * (mean . q + sum_i max(p_i lo_i, p_i hi_i)), p = basis q, then logsumexp over the
    KV heads; a group whose last page has slot -1 bounds at +inf); the `keep` best complete groups and the sealed
    pages of the unfinished group are scored finely, every other page is -inf. coarse: (mean [S, Hkv, D],
    basis codes [S, Hkv, r, D] int8, bounds [S, Hkv, 2, r], basis scales [S, Hkv, r], page -> slot [pages])."""
    g_mean, g_basis, g_bounds, g_scales, slot_of = coarse
    fine = oval_scores(q, records, table, scale)
    out = torch.full_like(fine, float("-inf"))
    qd = q.to(F64)
    for b in range(table.shape[0]):
        complete = int(sealed[b]) // size
        bounds = []
        for j in range(complete):
            slot = int(slot_of[table[b, j * size + size - 1]])
            if slot < 0:
                bounds.append(float("inf"))
                continue
            basis = g_basis[slot].to(F64) * g_scales[slot].to(F64)[..., None]  # [Hkv, r, D]
            p = torch.einsum("hrd,hgd->hgr", basis, qd[b])
            lo, hi = g_bounds[slot].to(F64).unbind(1)  # [Hkv, r] each
            top = torch.maximum(p * lo[:, None], p * hi[:, None]).sum(-1)
            centre = torch.einsum("hd,hgd->hg", g_mean[slot].to(F64), qd[b])
            bounds.append(float(_lse(_lse(scale * (centre + top), -1), 0)))
        picked = sorted(range(complete), key=lambda j: -bounds[j])[:keep]
        pages = [n for j in picked for n in range(j * size, (j + 1) * size)]
        pages += [n for n in range(complete * size, complete * size + size) if n < int(sealed[b])]
        out[b, :, pages] = fine[b, :, pages]
    return out


def selected_slots(scores: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, sealed: torch.Tensor,
                   page: int, sink: int, top_k: int, window: int, slots: int, kv_heads: int) -> list[list[list[int]]]:
    """The sorted pool rows each (row b, KV head h) attends to under a fixed window (step_kernels.c's rules): a row
    of length L <= slots reads positions 0..L-1; else with start = min(L - window, sealed * P) the sink below
    start, the top_k candidate pages (sink <= n < sealed, n P < L - window, n P < start; by score, ties to the
    lower page) below start, and start..L-1. Position t of row b is pool row (table[b, t / P] Hkv + h) P + t % P."""
    out = []
    for b in range(table.shape[0]):
        length, done = int(lengths[b]), int(sealed[b])
        start = min(length - window, done * page)
        heads = []
        for h in range(kv_heads):
            if length <= slots:
                positions = list(range(length))
            else:
                candidates = [n for n in range(sink, done) if n * page < length - window and n * page < start]
                best = sorted(candidates, key=lambda n: (-float(scores[b, h, n]), n))[:top_k]
                positions = [t for t in range(min(sink * page, start))]
                positions += [t for n in best for t in range(n * page, min(n * page + page, start))]
                positions += list(range(start, length))
            heads.append(sorted((int(table[b, t // page]) * kv_heads + h) * page + t % page for t in positions))
        out.append(heads)
    return out


def attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, flat: torch.Tensor, valid: torch.Tensor,
              scale: float, limits: torch.Tensor | None = None, softcap: float = 0.0, scales=None) -> torch.Tensor:
    """softmax(scale q . k, capped to softcap tanh(x / softcap) when softcap > 0) v over the valid slots of flat
    [B, Hkv, T] (the first limits[b] of row b), query head i reading KV head i // G; int8 rows times their
    per-row scales. -> [B, Hq, D] fp64."""
    k, v = k_rows.to(F64), v_rows.to(F64)
    if scales is not None:
        k, v = k * scales[0].to(F64)[:, None], v * scales[1].to(F64)[:, None]
    b, hq, d = q.shape
    hkv = flat.shape[1]
    ok = valid.clone()
    if limits is not None:
        ok &= torch.arange(flat.shape[-1]) < limits[:, None, None]
    logits = torch.einsum("bhgd,bhtd->bhgt", q.to(F64).view(b, hkv, hq // hkv, d), k[flat]) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    weights = logits.masked_fill(~ok[:, :, None], float("-inf")).softmax(-1)
    return torch.einsum("bhgt,bhtd->bhgd", weights, v[flat]).reshape(b, hq, d)
