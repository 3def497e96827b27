"""The Llama-family decoder forward written against the page pool (Llama, SmolLM2, Mistral, Qwen2, Qwen3, SmolLM3).

It uses the loaded model's modules (runtime/model/decoder.py, or a transformers model of the same layout) only as
weight holders (projections, norms, MLP, rotary frequencies) and owns the attention: keys are rotated at their
absolute positions and cached after RoPE, prefill is dense and writes pages, decode runs OVAL selection (or dense
attention when asked).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from oval_edge.config import OvalConfig
from oval_edge.geometry import head_dim_of
from oval_edge.kv.pool import PagePool
from oval_edge.kv.step_index import StepIndex
from oval_edge.runtime.model.projections import bind_norm, bind_projection
from oval_edge.sparse.attention import decode_attention
from oval_edge.sparse.reuse import SelectionReuse
from oval_edge.sparse.selection import DecodePlan, Selection

from .step_rows import DecodeRows, PrefillRows, StepStats

ATTENTION_MODES = ("oval", "dense")
MLP_ROW_BLOCK = 128  # prefill rows per MLP call: 128 x 2 x 1536 fp32 = 1.5 MB for SmolLM2 instead of 6 MB
# (layer, q [B, Hq, D], step) -> page scores [B, Hkv, Np], or None for the config's scorer; called in sparse decode
# layers (the eval's oracle scorer, tests that record the queries).
ScoreOverride = Callable[[int, torch.Tensor, StepIndex], "torch.Tensor | None"]
# (layer, normed hidden state x [N, hidden], step) -> window lengths [B, Hkv] or None; called for every layer of
# every step (prefill too, where the result is unused): the output-aware window module (oval_edge/sparse/window_module).
WindowOverride = Callable[[int, torch.Tensor, StepIndex], "torch.Tensor | None"]
# (layer, step, q [B, Hq, D], plan, window [B, Hkv] | None, dense) -> (out [B, Hq, D], Selection), or None for the
# default decode attention; called in every decode layer without override scores. `dense` is what the forward's own
# config says for the layer. Selection reuse and the eval's per-row policies decide whole layers this way.
LayerOverride = Callable[[int, StepIndex, torch.Tensor, DecodePlan, "torch.Tensor | None", bool],
                         "tuple[torch.Tensor, Selection] | None"]


@dataclass
class DecodeHooks:
    """The paged forward's public extension points, one per decision a layer makes (all optional)."""

    scores: ScoreOverride | None = None  # which pages a sparse layer reads
    window: WindowOverride | None = None  # how long each KV head's local window is
    layer: LayerOverride | None = None  # the layer's whole decode attention

    def empty(self) -> bool:
        """No hook installed: the static decode step (static_step.py) computes what the eager forward would."""
        return self.scores is None and self.window is None and self.layer is None


