"""What `oval-edge calibrate` learns from: the model's own dense attention over a calibration text.

The text is prefilled densely through the runtime (PagedLlama over a PagePool), its window hook
recording every layer's normed hidden state x (what the window module reads at decode time).
Then, per sparse layer, the queries of the sample positions are rebuilt from x (same projections and RoPE as the
runtime) and attend, densely, over the cached post-RoPE keys. From each sample's attention (the mean over the
query heads of a KV head, since the window is chosen per KV head) the module's target is kept:

    window target  the smallest recent window [t - W + 1, t] that holds `share` of the attention mass that the
                   largest window (`reach` tokens) would hold, sink pages left out (they are always attended).
                   Mass further back is the page selection's job; what the window decides is how much of the
                   reachable recent span this head needs, from a few tokens (a local head) to all of it

(calibrate_scorer reuses `log_attention` on a subsample to score the page scorers by their attention output.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from oval_edge.config import OvalConfig
from oval_edge.kv.pool import PagePool
from oval_edge.runtime.engine.forward.paged_llama import PagedLlama

from oval_edge.tools.eval.runtime import capture_kv, geometry_for, prefill


@dataclass
class Capture:
    """A prefilled calibration text: positions 0..N-1."""

    ids: list[int]
    hidden: torch.Tensor  # [L, N, H] normed hidden state entering each layer's attention (float32)
    keys: torch.Tensor  # [L, N, Hkv, D] post-RoPE keys
    values: torch.Tensor  # [L, N, Hkv, D]
    runner: PagedLlama  # its projections and rotary embedding rebuild the queries
    dtype: torch.dtype  # the activations' dtype


def capture(loaded, ids: list[int], page_size: int, chunk: int = 512) -> Capture:
    """Dense chunked prefill of `ids`, recording each layer's normed hidden state through the runtime's
    window hook (it sees exactly what the window module will see at decode time)."""
    model = loaded.model
    geometry = geometry_for(model.config, page_size, 4, kinds=("quest",))  # scratch pool: cheap summaries
    pool = PagePool(geometry, -(-len(ids) // page_size), loaded.device)
    runner = PagedLlama(model, pool, OvalConfig(page_size=page_size, kv_dtype="float32"), attention="dense")
    seen: list[list[torch.Tensor]] = [[] for _ in runner.layers]

    def record(layer: int, x: torch.Tensor, _step) -> None:
        seen[layer].append(x.detach().float().cpu())  # [n, H] of this chunk
        return None  # no window: prefill is dense

    runner.hooks.observe = record
    pool.allocate("calibration", len(ids))
    prefill(runner, "calibration", ids, chunk)
    keys, values = capture_kv(pool, "calibration", len(ids))
    hidden = torch.stack([torch.cat(parts) for parts in seen])
    return Capture(list(ids), hidden, keys.float().cpu(), values.float().cpu(), runner, loaded.dtype)


def layer_queries(cap: Capture, layer: int, positions: torch.Tensor) -> torch.Tensor:
    """Post-RoPE queries [S, Hq, D] of one layer at `positions` [S], from its recorded normed hidden state through
    the runtime's own query path (projection, per-head norm where the family has one, RoPE unless a NoPE layer)."""
    runner = cap.runner
    dev = runner.pool.device
    x = cap.hidden[layer, positions].to(dev, cap.dtype)
    cos, sin = runner.rotary(x, positions.to(dev))  # [S, 1, D]
    q, _, _ = runner.qkv(runner.ops[layer], x, x.shape[0], cos, sin)
    return q.float().cpu()


@torch.no_grad()
def window_targets(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, config: OvalConfig,
                   share: float, reach: int, scale: float, chunk: int = 256) -> torch.Tensor:
    """Window targets [S, Hkv] in tokens for one layer.

    queries [S, Hq, D] at absolute `positions` [S]; keys [N, Hkv, D] (positions 0..N-1). The attention of a KV
    head is the mean over its group of query heads (one window serves the group).
    """
    n, kv_heads, _ = keys.shape
    sink = config.sink_pages * config.page_size
    distance = torch.arange(reach)
    targets = []
    for first in range(0, queries.shape[0], chunk):
        q = queries[first : first + chunk]
        t = positions[first : first + chunk]  # [c]
        logits = log_attention(q, keys, t, scale)  # [c, Hkv, G, N]
        # Recent-first mass over the reachable span: local[c, h, d] = group-mean probability at position t - d.
        index = t[:, None] - distance[None, :]  # [c, R]
        usable = (index >= sink).float()  # sink positions need no window; d > t does not exist
        picked = logits.gather(3, index.clamp_min(0)[:, None, None, :].expand(-1, kv_heads, logits.shape[2], -1))
        local = picked.exp().mean(2) * usable[:, None, :]  # [c, Hkv, R]
        cumulative = local.cumsum(-1)
        targets.append((cumulative < share * cumulative[..., -1:]).sum(-1) + 1)  # [c, Hkv]
    return torch.cat(targets)


def log_attention(q: torch.Tensor, keys: torch.Tensor, t: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal log-probabilities: q [c, Hq, D] at positions t [c]; keys [N, Hkv, D] -> [c, Hkv, G, N]."""
    n, kv_heads, d = keys.shape
    grouped = q.view(q.shape[0], kv_heads, -1, d)  # [c, Hkv, G, D]: query head i reads KV head i // G
    logits = scale * torch.einsum("chgd,nhd->chgn", grouped, keys)
    logits.masked_fill_(torch.arange(n)[None, None, None, :] > t[:, None, None, None], float("-inf"))
    return logits - logits.logsumexp(-1, keepdim=True)


def collect(cap: Capture, positions: torch.Tensor, config: OvalConfig, share: float, reach: int,
            show_progress: bool = True):
    """Yield (layer, queries [S, Hq, D], window targets [S, Hkv]) for every sparse layer (>= dense_layers)."""
    runner = cap.runner
    layers = range(config.dense_layers, len(runner.layers))
    for layer in tqdm(layers, desc="dense attention statistics", unit="layer", disable=not show_progress,
                      leave=False):
        q = layer_queries(cap, layer, positions)
        yield layer, q, window_targets(q, cap.keys[layer], positions, config, share, reach, runner.scale)
