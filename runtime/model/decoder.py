"""The runtime's own holder of a Llama-family decoder's weights, laid out as transformers lays them out.

PagedLlama (runtime/engine/forward/paged_llama.py) owns the forward; these modules only hold weights: a fused q/k/v projection,
the output projection, a fused gate/up projection, the down projection, two RMSNorms per layer, the embedding,
final norm and head, and the rotary frequencies. Attribute paths match transformers' (model.model.layers[i]
.self_attn.qkv_proj, ...) so the runtime, the eval tools and the tests address both the same way.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .config import DecoderConfig, longrope_inv_freq, longrope_uses_long_factors, rotary_inv_freq


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight in fp32, as Llama's; runtime/model/projections.bind_norm calls F.rms_norm."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [hidden]
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), None, self.variance_epsilon)
        return self.weight * out.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos, sin [B, N, rotary_dim] for positions [B, N], in transformers' rotate_half layout (frequencies twice).

    rotary_dim is head_dim unless the model rotates part of each head (Phi-4-mini). LongRoPE (Phi-3.5/4-mini)
    fixes one factor set for the context the runtime serves (config.longrope_uses_long_factors): `context` here,
    the model's max_position_embeddings when not given; `for_context` gives the embedding for another context.
    """

    def __init__(self, config: DecoderConfig, freq_factors: torch.Tensor | None = None, context: int | None = None):
        super().__init__()
        self.config, self.freq_factors = config, freq_factors
        self.attention_scaling = 1.0  # cos and sin are multiplied by it (LongRoPE's attention factor)
        self.long_factors: bool | None = None  # which LongRoPE factor set is in use; None: not LongRoPE
        if config.rope_type == "longrope":
            self.long_factors = longrope_uses_long_factors(config, context or config.max_position_embeddings)
            inv_freq, self.attention_scaling = longrope_inv_freq(config, self.long_factors)
        else:
            inv_freq = rotary_inv_freq(config)  # [rotary_dim / 2] fp32 (Gemma 3's sliding layers: config.rope_local())
        if freq_factors is not None:  # a Llama 3.1 GGUF's rope_freqs: llama.cpp divides each frequency by its factor
            inv_freq = inv_freq / freq_factors.float()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def for_context(self, context: int) -> "RotaryEmbedding":
        """This embedding when the runtime serves `context` tokens per sequence: itself unless LongRoPE would pick
        the other factor set for it."""
        if self.long_factors is None or longrope_uses_long_factors(self.config, context) == self.long_factors:
            return self
        return RotaryEmbedding(self.config, self.freq_factors, context).to(self.inv_freq.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq.to(x.device)  # [B, N, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_scaling != 1.0:  # a Python float fixed at load: no branch on device values
            return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class DecoderAttention(nn.Module):
    def __init__(self, qkv_proj: nn.Module, o_proj: nn.Module, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None, use_rope: bool = True, output_gate: bool = False,
                 head_dim: int = 0, kv_source: int = -1, value_norm_eps: float = 0.0):
        super().__init__()
        # hidden -> (Hq + 2 Hkv) * D, rows q | k | v (| gate [Hq * D] with output_gate); Hq * D alone in a layer
        # reading another layer's K/V (kv_source >= 0, Gemma 4)
        self.qkv_proj = qkv_proj
        self.output_gate = output_gate  # Qwen3.5: the attention's output times sigmoid(gate) before o_proj
        self.o_proj = o_proj
        self.q_norm, self.k_norm = q_norm, k_norm  # Qwen3: RMSNorm over each head's D before RoPE, else None
        self.use_rope = use_rope  # False in a NoPE layer (SmolLM3): q and k are not rotated (transformers' name)
        self.head_dim = head_dim  # this layer's D where the model's layers differ (Gemma 4); 0: the model's
        self.kv_source = kv_source  # the layer whose K/V this one reads (Gemma 4's shared layers); -1: its own
        self.value_norm_eps = value_norm_eps  # Gemma 4: each value head RMS-normed (no scale) with this eps; 0: not


class LinearAttention(nn.Module):
    """Qwen3.5's Gated DeltaNet weights (transformers' Qwen3_5GatedDeltaNet), its four input projections fused.

    in_proj: hidden -> rows q | k | v (the conv's channels C = 2 Hk dk + Hv dv) | z [Hv dv]; gate_proj: hidden ->
    b [Hv] | a [Hv] (kept as read: they set each head's write strength and decay); conv_weight [C, K] the depthwise causal conv; decay_rate [Hv] fp32 = -exp(A_log) (the log decay per step is
    decay_rate * softplus(a + dt_bias)); norm_weight [dv] the gated RMSNorm's (plain w); out_proj: Hv dv -> hidden.
    The per-sequence state lives in the pool (oval_edge/kv/state.py)."""

    def __init__(self, in_proj: nn.Module, gate_proj: nn.Module, conv_weight: torch.Tensor, dt_bias: torch.Tensor,
                 a_log: torch.Tensor, norm_weight: torch.Tensor, out_proj: nn.Module, k_heads: int, v_heads: int,
                 key_dim: int, value_dim: int, eps: float):
        super().__init__()
        self.in_proj, self.gate_proj, self.out_proj = in_proj, gate_proj, out_proj
        self.conv_weight = nn.Parameter(conv_weight, requires_grad=False)
        self.dt_bias = nn.Parameter(dt_bias.float(), requires_grad=False)
        self.decay_rate = nn.Parameter(-a_log.float().exp(), requires_grad=False)
        self.norm_weight = nn.Parameter(norm_weight, requires_grad=False)
        self.k_heads, self.v_heads, self.key_dim, self.value_dim, self.eps = k_heads, v_heads, key_dim, value_dim, eps


class ShortConv(nn.Module):
    """LFM2's gated short conv (transformers' Lfm2ShortConv): in_proj hidden -> rows B | C | x [3 hidden];
    y = C * conv(B * x) with conv_weight [hidden, K] (+ conv_bias [hidden]) causal and depthwise; out_proj."""

    def __init__(self, in_proj: nn.Module, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                 out_proj: nn.Module):
        super().__init__()
        self.in_proj, self.out_proj = in_proj, out_proj
        self.conv_weight = nn.Parameter(conv_weight, requires_grad=False)
        self.conv_bias = None if conv_bias is None else nn.Parameter(conv_bias, requires_grad=False)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh (Gemma's GeGLU gate)."""
    return F.gelu(x, approximate="tanh")


GATE_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class DecoderMLP(nn.Module):
    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = gate_up_proj  # hidden -> 2 * intermediate, rows gate | up
        self.down_proj = down_proj
        self.act = act  # a name (GATE_ACTIVATIONS): plain data, which the weight cache records as it is

    @property
    def act_fn(self):
        return GATE_ACTIVATIONS[self.act]


class DecoderLayer(nn.Module):
    """Llama: input_layernorm before attention (or a hybrid's state mixer), post_attention_layernorm before the MLP.
    Gemma (sandwich norms, the
    two extra norms given): input_layernorm before attention, post_attention_layernorm on its output,
    pre_feedforward_layernorm before the MLP, post_feedforward_layernorm on its output (transformers' names)."""

    def __init__(self, attention: nn.Module, mlp: DecoderMLP, input_norm: RMSNorm, post_norm: RMSNorm,
                 pre_ffn_norm: RMSNorm | None = None, post_ffn_norm: RMSNorm | None = None,
                 per_layer_input: "PerLayerInput | None" = None, layer_scalar: torch.Tensor | None = None):
        super().__init__()
        # Gemma 4: the layer's per-layer input block after its MLP, then the residual times layer_scalar [1]
        self.per_layer_input = per_layer_input
        self.layer_scalar = None if layer_scalar is None else nn.Parameter(layer_scalar, requires_grad=False)
        # the token mixer under transformers' name: self_attn, or a hybrid's linear_attn (Qwen3.5) / conv (LFM2)
        if isinstance(attention, LinearAttention):
            self.linear_attn = attention
        elif isinstance(attention, ShortConv):
            self.conv = attention
        else:
            self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = input_norm
        self.post_attention_layernorm = post_norm
        if pre_ffn_norm is not None:
            self.pre_feedforward_layernorm = pre_ffn_norm
            self.post_feedforward_layernorm = post_ffn_norm


class PerLayerInput(nn.Module):
    """Gemma 4's per-layer input block of one layer (transformers' per_layer_input_gate, per_layer_projection,
    post_per_layer_input_norm): h + post_norm(projection(gelu(gate(h)) * input_l)), input_l [n, P] the layer's slice
    of the per-layer inputs (PerLayerEmbedding)."""

    def __init__(self, gate: nn.Module, projection: nn.Module, post_norm: RMSNorm):
        super().__init__()
        self.gate, self.projection, self.post_norm = gate, projection, post_norm  # hidden -> P, P -> hidden


class PerLayerEmbedding(nn.Module):
    """Gemma 4's per-layer inputs [n, layers, P] of tokens: (norm(projection(e) * hidden^-0.5) + table(ids) * sqrt(P))
    * 2^-0.5, e the scaled token embedding [n, hidden]; table [vocab_per_layer, layers * P] (an int8 table in 4-bit
    modes, like the token embedding), projection hidden -> layers * P, norm over each layer's P."""

    def __init__(self, table: nn.Module, projection: nn.Module, norm: RMSNorm, layers: int, width: int):
        super().__init__()
        self.table, self.projection, self.norm = table, projection, norm
        self.layers, self.width = layers, width


class DecoderStack(nn.Module):
    def __init__(self, config: DecoderConfig, embed_tokens: nn.Module, layers: list[DecoderLayer], norm: RMSNorm,
                 freq_factors: torch.Tensor | None = None, per_layer: PerLayerEmbedding | None = None):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.per_layer = per_layer  # Gemma 4's per-layer inputs, else None
        self.rotary_emb = RotaryEmbedding(config.full_rope(), freq_factors)  # Gemma 4: at the full layers' D
        local = config.local_rope()
        if local is not None:  # Gemma 3: sliding layers rotate with their own base
            self.rotary_emb_local = RotaryEmbedding(local)


class DecoderModel(nn.Module):
    """config, model (embed_tokens, layers, norm, rotary_emb), lm_head, generation_config.eos_token_id."""

    def __init__(self, config: DecoderConfig, stack: DecoderStack, lm_head: nn.Module):
        super().__init__()
        self.config = config
        self.model = stack
        self.lm_head = lm_head
        self.generation_config = SimpleNamespace(eos_token_id=config.eos_token_id, bos_token_id=config.bos_token_id)
