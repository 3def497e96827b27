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

from .config import DecoderConfig, rotary_inv_freq


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
    """cos, sin [B, N, head_dim] for positions [B, N], in transformers' rotate_half layout (frequencies twice)."""

    def __init__(self, config: DecoderConfig, freq_factors: torch.Tensor | None = None):
        super().__init__()
        inv_freq = rotary_inv_freq(config)  # [head_dim / 2] fp32 (config.rope_local() for Gemma 3's sliding layers)
        if freq_factors is not None:  # a Llama 3.1 GGUF's rope_freqs: llama.cpp divides each frequency by its factor
            inv_freq = inv_freq / freq_factors.float()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq.to(x.device)  # [B, N, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class DecoderAttention(nn.Module):
    def __init__(self, qkv_proj: nn.Module, o_proj: nn.Module, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None, use_rope: bool = True):
        super().__init__()
        self.qkv_proj = qkv_proj  # hidden -> (Hq + 2 Hkv) * D, rows q | k | v
        self.o_proj = o_proj
        self.q_norm, self.k_norm = q_norm, k_norm  # Qwen3: RMSNorm over each head's D before RoPE, else None
        self.use_rope = use_rope  # False in a NoPE layer (SmolLM3): q and k are not rotated (transformers' name)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh (Gemma's GeGLU gate)."""
    return F.gelu(x, approximate="tanh")


GATE_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class DecoderMLP(nn.Module):
    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = gate_up_proj  # hidden -> 2 * intermediate, rows gate | up
        self.down_proj = down_proj
        self.act_fn = GATE_ACTIVATIONS[act]


class DecoderLayer(nn.Module):
    """Llama: input_layernorm before attention, post_attention_layernorm before the MLP. Gemma (sandwich norms, the
    two extra norms given): input_layernorm before attention, post_attention_layernorm on its output,
    pre_feedforward_layernorm before the MLP, post_feedforward_layernorm on its output (transformers' names)."""

    def __init__(self, attention: DecoderAttention, mlp: DecoderMLP, input_norm: RMSNorm, post_norm: RMSNorm,
                 pre_ffn_norm: RMSNorm | None = None, post_ffn_norm: RMSNorm | None = None):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = input_norm
        self.post_attention_layernorm = post_norm
        if pre_ffn_norm is not None:
            self.pre_feedforward_layernorm = pre_ffn_norm
            self.post_feedforward_layernorm = post_ffn_norm


class DecoderStack(nn.Module):
    def __init__(self, config: DecoderConfig, embed_tokens: nn.Module, layers: list[DecoderLayer], norm: RMSNorm,
                 freq_factors: torch.Tensor | None = None):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = RotaryEmbedding(config, freq_factors)
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