class PagedLlama:
    def __init__(self, model: torch.nn.Module, pool: PagePool, config: OvalConfig, attention: str = "oval",
                 context: int | None = None):
        """model: a decoder in transformers' module layout (runtime.model.decoder.DecoderModel, or a transformers
        Llama-family *ForCausalLM, whose unfused projections are called one by one). context: the most tokens one
        sequence may reach (the engine's token limit; default the pool's capacity, capped by the model's
        max_position_embeddings); a LongRoPE model picks its one factor set by it (RotaryEmbedding.for_context)."""
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention={attention!r} is unknown; allowed: {', '.join(ATTENTION_MODES)}")
        cfg = model.config
        self.model = model
        self.decoder = model.model
        self.layers = list(model.model.layers)
        self.pool = pool
        self.config = config
        self.attention = attention
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.scale = self.head_dim**-0.5
        self.qkv_split = (self.num_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.hooks = DecodeHooks()
        # Selection reuse (DESIGN §4.7, oval_edge/sparse/reuse.py); None unless config.reuse_tau is set.
        self.reuse = SelectionReuse.for_model(config, len(self.layers), self.num_heads, self.kv_heads,
                                              self.head_dim, pool.device)
        if self.reuse is not None:
            self.hooks.layer = self._reuse_layer
        self.last_selections: list[Selection | None] = []
        self.ops = [LayerOps.bind(layer, self.num_heads, self.kv_heads) for layer in self.layers]
        self.final_norm = bind_norm(self.decoder.norm)
        if context is None:
            context = min(pool.capacity_tokens, cfg.max_position_embeddings)
        rotary = self.decoder.rotary_emb
        self.rotary_emb = rotary.for_context(context) if hasattr(rotary, "for_context") else rotary

    @torch.inference_mode()
    def forward(self, step: StepIndex, input_ids: torch.Tensor, decode: bool, collect: bool = False):
        """Run every layer for this step's new tokens and return the logits of each row's last token.

        input_ids [N] (rows concatenated as in `step`). decode=True requires one new token per row.
        Returns (logits [B, vocab] float32, StepStats). The caller commits the step to the pool afterwards.
        """
        rows = DecodeRows(self, step, input_ids, collect) if decode else PrefillRows(self, step, input_ids)
        (logits,) = self.forward_rows([rows])
        if not decode:
            return logits, StepStats()
        self.last_selections = rows.selections
        return logits, rows.stats()

    @torch.inference_mode()
    def forward_rows(self, groups: list) -> list[torch.Tensor]:
        """One forward over several row groups (step_rows.py): decode rows and prefill chunks in one pass.

        Each group has ids [n] and positions [n] of its new tokens, `attend(layer, x, q, k, v)` for its slice of
        them and `output_rows` (its tokens whose logits it needs). Returns each group's logits [rows, vocab] fp32.
        The caller commits the pool's lengths afterwards.
        """
        ids = torch.cat([g.ids for g in groups]) if len(groups) > 1 else groups[0].ids
        positions = torch.cat([g.positions for g in groups]) if len(groups) > 1 else groups[0].positions
        hidden = self.decoder.embed_tokens(ids)  # [N, hidden]
        cos, sin = self.rotary(hidden, positions)
        starts = [0, *itertools.accumulate(g.ids.shape[0] for g in groups)]  # host ints: shapes, no sync
        if len(groups) == 1:
            attention = groups[0].attend
        else:
            spans = list(zip(groups, starts[:-1], starts[1:]))

            def attention(index, x, q, k, v):  # each group attends over its own slice of the step's tokens
                return torch.cat([g.attend(index, x[a:b], q[a:b], k[a:b], v[a:b]) for g, a, b in spans])

        hidden = self.run_layers(hidden, cos, sin, attention)
        picked = torch.cat([g.output_rows + start for g, start in zip(groups, starts)]) if len(groups) > 1 \
            else groups[0].output_rows
        logits = self.model.lm_head(self.final_norm(hidden[picked])).float()
        return list(logits.split([g.output_rows.shape[0] for g in groups]))

    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention) -> torch.Tensor:
        """The decoder layers over hidden [N, hidden] with cos, sin [N, 1, D]; attention(layer, x, q, k, v) -> out
        [N, Hq, D] writes the layer's new K/V and attends (x is the normed input, for the window hook)."""
        n = hidden.shape[0]
        for index, ops in enumerate(self.ops):
            x = ops.input_norm(hidden)
            q, k, v = self.qkv(ops, x, n, cos, sin)
            out = attention(index, x, q, k, v)
            hidden = hidden + ops.o_proj(out.reshape(n, self.num_heads * self.head_dim))
            hidden = hidden + ops.mlp(ops.post_norm(hidden))
        return hidden

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [N, 1, R] for the step's positions [N] (hidden [N, hidden] gives the dtype); R is the
        rotary dims of a head, D unless the model rotates only part of it."""
        cos, sin = self.rotary_emb(hidden[None], positions[None])  # [1, N, rotary_dim] each
        # [N, 1, D] broadcast over heads; the sign folded in once per step, so each layer's RoPE is three ops
        return cos[0, :, None, :], _signed_sin(sin[0, :, None, :])

    def qkv(self, ops: "LayerOps", x: torch.Tensor, n: int, cos: torch.Tensor, sin: torch.Tensor):
        """q [n, Hq, D] and k [n, Hkv, D] rotated at their positions, v [n, Hkv, D].

        cos, sin [n, 1, D]. With fused q/k/v the query and key heads sit side by side in one output row, so they
        are rotated together: one RoPE over Hq + Hkv heads instead of two.
        """
        hq, hkv, d = self.num_heads, self.kv_heads, self.head_dim
        if ops.qkv is not None:
            qkv = ops.qkv(x)  # [n, (Hq + 2 Hkv) * D]
            qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
            if ops.qk_norm is not None:
                qk = ops.qk_norm.both(qk)
            if ops.rope:
                qk = _rotate(qk, cos, sin)
            return qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        q, k = ops.q(x).view(n, hq, d), ops.k(x).view(n, hkv, d)
        if ops.qk_norm is not None:
            q, k = ops.qk_norm.q(q), ops.qk_norm.k(k)
        if ops.rope:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return q, k, ops.v(x).view(n, hkv, d)

    def decode_layer(self, index: int, step: StepIndex, q: torch.Tensor, plan: DecodePlan,
                     window: torch.Tensor | None = None) -> tuple[torch.Tensor, Selection]:
        """One layer's attention of a decode step: q [B, Hq, D] (rotated) -> (out [B, Hq, D], the selection read).

        Override scores come first, then the layer override, then the config's own decode attention.
        """
        dense = self.attention == "dense" or index < self.config.dense_layers
        hooks = self.hooks
        scores = hooks.scores(index, q, step) if hooks.scores is not None and not dense else None
        if scores is None and hooks.layer is not None:
            decided = hooks.layer(index, step, q, plan, window, dense)
            if decided is not None:
                return decided
        return decode_attention(self.pool, index, step, q, self.config, self.scale, dense=dense, scores=scores,
                                plan=plan, window=window)

    def _reuse_layer(self, index: int, step: StepIndex, q: torch.Tensor, plan: DecodePlan,
                     window: torch.Tensor | None, dense: bool):
        """hooks.layer when reuse is on: a sparse layer reuses a recent selection where its queries barely moved."""
        if dense:
            return None
        return self.reuse.decode(self.pool, index, step, q, plan, self.config, self.scale, window)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [.., D] -> [-sin[:D/2], sin[D/2:]]: folds rotate_half's negation into the table (see _rope)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in transformers' rotate_half convention: x [n, H, D]; cos, signed_sin [n, 1, D].

    x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1] equals x*cos + [x2, x1] * [-sin1, sin2]; [x2, x1]
    is x rolled by D/2. Three ops per call instead of seven: RoPE runs twice per layer per step.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE over the first R = cos.shape[-1] dims of each head of x [n, H, D], the rest passed through (Phi-4-mini:
    R = 3/4 D, as transformers' apply_rotary_pos_emb). R == D, every other model, is the single fused _rope."""
    rotary = cos.shape[-1]  # a shape: static, no sync
    if rotary == x.shape[-1]:
        return _rope(x, cos, signed_sin)
    return torch.cat((_rope(x[..., :rotary], cos, signed_sin), x[..., rotary:]), dim=-1)


