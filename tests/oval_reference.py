"""Plain-PyTorch references for the OVAL core tests, written with explicit loops over pages and heads.

Everything here is float64 and deliberately naive: one page, one head, one query at a time, so it shares no code
path (batching, flattening, einsum layouts, masks) with `oval_edge`. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import math

import torch

from oval_edge import KVGeometry, PagePool


def structured_kv(gen: torch.Generator, layers: int, heads: int, length: int, dim: int):
    """Keys and values [layers, heads, length, dim] (float32).

    Keys spread mostly along 4 dominant directions of a random basis per (layer, head), as real post-RoPE keys
    do along a few. An fp32 eigensolver's subspace error grows like eps / (lambda_r - lambda_{r+1}); the clear
    gap after the 4th eigenvalue keeps the pool's rank-4 projector within ~1e-6 of this fp64 reference.
    """
    spectrum = torch.tensor([4.0, 3.5, 3.0, 2.5] + [0.15] * (dim - 4), dtype=torch.float64)
    basis, _ = torch.linalg.qr(torch.randn(layers, heads, dim, dim, generator=gen, dtype=torch.float64))
    z = torch.randn(layers, heads, length, dim, generator=gen, dtype=torch.float64)
    keys = (z * spectrum) @ basis.transpose(-1, -2)
    values = torch.randn(layers, heads, length, dim, generator=gen, dtype=torch.float64)
    return keys.float(), values.float()


def output_metric(layers: int, heads: int, dim: int, seed: int = 5) -> torch.Tensor:
    """A stand-in for the output projection's G^{1/2} [layers, heads, D, D]: symmetric positive definite, far from
    the identity (so eta > 0 really reweights the tokens), fixed by `seed`."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(layers, heads, dim, dim, generator=gen, dtype=torch.float64)
    return (a @ a.transpose(-1, -2) / dim + 0.1 * torch.eye(dim, dtype=torch.float64)).float()


def make_pool(layers, kv_heads, head_dim, page_size, num_pages, rank=4, eta=0.5, record="float") -> PagePool:
    geometry = KVGeometry(layers, kv_heads, head_dim, page_size, "float32", ("oval", "quest"), rank, record)
    pool = PagePool(geometry, num_pages, eta=eta)
    pool.set_output_metric(list(output_metric(layers, kv_heads, head_dim)))
    return pool


def write_tokens(pool: PagePool, seq_ids, keys, values, counts):
    """One forward step: append counts[b] tokens of each sequence (next positions) in every layer at once.

    keys/values: per sequence [layers, heads, L, D]. Returns the StepIndex (not committed).
    """
    for sid, n in zip(seq_ids, counts):
        assert pool.grow(sid, pool.length(sid) + n)
    step = pool.prepare(seq_ids, counts)
    for layer in range(pool.geometry.layers):
        ks, vs = [], []
        for sid, k, v, n in zip(seq_ids, keys, values, counts):
            start = pool.length(sid)
            ks.append(k[layer, :, start : start + n].transpose(0, 1))  # [n, heads, D]
            vs.append(v[layer, :, start : start + n].transpose(0, 1))
        pool.write(layer, step, torch.cat(ks), torch.cat(vs))
    return step


def prefill(pool: PagePool, seq_ids, keys, values, lengths, chunk: int) -> None:
    """Allocate each sequence and write its first lengths[b] tokens in batched chunks, committing each step."""
    for sid in seq_ids:
        assert pool.allocate(sid, 1) is not None
    while True:
        counts = [min(chunk, n - pool.length(sid)) for sid, n in zip(seq_ids, lengths)]
        if not any(counts):
            return
        pool.commit(write_tokens(pool, seq_ids, keys, values, counts))


# ---- summaries and scores ([R-page-score]), one page and one head at a time -----------------------------------------
def ref_quest_summary(keys_page):
    """keys_page [P, D] -> (min [D], max [D]) by a loop over channels."""
    k = keys_page.double()
    mins = torch.stack([k[:, d].min() for d in range(k.shape[1])])
    maxs = torch.stack([k[:, d].max() for d in range(k.shape[1])])
    return mins, maxs


