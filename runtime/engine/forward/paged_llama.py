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
from oval_edge.kv.records.summaries import output_metric_sqrt
from oval_edge.sparse.attention import cap_logits

from oval_edge.runtime.model.projections import bind_projection

from .layer_ops import HeadNorms, LayerOps, bind_one_op_norm  # noqa: F401  (HeadNorms: re-exported for the tests)
from .step_rows import PrefillRows, StepStats

ATTENTION_MODES = ("oval", "dense")
# (layer, normed hidden state x [N, hidden], step) -> None: called in every layer of every prefill chunk with the
# layer's attention input (`oval-edge calibrate` records what the window module will read at decode time).
PrefillObserver = Callable[[int, torch.Tensor, StepIndex], None]


@dataclass
class PrefillHooks:
    """The paged forward's public extension point for prefill; decode is the static step's, whose inputs
    (scorer, window, selection callback) are a StepPolicy (step_policy.py)."""

    observe: PrefillObserver | None = None


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
        # Gemma: query_pre_attn_scalar ** -0.5 (DecoderConfig.scaling); a transformers config: head_dim ** -0.5
        self.scale = getattr(cfg, "scaling", self.head_dim**-0.5)
        self.embedding_scale = float(getattr(cfg, "embedding_scale", 1.0))
        self.final_softcap = float(getattr(cfg, "final_softcap", 0.0))
        self.softcap = float(getattr(cfg, "attn_softcap", 0.0))  # Gemma 2: every attention's logits, tanh-capped
        self.qkv_split = (self.num_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.hooks = PrefillHooks()
        sliding = [bool(getattr(cfg, "is_sliding", lambda i: False)(i)) for i in range(len(self.layers))]
        states = [bool(getattr(cfg, "is_state_layer", lambda i: False)(i)) for i in range(len(self.layers))]
        if any(states) and pool.states is None:
            raise ValueError("this model has state layers (linear attention / short conv) but the pool keeps no "
                             "state for them; build the pool's geometry with KVGeometry.for_oval(..., "
                             "states=state_layout(config))")
        if context is None:
            context = min(pool.capacity_tokens, cfg.max_position_embeddings)
        self.context = context
        self._decoder = None  # the static decoder `forward(decode=True)` runs, built on first use
        rotary = self.decoder.rotary_emb  # LongRoPE (Phi-3): the factor set for this engine's context
        self.rotary_emb = rotary.for_context(context) if hasattr(rotary, "for_context") else rotary
        local = getattr(self.decoder, "rotary_emb_local", None)  # Gemma 3: the sliding layers' own rotary table
        self.rotary_modules = [self.rotary_emb] + ([local] if local is not None else [])
        self.ops = [LayerOps.bind(layer, self.num_heads, self.kv_heads, int(local is not None and sliding[i]),
                                  sliding[i], self.head_dim) for i, layer in enumerate(self.layers)]
        # Gemma 4: layers whose K/V later layers read (their step's k, v are kept for those layers' prefill), and
        # the per-layer inputs' projection and norm, bound once
        self.kv_sources = {ops.kv_source for ops in self.ops if ops.kv_source >= 0}
        per_layer = getattr(self.decoder, "per_layer", None)
        self.per_layer = per_layer
        if per_layer is not None:
            self.per_layer_projection = bind_projection(per_layer.projection)
            self.per_layer_norm = bind_one_op_norm(per_layer.norm)
        if any(sliding) and not pool.geometry.ring_layers:
            raise ValueError("this model has sliding-window layers but the pool keeps no ring for them; build the "
                             "pool's geometry with KVGeometry.for_oval(..., ring=ring_layout(config))")
        self.final_norm = bind_one_op_norm(self.decoder.norm)
        if config.eta > 0 and "basis" in pool.summaries and pool.output_metric is None:
            pool.set_output_metric(self.output_metrics())  # records with eta > 0 weigh values by W_O ([R-page-score])

    @torch.no_grad()
    def output_metrics(self) -> list[torch.Tensor]:
        """G^{1/2} [Hkv, D, D] of each paged layer's output projection (summaries.output_metric_sqrt)."""
        dtype = self.decoder.norm.weight.dtype  # the activations' dtype (4-bit weights store uint8)
        project = [lambda x, ops=ops: ops.o_proj(x.to(dtype)).float() for ops in self.ops]
        g = self.pool.geometry  # a layer reading another's K/V (Gemma 4) reads its source's records
        return [output_metric_sqrt(project[i], self.num_heads, self.kv_heads, g.head_dim, self.pool.device)
                for i, row in enumerate(self.pool.paged_index) if row >= 0 and g.kv_source(i) == i]

    @torch.inference_mode()
    def forward(self, step: StepIndex, input_ids: torch.Tensor, decode: bool):
        """Run every layer for this step's new tokens and return the logits of each row's last token.

        input_ids [N] (rows concatenated as in `step`). decode=True requires one new token per row and runs the
        static decode step (static_step.py) of this runner's config over `step.seq_ids`, as the engine does.
        Returns (logits [B, vocab] float32, StepStats). The caller commits the step to the pool afterwards.
        """
        if decode:
            if any(n != 1 for n in step.new_tokens):
                raise ValueError(f"a decode step takes one new token per row, got {step.new_tokens}; prefill "
                                 "chunks go through decode=False")
            logits, stats, _ = self.static_decoder().decode(step.seq_ids, input_ids.tolist())
            return logits, stats
        (logits,) = self.forward_rows([PrefillRows(self, step, input_ids)])
        return logits, StepStats()

    def static_decoder(self, policy=None, rows: int | None = None):
        """A static decoder (static_step.StaticDecoder) over this runner: with `policy` (step_policy.StepPolicy) a
        new one for exactly `rows` rows a step (eval's row groups); without, the runner's own, built once."""
        from .static_step import StaticDecoder

        if policy is not None:
            return StaticDecoder(self, rows or 1, self.context, policy=policy, exact_batches=True)
        if self._decoder is None:
            self._decoder = StaticDecoder(self, 64, self.context, exact_batches=True)
        return self._decoder

    @torch.inference_mode()
    def forward_rows(self, groups: list) -> list[torch.Tensor]:
        """One forward over several row groups (step_rows.py): decode rows and prefill chunks in one pass.

        Each group has ids [n] and positions [n] of its new tokens, `attend(layer, x, q, k, v)` for its slice of
        them and `output_rows` (its tokens whose logits it needs). Returns each group's logits [rows, vocab] fp32.
        The caller commits the pool's lengths afterwards.
        """
        ids = torch.cat([g.ids for g in groups]) if len(groups) > 1 else groups[0].ids
        positions = torch.cat([g.positions for g in groups]) if len(groups) > 1 else groups[0].positions
        hidden = self.embed(ids)  # [N, hidden]
        tables = self.rotary_tables(hidden, positions)
        per_layer = self.per_layer_inputs(ids, hidden)
        starts = [0, *itertools.accumulate(g.ids.shape[0] for g in groups)]  # host ints: shapes, no sync
        if len(groups) == 1:
            attention, mix = groups[0].attend, getattr(groups[0], "mix", None)
        else:
            spans = list(zip(groups, starts[:-1], starts[1:]))

            def attention(index, x, q, k, v):  # each group attends over its own slice of the step's tokens
                return torch.cat([g.attend(index, x[a:b], q[a:b], k[a:b], v[a:b]) for g, a, b in spans])

            def mix(index, state, x):  # a hybrid's state layer: each group over its own rows' states
                return torch.cat([g.mix(index, state, x[a:b]) for g, a, b in spans])

        hidden = self.run_layers(hidden, tables, attention, mix, per_layer)
        picked = torch.cat([g.output_rows + start for g, start in zip(groups, starts)]) if len(groups) > 1 \
            else groups[0].output_rows
        logits = self.logits(hidden[picked])
        return list(logits.split([g.output_rows.shape[0] for g in groups]))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [N] -> hidden [N, hidden] (Gemma multiplies by sqrt(hidden); a tied head keeps the raw table)."""
        hidden = self.decoder.embed_tokens(ids)
        return hidden * self.embedding_scale if self.embedding_scale != 1.0 else hidden

    def per_layer_inputs(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4's per-layer inputs [N, layers, P] of ids [N] and their embedding hidden [N, hidden] (decoder.
        PerLayerEmbedding); None for every other model."""
        block = self.per_layer
        if block is None:
            return None
        n, width = ids.shape[0], block.width
        tokens = block.table(ids).view(n, block.layers, width) * width**0.5
        projected = self.per_layer_projection(hidden) * hidden.shape[-1] ** -0.5
        projected = self.per_layer_norm(projected.view(n, block.layers, width))
        return (projected + tokens) * 2**-0.5

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and the head: hidden [n, hidden] -> fp32 logits [n, vocab] (Gemma 2 soft-caps them)."""
        logits = self.model.lm_head(self.final_norm(hidden)).float()
        return cap_logits(logits, self.final_softcap) if self.final_softcap else logits

    def rotary_tables(self, hidden: torch.Tensor, positions: torch.Tensor) -> list:
        """[(cos, signed sin) [N, 1, D]] per rotary table the layers use (one; Gemma 3: global and local)."""
        return [self.rotary(hidden, positions, module) for module in self.rotary_modules]

    def run_layers(self, hidden: torch.Tensor, tables: list, attention, mix=None,
                   per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers over hidden [N, hidden] with the step's rotary tables (rotary_tables);
        attention(layer, x, q, k, v) -> out [N, Hq, D] writes the layer's new K/V and attends (x is the normed
        input, for the window hook). An attention with a `rope_write(layer, ops, qkv, cos, sin)` method (the static
        step's) may take a fused projection's output [N, (Hq + 2 Hkv) * D] whole: it returns q [N, Hq, D] rotated
        with the layer's K/V already stored, and is then called with k = v = None; or None, and the forward rotates.
        mix(layer, state_ops, x) -> [N, hidden]: a hybrid's state layer over its rows' states (default: the
        attention's `mix` method). per_layer: Gemma 4's per-layer inputs (per_layer_inputs). A layer reading another
        layer's K/V (Gemma 4) computes only q and is called with its source's k and v of this step: the attention
        must not store them again."""
        n = hidden.shape[0]
        rope_write = getattr(attention, "rope_write", None)
        mix = mix if mix is not None else getattr(attention, "mix", None)
        hq, hkv = self.num_heads, self.kv_heads
        kept: dict[int, tuple] = {}  # source layer -> its (k, v) of this step, for the layers that share them
        for index, ops in enumerate(self.ops):
            d = ops.head_dim or self.head_dim
            x = ops.input_norm(hidden)
            if ops.state is not None:  # Gated DeltaNet / short conv: no K/V, the rows' states in the pool
                hidden = hidden + mix(index, ops.state, x)
                hidden = hidden + ops.mlp(ops.post_norm(hidden))
                continue
            cos, sin = tables[ops.rotary]
            gate = None
            if ops.kv_source >= 0:  # q only: [n, Hq, D] normed and rotated
                q = ops.qkv(x).view(n, hq, d)
                q = _rotate(ops.q_norm(q) if ops.q_norm is not None else q, cos, sin)
                k, v = kept[ops.kv_source]
            elif ops.qkv is not None:
                fused = ops.qkv(x)  # [n, (Hq + 2 Hkv) * D] (+ the output gate's [n, Hq * D])
                if ops.output_gate:
                    fused, gate = fused[:, : (hq + 2 * hkv) * d], fused[:, (hq + 2 * hkv) * d :]
                q = rope_write(index, ops, fused, cos, sin) if rope_write is not None else None
                q, k, v = (q, None, None) if q is not None else self.split_qkv(ops, fused, n, cos, sin)
            else:
                q, k, v = self.qkv(ops, x, n, cos, sin)
            if index in self.kv_sources:
                kept[index] = (k, v)
            out = attention(index, x, q, k, v).reshape(n, hq * d)
            if gate is not None:  # Qwen3.5: sigmoid(gate) per output channel, before o_proj
                out = out * torch.sigmoid(gate)
            out = ops.o_proj(out)
            hidden = hidden + (ops.attn_out_norm(out) if ops.attn_out_norm is not None else out)
            out = ops.mlp(ops.post_norm(hidden))
            hidden = hidden + (ops.mlp_out_norm(out) if ops.mlp_out_norm is not None else out)
            hidden = ops.finish(hidden, per_layer, index)
        return hidden

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor,
               module: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [N, 1, R] for the step's positions [N] (hidden [N, hidden] gives the dtype), from the
        decoder's rotary embedding (for the engine's context) or `module`; R is the rotary dims of a head, D unless
        the model rotates only part of it."""
        cos, sin = (module or self.rotary_emb)(hidden[None], positions[None])  # [1, N, rotary_dim] each
        # [N, 1, D] broadcast over heads; the sign folded in once per step, so each layer's RoPE is three ops
        return cos[0, :, None, :], _signed_sin(sin[0, :, None, :])

    def qkv(self, ops: "LayerOps", x: torch.Tensor, n: int, cos: torch.Tensor, sin: torch.Tensor):
        """q [n, Hq, D] and k [n, Hkv, D] rotated at their positions, v [n, Hkv, D].

        cos, sin [n, 1, D]. With fused q/k/v the query and key heads sit side by side in one output row, so they
        are rotated together: one RoPE over Hq + Hkv heads instead of two.
        """
        hq, hkv, d = self.num_heads, self.kv_heads, ops.head_dim or self.head_dim
        if ops.qkv is not None:
            return self.split_qkv(ops, ops.qkv(x), n, cos, sin)
        q, k = ops.q(x).view(n, hq, d), ops.k(x).view(n, hkv, d)
        if ops.qk_norm is not None:
            q, k = ops.qk_norm.q(q), ops.qk_norm.k(k)
        if ops.rope:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return q, k, _value_norm(ops, ops.v(x).view(n, hkv, d))

    def split_qkv(self, ops: "LayerOps", qkv: torch.Tensor, n: int, cos: torch.Tensor, sin: torch.Tensor):
        """The fused projection's output qkv [n, (Hq + 2 Hkv) * D] -> q, k rotated (and head-normed), v (qkv above)."""
        hq, hkv, d = self.num_heads, self.kv_heads, ops.head_dim or self.head_dim
        qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
        if ops.qk_norm is not None:
            qk = ops.qk_norm.both(qk)
        if ops.rope:
            qk = _rotate(qk, cos, sin)
        return qk[:, :hq], qk[:, hq:], _value_norm(ops, qkv[:, (hq + hkv) * d :].view(n, hkv, d))


def _value_norm(ops: LayerOps, v: torch.Tensor) -> torch.Tensor:
    """Gemma 4's value heads v [n, Hkv, D] RMS-normed in fp32 without a scale; v itself for every other model."""
    if not ops.value_norm_eps:
        return v
    return torch.nn.functional.rms_norm(v.float(), (v.shape[-1],), None, ops.value_norm_eps).to(v.dtype)


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