@dataclass
class HeadNorms:
    """Qwen3's RMSNorm over each query and key head (before RoPE), bound once per layer.

    `both` normalizes the fused q|k heads [n, Hq + Hkv, D] in one op with the two weights stacked per head
    ([Hq + Hkv, D]): the same arithmetic as the two modules (normalize in fp32, then scale), half the calls.
    """

    weights: torch.Tensor  # [Hq + Hkv, D]
    eps: float
    q_norm: torch.nn.Module
    k_norm: torch.nn.Module

    @classmethod
    def bind(cls, attn: torch.nn.Module, heads: int, kv_heads: int) -> "HeadNorms | None":
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is None or k_norm is None:
            return None
        weights = torch.cat([q_norm.weight.expand(heads, -1), k_norm.weight.expand(kv_heads, -1)])
        return cls(weights, float(getattr(q_norm, "variance_epsilon", getattr(q_norm, "eps", 1e-6))), q_norm, k_norm)

    def both(self, qk: torch.Tensor) -> torch.Tensor:
        normed = torch.nn.functional.rms_norm(qk.float(), (qk.shape[-1],), None, self.eps).to(qk.dtype)
        return normed * self.weights

    def q(self, q: torch.Tensor) -> torch.Tensor:
        return self.q_norm(q)

    def k(self, k: torch.Tensor) -> torch.Tensor:
        return self.k_norm(k)


@dataclass
class LayerOps:
    """One decoder layer's weights bound for the runtime's forward (runtime/model/projections.py): the 4-bit projections
    straight to their kernel, the norms to one fused op. The modules stay the owners of the weights."""

    input_norm: Callable
    post_norm: Callable
    qkv: Callable | None  # fused q/k/v (the loader fuses 4-bit layers); else q, k, v separately
    q: Callable | None
    k: Callable | None
    v: Callable | None
    o_proj: Callable
    gate_up: Callable | None
    mlp_module: torch.nn.Module
    down: Callable
    act: Callable
    qk_norm: HeadNorms | None = None  # Qwen3
    rope: bool = True  # False in a NoPE layer (SmolLM3): q and k are used, and k cached, unrotated

    @classmethod
    def bind(cls, layer: torch.nn.Module, heads: int, kv_heads: int) -> "LayerOps":
        attn, mlp = layer.self_attn, layer.mlp
        fused = getattr(attn, "qkv_proj", None)
        gate_up = getattr(mlp, "gate_up_proj", None)
        return cls(
            input_norm=bind_norm(layer.input_layernorm), post_norm=bind_norm(layer.post_attention_layernorm),
            qkv=bind_projection(fused) if fused is not None else None,
            q=None if fused is not None else bind_projection(attn.q_proj),
            k=None if fused is not None else bind_projection(attn.k_proj),
            v=None if fused is not None else bind_projection(attn.v_proj),
            o_proj=bind_projection(attn.o_proj),
            gate_up=bind_projection(gate_up) if gate_up is not None else None,
            mlp_module=mlp, down=bind_projection(mlp.down_proj), act=mlp.act_fn,
            qk_norm=HeadNorms.bind(attn, heads, kv_heads), rope=bool(getattr(attn, "use_rope", True)),
        )

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > MLP_ROW_BLOCK:  # prefill chunks: bound the [rows, 2 x intermediate] fp32 transients
            return torch.cat([self.mlp(x[i : i + MLP_ROW_BLOCK]) for i in range(0, x.shape[0], MLP_ROW_BLOCK)])
        if self.gate_up is None:
            return self.mlp_module(x)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [n, intermediate] each
        return self.down(self.act(gate) * up)
