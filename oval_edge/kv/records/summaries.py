"""Page summaries built once when a page is sealed ([R-page-score]), batched over pages x heads x layers.

Inputs are flattened: N = layers * pages * kv_heads independent pages, each with P tokens of head dim D.
"""

from __future__ import annotations

import statistics
import time

import torch

from ...spectral import dominant_eigenvectors, orthonormal_basis
from . import page_record
from .group_record import GROUP_SLOT, allocate_group_records, group_record


def allocate_summaries(geometry, pages: int, dtype: torch.dtype, device, group_slots) -> dict[str, torch.Tensor]:
    """Every summary tensor of a pool of `pages` page records, allocated once: quest's per-channel key bounds
    [L, pages, Hkv, D], the oval records (page_record.py, head-major) and, with two-level scoring, the coarse
    records in group_slots' slots and its page -> slot map (group_record.py, group_slots.py)."""
    g, out = geometry, {}
    if "quest" in g.summary_kinds:
        out["kmin"] = torch.zeros((g.paged_layers, pages, g.kv_heads, g.head_dim), dtype=dtype, device=device)
        out["kmax"] = torch.zeros_like(out["kmin"])
    if "oval" in g.summary_kinds:
        out.update(page_record.allocate_records(g, pages, dtype, device),
                   **allocate_group_records(g, group_slots.count, dtype, device))
        if group_slots.count:
            out[GROUP_SLOT] = group_slots.slot_of
    return out


