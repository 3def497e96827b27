"""Freeze the `oval` scorer's eta, rank r and record format on the calibration split ([R-page-score]: "until the
calibrate tool freezes them").

For each candidate (eta, r) the pages of the calibration text are summarised exactly as the pool seals them
(`oval_summary`), every sampled query scores the candidate pages of its decode step (the runtime's DecodePlan)
with the runtime's scorer (scoring.oval_scores) and takes the top-k, and the attention output it would get is
compared with dense attention's:

    error = Σ ‖o_sparse − o_dense‖² / Σ ‖o_dense‖²   over samples, query heads and sparse layers

where o_sparse is the exact softmax over sink ∪ chosen pages ∪ the fixed window (what the runtime computes). The
output, not the attention mass, is what the next layer sees, and it is what eta trades for: a page of keys that
draw mass but carry values near the mean moves the output little. The recall of the oracle's top-k page mass is
reported too. The lowest calibration error wins; a smaller rank wins when its error is within `tolerance`
(relative) of the best (rank costs summary bytes per page: D·r + P·r).

Each (eta, r) is also scored through every stored record format (`records`: the pool's int8 / int4 encodings,
page_record.encode then decode, exactly what the kernels read). The frozen (eta, r) is chosen on the float record;
the frozen format is the most compact one whose error at that (eta, r) is within `record_tolerance` of the float
record's (the formats read 0.51x (int8) and 0.33x (int4) the bytes of a bf16 record at D = 64, P = 32, r = 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oval_edge.config import OvalConfig
from oval_edge.kv.records import page_record
from oval_edge.kv.records.summaries import oval_summary
from oval_edge.sparse.scoring import oval_scores
from oval_edge.sparse.selection import DecodePlan

from .capture import log_attention


COMPACT_FIRST = ("int4", "int8", "float")  # record formats, fewest bytes first


@dataclass
class ScorerFit:
    eta: float
    rank: int
    table: list[dict]  # one row per (eta, rank, record) and one for the oracle: error and recall on both splits
    record: str = "float"


def page_scores(q: torch.Tensor, mean: torch.Tensor, basis_t: torch.Tensor, coords_t: torch.Tensor,
                scale: float) -> torch.Tensor:
    """The runtime's oval score (scoring.oval_scores) for pages shared by every query, without gathering them
    per row: q [S, Hkv, G, D]; mean [Np, Hkv, D]; basis_t B^T [Np, Hkv, r, D]; coords_t R^T [Np, Hkv, r, P]
    -> [S, Hkv, Np].

    The S queries are scored as S sets of one batch row, so the pages' records are laid out once.
    """
    s, kv_heads, group, d = q.shape
    grouped = q.transpose(0, 1).reshape(1, kv_heads, s * group, d)  # [1, Hkv, S*G, D], query set s first
    records = (mean.transpose(0, 1)[None], basis_t.transpose(0, 1)[None], coords_t.transpose(0, 1)[None])
    return oval_scores(grouped, *records, scale, sets=s)[0].permute(2, 0, 1)  # [S, Hkv, Np]


class ScorerTally:
    """Accumulates, per (eta, rank) and for the oracle, output error and captured page mass over sparse layers."""

    def __init__(self, etas: list[float], ranks: list[int], config: OvalConfig, head_dim: int,
                 records: tuple[str, ...] = ("float",)) -> None:
        top = min(head_dim, config.page_size - 1)  # a page's centred keys span at most page_size - 1 directions
        bad = [r for r in ranks if not 1 <= r <= top]
        if bad:
            raise ValueError(f"--ranks {bad} out of range: allowed [1, min(head_dim, page_size - 1) = {top}]")
        unknown = [r for r in records if r not in COMPACT_FIRST]
        if unknown or "float" not in records:
            raise ValueError(f"--records {','.join(records)}: each of {', '.join(COMPACT_FIRST)}, float included "
                             "(the reference the quantized formats are held to)")
        self.etas, self.ranks, self.config = list(etas), sorted(ranks), config
        self.records = ("float",) + tuple(r for r in dict.fromkeys(records) if r != "float")
        # [eta (+ the oracle's row, same for every rank and record), rank, record, split]
        shape = (len(self.etas) + 1, len(self.ranks), len(self.records), 2)
        self.error = torch.zeros(shape, dtype=torch.float64)
        self.mass = torch.zeros(shape, dtype=torch.float64)
        self.norm = torch.zeros(2, dtype=torch.float64)  # Σ ‖o_dense‖² per split
        self.oracle_mass = torch.zeros(2, dtype=torch.float64)

    @torch.no_grad()
    def add(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
            heldout: torch.Tensor, scale: float, chunk: int = 64, metric: torch.Tensor | None = None) -> None:
        """One layer. queries [S, Hq, D] at positions [S]; keys, values [N, Hkv, D]; heldout [S] bool;
        metric [Hkv, D, D]: the layer's output-projection metric G^{1/2} (needed for eta > 0)."""
        c = self.config
        P, k, sink = c.page_size, c.top_k, c.sink_pages
        n, kv_heads, d = keys.shape
        full = n // P
        if full <= sink:
            return
        kp = keys[: full * P].view(full, P, kv_heads, d).transpose(1, 2).reshape(-1, P, d)  # pages as sealed
        vp = values[: full * P].view(full, P, kv_heads, d).transpose(1, 2).reshape(-1, P, d)
        per_page = metric[None].expand(full, -1, -1, -1).reshape(-1, d, d) if metric is not None else None
        summaries = [oval_summary(kp, vp, self.ranks[-1], eta, per_page if eta > 0 else None)
                     for eta in self.etas]  # top-r: slice the rows
        v_pages = values[: full * P].view(full, P, kv_heads, d)
        at_window_min = c.replace(window_max=c.window_min, window_module=None)
        for first in range(0, queries.shape[0], chunk):
            t = positions[first : first + chunk]
            q = queries[first : first + chunk]
            split = heldout[first : first + chunk].long()
            probs = log_attention(q, keys, t, scale).exp()  # [c, Hkv, G, N]
            # The runtime's plan of this decode step (fixed window: the scorer is fitted at window_min): t tokens
            # before it, so t // P sealed pages; the window starts at `start`, pages below it are `candidate`.
            plan = DecodePlan(at_window_min, t + 1, torch.div(t, P, rounding_mode="floor"), full, kv_heads)
            start, candidate = plan.start[:, 0, 0], plan.selectable[:, 0, :]  # [c], [c, Np]
            span = torch.arange(n)[None, :]
            paged = ((span >= sink * P) & (span < start[:, None])).float()  # [c, N]: what pages must supply
            fixed = probs * (1.0 - paged)[:, None, None, :]  # sink + window (+ nothing past t: probs are 0)
            m_fixed = fixed.sum(-1)  # [c, Hkv, G]
            u_fixed = torch.einsum("chgn,nhd->chgd", fixed, values)
            below = (probs * paged[:, None, None, :])[..., : full * P].view(*probs.shape[:3], full, P)
            m_page = below.sum(-1)  # [c, Hkv, G, Np]
            u_page = torch.einsum("chgnp,nphd->chgnd", below, v_pages)  # [c, Hkv, G, Np, D]
            dense = u_fixed + u_page.sum(3)  # the dense output (the parts partition every position <= t)
            self.norm.index_add_(0, split, dense.pow(2).sum((1, 2, 3)).double())
            mass = m_page.sum(2).masked_fill(~candidate[:, None, :], -1.0)  # [c, Hkv, Np] group mass
            take = min(k, full)
            self._tally(len(self.etas), None, mass.topk(take, -1).indices, mass, m_fixed, u_fixed, m_page, u_page,
                        dense, split)
            for i, (mean, basis_t, coords_t) in enumerate(summaries):
                mean = mean.view(full, kv_heads, d)
                basis_t = basis_t.view(full, kv_heads, -1, d)
                coords_t = coords_t.view(full, kv_heads, -1, P)
                for j, r in enumerate(self.ranks):
                    for f, fmt in enumerate(self.records):
                        stored = stored_record(mean, basis_t[:, :, :r], coords_t[:, :, :r], fmt)
                        score = page_scores(q.view(q.shape[0], kv_heads, -1, d), *stored, scale)
                        score = score.masked_fill(~candidate[:, None, :], float("-inf"))
                        self._tally(i, j, score.topk(take, -1).indices, mass, m_fixed, u_fixed, m_page, u_page,
                                    dense, split, f)

    def _tally(self, i, j, chosen, mass, m_fixed, u_fixed, m_page, u_page, dense, split, f=None) -> None:
        """chosen [c, Hkv, k] page indices (non-candidates carry mass -1 and count as nothing)."""
        ok = mass.gather(-1, chosen) >= 0  # [c, Hkv, k]
        groups, d = m_page.shape[2], u_page.shape[-1]
        idx = chosen[:, :, None, :].expand(-1, -1, groups, -1)  # [c, Hkv, G, k]
        m = m_fixed + (m_page.gather(3, idx) * ok[:, :, None, :]).sum(-1)
        u = u_fixed + (u_page.gather(3, idx[..., None].expand(-1, -1, -1, -1, d)) * ok[:, :, None, :, None]).sum(3)
        err = (u / m.clamp_min(1e-30)[..., None] - dense).pow(2).sum((1, 2, 3)).double()  # [c]
        got = (mass.gather(-1, chosen) * ok).sum((1, 2)).double()
        cells = [(jj, ff) for jj in range(len(self.ranks)) for ff in range(len(self.records))] if j is None \
            else [(j, f)]
        for jj, ff in cells:
            self.error[i, jj, ff].index_add_(0, split, err)
            self.mass[i, jj, ff].index_add_(0, split, got)
        if j is None:
            self.oracle_mass.index_add_(0, split, got)

    def result(self, tolerance: float = 0.02, record_tolerance: float = 0.02) -> ScorerFit:
        error = self.error / self.norm.clamp_min(1e-30)  # [etas + 1, ranks, records, split]
        recall = self.mass / self.oracle_mass.clamp_min(1e-30)
        table = [{"eta": eta, "rank": r, "record": fmt, "error_calibration": float(error[i, j, f, 0]),
                  "error_heldout": float(error[i, j, f, 1]), "recall_calibration": float(recall[i, j, f, 0]),
                  "recall_heldout": float(recall[i, j, f, 1])}
                 for i, eta in enumerate(self.etas) for j, r in enumerate(self.ranks)
                 for f, fmt in enumerate(self.records)]
        o = len(self.etas)
        table.append({"eta": None, "rank": None, "record": None, "error_calibration": float(error[o, 0, 0, 0]),
                      "error_heldout": float(error[o, 0, 0, 1]), "recall_calibration": 1.0, "recall_heldout": 1.0})
        float_error = error[:o, :, 0, 0]  # [etas, ranks] of the float record: what eta and r are chosen on
        best = float(float_error.min())
        for j, r in enumerate(self.ranks):  # smallest rank whose best eta comes within tolerance of the best
            i = int(float_error[:, j].argmin())
            if float(float_error[i, j]) <= best * (1.0 + tolerance):
                reference = float(float_error[i, j])
                record = next(fmt for fmt in COMPACT_FIRST if fmt in self.records
                              and float(error[i, j, self.records.index(fmt), 0]) <= reference * (1.0 + record_tolerance))
                return ScorerFit(self.etas[i], r, table, record)
        raise AssertionError("unreachable: the best rank is within tolerance of itself")


def stored_record(mean: torch.Tensor, basis_t: torch.Tensor, coords_t: torch.Tensor, fmt: str):
    """The record as the pool stores it in `fmt` and the kernels read it back (fp32; 'float' unchanged):
    mean [..., D], basis_t [..., r, D], coords_t [..., r, P]."""
    if fmt == "float":
        return mean, basis_t, coords_t
    stored = page_record.encode(mean, basis_t, coords_t, fmt, torch.float32)
    return page_record.decode(stored["mean"], stored["basis"], stored["coords"], stored["scales"])