def ref_oval_summary(keys_page, values_page, rank: int, eta: float, metric_sqrt=None):
    """keys_page, values_page [P, D] -> (mu [D], B [D, r], R [P, r], eigenvalues of trace-normalised M descending).

    The authors' record from its definition: X = K - mu, Y = V - mean(V), Z = Y G^{1/2},
    M = (1 - eta) X^T X / tr(X^T X) + eta X^T Z Z^T X / tr(X^T Z Z^T X), B = top-r eigenvectors of M, R = X B.
    """
    k, v = keys_page.double(), values_page.double()
    mu = torch.stack([k[:, d].mean() for d in range(k.shape[1])])
    x = k - mu
    m = x.T @ x / torch.trace(x.T @ x)
    if eta > 0:
        z = (v - v.mean(0)) @ metric_sqrt.double()
        out = x.T @ z @ z.T @ x
        m = (1 - eta) * m + eta * out / torch.trace(out)
    evals, evecs = torch.linalg.eigh(m)
    order = torch.argsort(evals, descending=True)
    b = evecs[:, order[:rank]]
    return mu, b, x @ b, evals[order]


def ref_page_score(scorer, queries, keys_page, values_page, rank, eta, scale, metric_sqrt=None):
    """Score of one page for one KV head; queries [G, D] are the group's query heads."""
    q = queries.double()
    if scorer == "quest":
        kmin, kmax = ref_quest_summary(keys_page)
        per_head = [scale * torch.maximum(q[g] * kmax, q[g] * kmin).sum() for g in range(q.shape[0])]
        return float(torch.logsumexp(torch.stack(per_head), 0))
    mu, b, r, _ = ref_oval_summary(keys_page, values_page, rank, eta, metric_sqrt)
    logits = [scale * (mu @ q[g] + r[j] @ (b.T @ q[g])) for j in range(r.shape[0]) for g in range(q.shape[0])]
    return float(torch.logsumexp(torch.stack(logits), 0))


# ---- selection and attention ([R-candidates], [R-top-k] to [R-exact-attention]) ------------------------------
def ref_selection(config, page_scores: dict, length: int, sealed: int):
    """Expected (index set, chosen pages, window W, window start) for one row and KV head.

    page_scores: {logical page: reference score} for the sealed pages of the row.
    """
    P, sink = config.page_size, config.sink_pages
    slots = (config.sink_pages + config.top_k) * P + max(config.window_max, P)
    if length <= slots:  # fits the token budget: dense, exact
        return set(range(length)), [], None, 0
    # Entropy is measured over pages that could be candidates for any window length >= window_min.
    early = [j for j in range(sink, sealed) if j * P < length - config.window_min]
    lo, hi = config.window_min, config.window_max
    if lo == hi:
        window = lo
    else:
        probs = torch.softmax(torch.tensor([page_scores[j] for j in early], dtype=torch.float64), 0)
        entropy = -sum(float(p) * math.log(float(p)) for p in probs if p > 0)
        normalised = min(max(entropy / math.log(max(len(early), 2)), 0.0), 1.0)
        window = lo + round(normalised * (hi - lo))
    # The window also reaches back to the first unsealed page: it has no summary and cannot be selected.
    start = min(length - window, sealed * P)
    candidates = [j for j in early if j * P < start]
    ranked = sorted(candidates, key=lambda j: page_scores[j], reverse=True)
    chosen = ranked[: config.top_k]
    index = set(range(min(sink * P, start)))
    for j in chosen:
        index |= set(range(j * P, min(j * P + P, start)))
    index |= set(range(start, length))
    return index, chosen, window, start


def ref_attention(q, keys, values, index_sets, scale):
    """Softmax attention of each query head over an explicit index set of its KV head.

    q [Hq, D]; keys/values [Hkv, L, D]; index_sets: list (per KV head) of position sets -> [Hq, D] float64.
    """
    hq, hkv = q.shape[0], keys.shape[0]
    out = torch.zeros(hq, q.shape[1], dtype=torch.float64)
    for head in range(hq):
        kv_head = head // (hq // hkv)  # GQA: consecutive query heads share a KV head
        idx = sorted(index_sets[kv_head])
        k, v = keys[kv_head, idx].double(), values[kv_head, idx].double()
        logits = torch.stack([scale * (k[j] @ q[head].double()) for j in range(len(idx))])
        out[head] = torch.softmax(logits, 0) @ v
    return out
