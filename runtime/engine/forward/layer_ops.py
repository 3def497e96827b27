"""One decoder layer's weights bound for the paged forward (runtime/model/projections.py): the 4-bit projections
straight to their kernel, the norms to one fused op, plus what the layer's family decides (per-head q/k norms,
NoPE, sandwich norms, which rotary table, a sliding window). The modules stay the owners of the weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from oval_edge.runtime.model.projections import bind_norm, bind_projection

from .state_layer_ops import StateMixerOps, bind_state_mixer

MLP_ROW_BLOCK = 128  # prefill rows per MLP call: 128 x 2 x 1536 fp32 = 1.5 MB for SmolLM2 instead of 6 MB


# Norm modules computing weight * rms_normalize(x in fp32).to(x.dtype), exactly what F.rms_norm with the weight does
# (torch normalizes in fp32, casts to x's dtype, then scales): the runtime's own and transformers' Llama family.
RMS_NORMS = frozenset({"RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                       "SmolLM3RMSNorm", "Phi3RMSNorm"})


def bind_one_op_norm(module: torch.nn.Module) -> Callable:
    """A norm as one op on a GPU where its weight is 16-bit (bind_norm keeps such a module's own arithmetic:
    `rms_norm` then the weight multiply, two kernels, 122 of a 30-layer decode step). bind_norm's binding elsewhere:
    fp32 weights (the native CPU kernel or the fused op), and 16-bit weights on a CPU, whose figures stay as the
    module computes them (torch's fused op there rounds once where the module rounds twice)."""
    bound = bind_norm(module)
    weight = getattr(module, "weight", None)
    if bound is not module or weight is None or weight.device.type == "cpu":
        return bound
    return one_op_norm(module) or bound


def one_op_norm(module: torch.nn.Module) -> Callable | None:
    """weight * rms_normalize(x) as one F.rms_norm call for a Llama-family RMSNorm `module` (RMS_NORMS), or None.
    fp32 x gives the module's numbers exactly; x in the weight's 16-bit dtype within one rounding of them."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if type(module).__name__ not in RMS_NORMS or weight is None or eps is None:
        return None
    wide = weight.float()  # [hidden] fp32: fp32 activations meet the 16-bit weight promoted, as the module's product
    shape = tuple(weight.shape)

    def norm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == weight.dtype:
            return F.rms_norm(x, shape, weight, eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, wide, eps)
        return module(x)  # another mix of dtypes: the module's own promotion

    return norm


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
    """One decoder layer bound for the runtime's forward (module doc). Per layer:
    hidden += [attn_out_norm](o_proj(attention(input_norm(hidden)))); hidden += [mlp_out_norm](mlp(post_norm(hidden)))
    where the bracketed norms exist only with sandwich norms (Gemma; post_norm is then its pre_feedforward norm). A
    hybrid's state layer has `state` (its mixer over the pool's per-sequence state) in attention's place."""

    input_norm: Callable
    post_norm: Callable  # the norm before the MLP
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
    attn_out_norm: Callable | None = None  # Gemma: norms of the attention's and the MLP's outputs
    mlp_out_norm: Callable | None = None
    rotary: int = 0  # which of the step's rotary tables this layer uses (1: Gemma 3's sliding layers' own base)
    sliding: bool = False  # attends to its last `sliding_window` positions, kept in the pool's ring
    output_gate: bool = False  # Qwen3.5: the fused projection's tail [n, Hq * D] gates the attention's output
    state: StateMixerOps | None = None  # a hybrid's state layer (no attention: q/k/v/o are None)
    head_dim: int = 0  # this layer's D (Gemma 4's full and sliding layers differ)
    kv_source: int = -1  # Gemma 4: the layer whose K/V this one attends to (its projection is q only); -1: its own
    q_norm: Callable | None = None  # such a layer's query head norm (it has no key one)
    value_norm_eps: float = 0.0  # Gemma 4: RMS-norm each value head (no scale) with this eps; 0: not
    per_layer_gate: Callable | None = None  # Gemma 4's per-layer input block (decoder.PerLayerInput), after the MLP
    per_layer_projection: Callable | None = None
    per_layer_norm: Callable | None = None
    layer_scalar: torch.Tensor | None = None  # Gemma 4: the residual times this [1] at the layer's end

    @classmethod
    def bind(cls, layer: torch.nn.Module, heads: int, kv_heads: int, rotary: int = 0,
             sliding: bool = False, head_dim: int = 0) -> "LayerOps":
        mlp = layer.mlp
        gate_up = getattr(mlp, "gate_up_proj", None)
        mixer = getattr(layer, "linear_attn", None) or getattr(layer, "conv", None)
        if mixer is not None:  # Qwen3.5's Gated DeltaNet, LFM2's short conv: norm, mixer, residual, then the MLP
            return cls(input_norm=bind_one_op_norm(layer.input_layernorm),
                       post_norm=bind_one_op_norm(layer.post_attention_layernorm), qkv=None, q=None, k=None, v=None,
                       o_proj=None, gate_up=bind_projection(gate_up) if gate_up is not None else None,
                       mlp_module=mlp, down=bind_projection(mlp.down_proj), act=mlp.act_fn,
                       state=bind_state_mixer(mixer))
        attn = layer.self_attn
        fused = getattr(attn, "qkv_proj", None)
        block = getattr(layer, "per_layer_input", None)
        source = int(getattr(attn, "kv_source", -1))
        gemma4 = dict(head_dim=int(getattr(attn, "head_dim", 0) or head_dim), kv_source=source,
                      q_norm=bind_one_op_norm(attn.q_norm) if source >= 0 and attn.q_norm is not None else None,
                      value_norm_eps=float(getattr(attn, "value_norm_eps", 0.0)),
                      per_layer_gate=bind_projection(block.gate) if block is not None else None,
                      per_layer_projection=bind_projection(block.projection) if block is not None else None,
                      per_layer_norm=bind_one_op_norm(block.post_norm) if block is not None else None,
                      layer_scalar=getattr(layer, "layer_scalar", None))
        sandwich = getattr(layer, "pre_feedforward_layernorm", None) is not None
        if sandwich:
            pre_mlp = bind_one_op_norm(layer.pre_feedforward_layernorm)
            attn_out = bind_one_op_norm(layer.post_attention_layernorm)
            mlp_out = bind_one_op_norm(layer.post_feedforward_layernorm)
        else:
            pre_mlp, attn_out, mlp_out = bind_one_op_norm(layer.post_attention_layernorm), None, None
        return cls(
            input_norm=bind_one_op_norm(layer.input_layernorm), post_norm=pre_mlp, attn_out_norm=attn_out,
            mlp_out_norm=mlp_out, rotary=rotary, sliding=sliding,
            qkv=bind_projection(fused) if fused is not None else None,
            q=None if fused is not None else bind_projection(attn.q_proj),
            k=None if fused is not None else bind_projection(attn.k_proj),
            v=None if fused is not None else bind_projection(attn.v_proj),
            o_proj=bind_projection(attn.o_proj),
            gate_up=bind_projection(gate_up) if gate_up is not None else None,
            mlp_module=mlp, down=bind_projection(mlp.down_proj), act=mlp.act_fn,
            qk_norm=HeadNorms.bind(attn, heads, kv_heads), rope=bool(getattr(attn, "use_rope", True)),
            output_gate=bool(getattr(attn, "output_gate", False)), **gemma4,
        )

    def finish(self, hidden: torch.Tensor, per_layer: torch.Tensor | None, index: int) -> torch.Tensor:
        """The end of a layer after its MLP's residual add: Gemma 4's per-layer input block (per_layer [n, layers,
        P], this layer's slice) and the layer scalar; the hidden state as it is for every other model."""
        if self.per_layer_gate is not None:
            gated = self.act(self.per_layer_gate(hidden)) * per_layer[:, index]  # [n, P]
            hidden = hidden + self.per_layer_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar if self.layer_scalar is not None else hidden

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > MLP_ROW_BLOCK:  # prefill chunks: bound the [rows, 2 x intermediate] fp32 transients
            return torch.cat([self.mlp(x[i : i + MLP_ROW_BLOCK]) for i in range(0, x.shape[0], MLP_ROW_BLOCK)])
        if self.gate_up is None:
            return self.mlp_module(x)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [n, intermediate] each
        return self.down(self.act(gate) * up)