def quest_summary(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel key min and max of each page: keys [N, P, D] -> (kmin [N, D], kmax [N, D])."""
    return keys.amin(dim=1), keys.amax(dim=1)


def oval_summary(keys: torch.Tensor, values: torch.Tensor, rank: int, eta: float,
                 metric_sqrt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output-aware local record of each page, as the OVAL authors build it ([R-page-score]).

    keys, values [N, P, D] (post-RoPE keys). Returns (mu [N, D], B^T [N, r, D], R^T [N, r, P]) fp32 with
    r = min(rank, P - 1): the page's key mean, the top-r eigenvectors of M and the centred keys' coordinates
    R = X B, so that q . k_t ~= mu . q + R_t . (B^T q) for every token t of the page.

    X = K - mu are the centred keys, Y = V - mean(V) the centred values.
      eta = 0: M = X^T X (key PCA, the spectral record). Solved on the P x P Gram X X^T when P < D (same nonzero
               spectrum, ~3x cheaper at P=32, D=64, which matters because a page seal stalls a decode step).
      eta > 0: M = (1-eta) X^T X / tr(X^T X) + eta X^T Z Z^T X / tr(X^T Z Z^T X), Z = Y G^{1/2}: the keys'
               spread weighted by how far the values would move the output through the output projection
               (G = sum over the group's query heads of W_O,g^T W_O,g); metric_sqrt [N, D, D] is G^{1/2}.
               Solved on the D x D matrix (A = (1-eta) I / tr + eta Z Z^T / tr is a P x P weighting of the tokens).
    Centring costs a degree of freedom: rank(X) <= P - 1, so a P-th direction would be noise (hence the cap).
    """
    k = keys.float()
    page_size, dim = k.shape[1], k.shape[2]
    r = min(rank, page_size - 1, dim)
    mean = k.mean(dim=1)  # [N, D]
    x = k - mean[:, None]  # [N, P, D]
    if eta > 0:
        if metric_sqrt is None:
            raise ValueError("eta > 0 needs the output projection's metric (PagePool.set_output_metric); "
                             "use eta=0 for the key-only record")
        y = values.float()
        z = (y - y.mean(dim=1, keepdim=True)) @ metric_sqrt.float()  # [N, P, D]
        # Per-page rescaling keeps Z Z^T in range on long repetitive text; it cancels in the trace normalisation.
        z = z / z.abs().amax(dim=(1, 2), keepdim=True).clamp_min(1e-20)
        out = z @ z.transpose(1, 2)  # [N, P, P]
        gram = x @ x.transpose(1, 2)
        tr_key = _trace(x.pow(2).sum(-1))  # [N, 1]
        tr_out = (out * gram).sum(dim=(1, 2)).clamp_min(1e-30)[:, None]
        weight = eta / tr_out[..., None] * out
        weight.diagonal(dim1=1, dim2=2).add_((1.0 - eta) / tr_key)
        metric = x.transpose(1, 2) @ weight @ x  # [N, D, D]
        basis = dominant_eigenvectors(metric, r)  # [N, D, r]
    elif r <= page_size < dim:
        top = dominant_eigenvectors(x @ x.transpose(1, 2), r)  # [N, P, r]
        # X^T u_i = sqrt(lambda_i) v_i: the orthonormal basis rescales to unit columns and stays orthonormal even
        # where lambda_i ~ 0 (such a direction holds no key energy, so its coordinates X v are ~0 whatever v is).
        basis = orthonormal_basis(x.transpose(1, 2) @ top)  # [N, D, r]
    else:
        basis = dominant_eigenvectors(x.transpose(1, 2) @ x, r)  # [N, D, r]
    coords = x @ basis  # [N, P, r]
    return mean, basis.transpose(1, 2).contiguous(), coords.transpose(1, 2).contiguous()


def output_metric_sqrt(o_proj, q_heads: int, kv_heads: int, head_dim: int, device) -> torch.Tensor:
    """G^{1/2} [Hkv, D, D] of one layer: G_h = sum over KV head h's query heads g of W_O,g^T W_O,g.

    o_proj: the layer's output projection as a callable x [n, Hq * D] -> [n, hidden] (any weight format: it is
    applied to the identity, so W_O^T comes out whatever the projection stores). G^{1/2} by eigh (G is PSD).
    """
    eye = torch.eye(q_heads * head_dim, device=device)
    w_t = (o_proj(eye) - o_proj(torch.zeros_like(eye[:1]))).float()  # [Hq*D, hidden] = W_O^T (bias removed)
    per_head = w_t.view(q_heads, head_dim, -1)  # [Hq, D, hidden]
    g = (per_head @ per_head.transpose(1, 2)).view(kv_heads, q_heads // kv_heads, head_dim, head_dim).sum(1)
    values, vectors = torch.linalg.eigh(g.double())
    return ((vectors * values.clamp_min(0).sqrt()[:, None, :]) @ vectors.transpose(1, 2)).float()


def _trace(x: torch.Tensor) -> torch.Tensor:
    # A page of identical keys (or constant values) has trace 0; clamp so it yields a zero matrix, not NaN.
    return x.sum(dim=-1, keepdim=True).clamp_min(1e-12)


def stack_output_metric(per_layer, geometry, device) -> torch.Tensor:
    """[paged layers, Hkv, D, D] fp32 from one output_metric_sqrt per paged layer; ValueError on other shapes."""
    metric, g = torch.stack([m.float() for m in per_layer]).to(device), geometry
    if metric.shape != (g.paged_layers, g.kv_heads, g.head_dim, g.head_dim):
        raise ValueError(f"output metric of shape {tuple(metric.shape)}; expected [kv_heads, head_dim, head_dim] = "
                         f"[{g.kv_heads}, {g.head_dim}, {g.head_dim}] for each of {g.paged_layers} paged layers")
    return metric


class PageSealer:
    """Builds the records of full pages with one eta (the pool's, unless a call names another): the default of
    PagePool.sealer, the hook a caller replaces to seal other pages otherwise (eval seals each row's pages with
    that row's eta)."""

    def __init__(self, eta: float) -> None:
        self.eta = float(eta)

    def __call__(self, pool, pages, eta: float | None = None, kinds=None) -> None:
        seal_pages(pool, pages, self.eta if eta is None else float(eta), kinds)


@torch.no_grad()
def seal_pages(pool, pages, eta: float, kinds=None) -> None:
    """Build pool.summaries for the full physical `pages`, every layer and KV head at once, pool.seal_chunk pages a
    batch (bounded transient memory). kinds: which of the pool's summaries to build (None: all)."""
    g = pool.geometry
    chunk = pool.seal_chunk
    quest = "kmin" in pool.summaries and (kinds is None or "quest" in kinds)
    oval = "basis" in pool.summaries and (kinds is None or "oval" in kinds)
    for i in range(0, len(pages), chunk):
        idx = torch.tensor(pages[i : i + chunk], dtype=torch.long, device=pool.device)
        # [layers, n, kv_heads, P, D]; int8: the staged full-precision keys (kv/int8.py), never the codes' round trip
        keys = pool.k.index_select(1, idx) if pool.int8 is None else pool.int8.seal_keys(pool.k, pages[i : i + chunk], idx)
        flat = keys.reshape(-1, g.page_size, g.head_dim)
        lead = keys.shape[:3]
        if quest:
            kmin, kmax = quest_summary(flat)
            pool.summaries["kmin"].index_copy_(1, idx, kmin.view(*lead, g.head_dim))
            pool.summaries["kmax"].index_copy_(1, idx, kmax.view(*lead, g.head_dim))
        if oval:
            values = (pool.v.index_select(1, idx) if pool.int8 is None else pool.int8.values(pool.v, idx)).reshape(
                -1, g.page_size, g.head_dim)
            metric = None
            if eta > 0:
                if pool.output_metric is None:
                    raise ValueError("eta > 0 needs the output projection's metric: call "
                                     "PagePool.set_output_metric first, or use eta=0 (the key-only record)")
                metric = pool.output_metric[:, None].expand(*lead, g.head_dim, g.head_dim).reshape(
                    -1, g.head_dim, g.head_dim)  # [L*n*Hkv, D, D]
            mean, basis_t, coords_t = oval_summary(flat, values, g.rank, eta, metric)
            head_major = (lead[0], lead[1], lead[2])  # [L, n, Hkv] -> stored [L, Hkv, n, ...]
            stored = page_record.encode(mean.view(*head_major, g.head_dim).transpose(1, 2),
                                        basis_t.view(*head_major, g.rank, g.head_dim).transpose(1, 2),
                                        coords_t.view(*head_major, g.rank, g.page_size).transpose(1, 2),
                                        g.record, keys.dtype)
            page_record.store(pool.summaries, idx, stored)


@torch.no_grad()
def seal_cost(pool, repeats: int = 3) -> dict[str, float]:
    """Milliseconds sealing costs on the pool's device, the median of `repeats` timed runs after one untimed: 'page'
    = one page's oval records (every paged layer and KV head; a seal batch timed, divided by its pages) and, with
    two-level scoring, 'group' = one group's coarse records. Timed on random keys of the pool's shapes, so the
    pool itself is untouched (the startup report shows it: a seal runs between decode steps)."""
    g, device = pool.geometry, pool.device
    if not g.paged_layers or "oval" not in g.summary_kinds:
        return {}
    n = pool.seal_chunk
    rows = g.paged_layers * n * g.kv_heads
    keys = torch.randn(rows, g.page_size, g.head_dim, device=device)
    metric = torch.eye(g.head_dim, device=device).expand(rows, g.head_dim, g.head_dim) if pool.eta > 0 else None
    work = {"page": (lambda: oval_summary(keys, keys, g.rank, pool.eta, metric), n)}
    if g.group_pages:
        grouped = torch.randn(g.paged_layers * g.kv_heads, g.group_pages * g.page_size, g.head_dim, device=device)
        work["group"] = (lambda: group_record(grouped, g.rank), 1)
    out = {}
    for name, (run, per) in work.items():
        times = []
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first run warms caches and allocators
                times.append((time.perf_counter() - began) * 1e3 / per)
        out[name] = statistics.median(times)
    return out
