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
    """
    k = keys.float()
    v = values.float()
    gram = k.transpose(1, 2) @ k  # [N, D, D]
    mix = gram / _trace(gram)
    if eta > 0:
        w = (v - v.mean(dim=1, keepdim=True)).pow(2).sum(dim=-1)  # [N, P]
        weighted = k.transpose(1, 2) @ (k * w.unsqueeze(-1))  # [N, D, D]
        mix = (1.0 - eta) * mix + eta * weighted / _trace(weighted)
    # eigh returns ascending eigenvalues; the last r columns span the dominant directions.
    _, vectors = torch.linalg.eigh(mix)
    basis = vectors[..., -rank:].flip(-1).contiguous()  # [N, D, r]
    coords = k @ basis  # [N, P, r]
    return basis.to(keys.dtype), coords.to(keys.dtype)


def _trace(m: torch.Tensor) -> torch.Tensor:
    # A page of identical keys (or constant values) has trace 0; clamp so it yields a zero matrix, not NaN.
    return m.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(1e-12)[:, None, None]
