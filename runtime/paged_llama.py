"""The Llama-family decoder forward written against the page pool (Llama, SmolLM2, Mistral, Qwen2).

It uses the loaded transformers modules only as weight holders (projections, norms, MLP, rotary frequencies)
and owns the attention: keys are rotated at their absolute positions and cached after RoPE, prefill is dense
and writes pages, decode runs OVAL selection (or dense attention when asked).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from oval_edge.attention import decode_attention, decode_plan, prefill_attention
from oval_edge.config import OvalConfig
from oval_edge.pool import PagePool, StepIndex
from oval_edge.selection import Selection

ATTENTION_MODES = ("oval", "dense")
# (layer, q [B, Hq, D], step) -> page scores [B, Hkv, Np]; lets `eval` plug in the oracle scorer.
ScoreOverride = Callable[[int, torch.Tensor, StepIndex], torch.Tensor]


@dataclass
class StepStats:
    """What one decode step read, summed over layers (for /metrics and the benchmark's KV bytes per step)."""

    kv_tokens_read: int = 0  # gathered K/V slots x KV heads, all layers, all rows
    attended_tokens: int = 0  # valid slots among them
    sparse_layers: int = 0
    windows: list[torch.Tensor] = field(default_factory=list)  # adaptive window lengths of sparse rows
    window_mean: float = 0.0


class PagedLlama:
    def __init__(self, hf_model: torch.nn.Module, pool: PagePool, config: OvalConfig, attention: str = "oval"):
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention={attention!r} is unknown; allowed: {', '.join(ATTENTION_MODES)}")
        cfg = hf_model.config
        self.model = hf_model
        self.decoder = hf_model.model
        self.layers = list(hf_model.model.layers)
        self.pool = pool
        self.config = config
        self.attention = attention
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.qkv_split = (self.num_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.score_override: ScoreOverride | None = None
        self.last_selections: list[Selection | None] = []

    @torch.inference_mode()
    def forward(self, step: StepIndex, input_ids: torch.Tensor, decode: bool, collect: bool = False):
        """Run every layer for this step's new tokens and return the logits of each row's last token.

        input_ids [N] (rows concatenated as in `step`). decode=True requires one new token per row.
        Returns (logits [B, vocab] float32, StepStats). The caller commits the step to the pool afterwards.
        """
        dev = self.pool.device
        hidden = self.decoder.embed_tokens(input_ids.to(dev))  # [N, hidden]
        cos, sin = self.decoder.rotary_emb(hidden[None], step.positions[None])  # [1, N, D] each
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [N, 1, D] broadcast over heads
        n = hidden.shape[0]
        stats = StepStats()
        self.last_selections = []
        plan = decode_plan(self.pool, step, self.config) if decode else None
        attended: list[torch.Tensor] = []  # summed once at the end: no per-layer reduction on the hot path
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q, k, v = self._qkv(attn, x, n)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.pool.write(index, step, k, v)
            if decode:
                out, selection = self._decode_layer(index, step, q, plan)
                stats.kv_tokens_read += selection.valid.numel()
                attended.append(selection.valid)
                if selection.window is not None and plan.config.window_min != plan.config.window_max:
                    stats.windows.append(selection.window[selection.sparse_rows])
                stats.sparse_layers += selection.window is not None and not plan.all_dense
                if collect:
                    self.last_selections.append(selection)
            else:
                out = prefill_attention(self.pool, index, step, q, k, v, self.scale)
            hidden = hidden + attn.o_proj(out.reshape(n, self.num_heads * self.head_dim))
            hidden = hidden + self._mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        if attended:
            stats.attended_tokens = int(torch.stack([v.sum() for v in attended]).sum())  # one device sync
            stats.window_mean = float(torch.cat(stats.windows).float().mean()) if stats.windows else float(
                self.config.window_min)
        last = torch.cumsum(torch.tensor(step.new_tokens, device=dev), 0) - 1  # last token of each row
        hidden = self.decoder.norm(hidden[last])
        return self.model.lm_head(hidden).float(), stats

    def _qkv(self, attn, x: torch.Tensor, n: int):
        """q [n, Hq, D], k and v [n, Hkv, D] from one fused 4-bit matmul when the loader fused them."""
        fused = getattr(attn, "qkv_proj", None)
        if fused is None:
            return (attn.q_proj(x).view(n, self.num_heads, self.head_dim),
                    attn.k_proj(x).view(n, self.kv_heads, self.head_dim),
                    attn.v_proj(x).view(n, self.kv_heads, self.head_dim))
        q, k, v = fused(x).split(self.qkv_split, dim=-1)
        return (q.view(n, self.num_heads, self.head_dim), k.view(n, self.kv_heads, self.head_dim),
                v.view(n, self.kv_heads, self.head_dim))

    @staticmethod
    def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(mlp, "gate_up_proj", None)
        if fused is None:
            return mlp(x)
        gate, up = fused(x).chunk(2, dim=-1)  # [n, intermediate] each
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _decode_layer(self, index: int, step: StepIndex, q: torch.Tensor, plan):
        dense = self.attention == "dense" or index < self.config.dense_layers
        scores = None
        if not dense and self.score_override is not None:
            scores = self.score_override(index, q, step)
        return decode_attention(self.pool, index, step, q, self.config, self.scale, dense=dense, scores=scores,
                                plan=plan)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
