"""Page summaries built once when a page is sealed (DESIGN §4.3), batched over pages x heads x layers.

Inputs are flattened: N = layers * pages * kv_heads independent pages, each with P tokens of head dim D.
"""

from __future__ import annotations

import torch


def quest_summary(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel key min and max of each page: keys [N, P, D] -> (kmin [N, D], kmax [N, D])."""
    return keys.amin(dim=1), keys.amax(dim=1)


def oval_summary(keys: torch.Tensor, values: torch.Tensor, rank: int, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output-aware local basis of each page.

    keys, values [N, P, D] (post-RoPE keys). Returns U [N, D, r] (top-r eigenvectors of the mixed second-moment
    matrix M) and C = K U [N, P, r], so that K q ~= C (U^T q) for queries q: scoring reads P*r + D*r numbers
    per page instead of P*D.

    A = K^T K / tr(K^T K) is where the keys spread; B = K^T diag(w) K / tr(.) weights each token by
    w_j = ||v_j - mean(v)||^2, how far its value would move the attention output. M = (1-eta) A + eta B.
    Both are K^T diag(d) K, so M = X^T X with X = diag(sqrt(d)) K [P, D], d_j = (1-eta)/tr(A) + eta w_j/tr(B).
    When P < D the eigenproblem is solved on the P x P Gram X X^T (same nonzero spectrum; ~3x cheaper at
    P=32, D=64, which matters because a page seal stalls a decode step).
    """
    k = keys.float()
    norms = k.pow(2).sum(dim=-1)  # [N, P]: ||k_j||^2, so tr(K^T diag(x) K) = sum_j x_j ||k_j||^2
    d = 1.0 / _trace(norms)
    if eta > 0:
        v = values.float()
        w = (v - v.mean(dim=1, keepdim=True)).pow(2).sum(dim=-1)  # [N, P]
        d = (1.0 - eta) * d + eta * w / _trace(w * norms)
    else:
        d = d.expand_as(norms)
    x = k * d.sqrt()[..., None]  # [N, P, D]
    page_size, dim = k.shape[1], k.shape[2]
    if rank <= page_size < dim:
        # eigh returns ascending eigenvalues; the last r columns span the dominant directions.
        _, left = torch.linalg.eigh(x @ x.transpose(1, 2))  # [N, P, P]
        top = left[..., -rank:].flip(-1)  # [N, P, r]
        # X^T u_i = sqrt(lambda_i) v_i: QR rescales to unit columns and stays orthonormal even where lambda_i ~ 0
        # (such a direction holds no key energy, so its coordinates K v are ~0 whatever v is).
        basis = torch.linalg.qr(x.transpose(1, 2) @ top).Q  # [N, D, r]
    else:
        _, vectors = torch.linalg.eigh(x.transpose(1, 2) @ x)  # [N, D, D]
        basis = vectors[..., -rank:].flip(-1).contiguous()  # [N, D, r]
    coords = k @ basis  # [N, P, r]
    return basis.to(keys.dtype), coords.to(keys.dtype)


def _trace(x: torch.Tensor) -> torch.Tensor:
    # A page of identical keys (or constant values) has trace 0; clamp so it yields a zero matrix, not NaN.
    return x.sum(dim=-1, keepdim=True).clamp_min(1e-12)


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
        keys = pool.k.index_select(1, idx)  # [layers, n, kv_heads, P, D]
        flat = keys.reshape(-1, g.page_size, g.head_dim)
        lead = keys.shape[:3]
        if quest:
            kmin, kmax = quest_summary(flat)
            pool.summaries["kmin"].index_copy_(1, idx, kmin.view(*lead, g.head_dim))
            pool.summaries["kmax"].index_copy_(1, idx, kmax.view(*lead, g.head_dim))
        if oval:
            values = pool.v.index_select(1, idx).reshape(-1, g.page_size, g.head_dim)
            basis, coords = oval_summary(flat, values, g.rank, eta)
            basis_t = basis.transpose(1, 2).reshape(*lead, g.rank, g.head_dim).transpose(1, 2)  # [L, Hkv, n, r, D]
            coords_t = coords.transpose(1, 2).reshape(*lead, g.rank, g.page_size).transpose(1, 2)  # [L, Hkv, n, r, P]
            pool.summaries["basis"].index_copy_(2, idx, basis_t)
            pool.summaries["coords"].index_copy_(2, idx, coords_t)
