"""A hybrid model's state layers bound for the paged forward: Qwen3.5's Gated DeltaNet and LFM2's gated short conv
([R-kinds-and-tiers]). Each reads and updates its sequences' fixed-size state in the pool (oval_edge/kv/state.py) in
place; the math is state_mixers.py's.

Two entry points per layer, as for attention:
    prefill(x [n, hidden], conv [C, K - 1], recurrent [Hv, dk, dv] | None) -> [n, hidden]
        one sequence's prompt chunk (PrefillRows calls it per row with that row's state slot);
    step(x [B, hidden], conv [S, C, K - 1], recurrent [S, Hv, dk, dv] | None, slots [B]) -> [B, hidden]
        the static decode step's rows, each at its slot: static shapes, no host sync ([R-static-step]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from oval_edge.kernels.gpu import delta_step_kernel
from oval_edge.runtime.model.projections import bind_projection

from .state_mixers import causal_conv, causal_conv_step, gated_delta_prefill, gated_delta_step, gated_rms_norm


@dataclass
class ShortConvOps:
    """LFM2: in_proj -> B | C | x [n, hidden] each; y = C * conv(B * x); out_proj."""

    in_proj: Callable
    out_proj: Callable
    weight: torch.Tensor  # [hidden, K]
    bias: torch.Tensor | None

    def prefill(self, x: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor | None) -> torch.Tensor:
        b, c, u = self.in_proj(x).chunk(3, dim=-1)
        return self.out_proj(c * causal_conv(b * u, conv, self.weight, self.bias))

    def step(self, x: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor | None,
             slots: torch.Tensor) -> torch.Tensor:
        b, c, u = self.in_proj(x).chunk(3, dim=-1)
        return self.out_proj(c * causal_conv_step(b * u, conv, slots, self.weight, self.bias))


@dataclass
class DeltaNetOps:
    """Qwen3.5: in_proj -> q|k|v (conv channels C) | z, gate_proj -> b | a; SiLU(conv(q|k|v)); beta = sigmoid(b); log decay
    g = decay_rate * softplus(a + dt_bias); the gated delta rule over the state; gated RMSNorm by z; out_proj."""

    in_proj: Callable
    gate_proj: Callable
    out_proj: Callable
    conv_weight: torch.Tensor  # [C, K]
    dt_bias: torch.Tensor  # [Hv] fp32
    decay_rate: torch.Tensor  # [Hv] fp32, -exp(A_log)
    norm_weight: torch.Tensor  # [dv]
    k_heads: int
    v_heads: int
    key_dim: int
    value_dim: int
    eps: float
    kernel: object | None = None  # on CUDA, triton_delta (the step's state read and written once in place)

    def _split(self, x: torch.Tensor):
        """x [n, hidden] -> (q|k|v [n, C], z [n, Hv, dv], beta [n, Hv], g [n, Hv] fp32)."""
        keys, values, heads = self.k_heads * self.key_dim, self.v_heads * self.value_dim, self.v_heads
        mixed, z = self.in_proj(x).split([2 * keys + values, values], dim=-1)
        b, a = self.gate_proj(x).split([heads, heads], dim=-1)
        g = self.decay_rate * F.softplus(a.float() + self.dt_bias)
        return mixed, z.reshape(x.shape[0], heads, self.value_dim), b.sigmoid(), g

    def _heads(self, mixed: torch.Tensor):
        """q|k|v after the conv [n, C] -> q, k [n, Hk, dk], v [n, Hv, dv] (views)."""
        n, keys = mixed.shape[0], self.k_heads * self.key_dim
        q, k, v = mixed.split([keys, keys, self.v_heads * self.value_dim], dim=-1)
        return (q.reshape(n, self.k_heads, self.key_dim), k.reshape(n, self.k_heads, self.key_dim),
                v.reshape(n, self.v_heads, self.value_dim))

    def _out(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """core, z [n, Hv, dv] -> out_proj(gated_norm(core, z)) [n, hidden]."""
        normed = gated_rms_norm(core, z, self.norm_weight, self.eps)
        return self.out_proj(normed.reshape(core.shape[0], self.v_heads * self.value_dim))

    def prefill(self, x: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor | None) -> torch.Tensor:
        mixed, z, beta, g = self._split(x)
        q, k, v = self._heads(causal_conv(mixed, conv, self.conv_weight, None, silu=True))
        return self._out(gated_delta_prefill(q, k, v, g, beta, recurrent), z)

    def step(self, x: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor | None,
             slots: torch.Tensor) -> torch.Tensor:
        mixed, z, beta, g = self._split(x)
        q, k, v = self._heads(causal_conv_step(mixed, conv, slots, self.conv_weight, None, silu=True))
        core = None
        if self.kernel is not None:  # None for shapes or dtypes it does not take (fixed per step: shapes only)
            core = self.kernel.gated_delta_step(q.contiguous(), k.contiguous(), v.contiguous(), g, beta.contiguous(),
                                                recurrent, slots)
        if core is None:
            core = gated_delta_step(q, k, v, g, beta, recurrent, slots)
        return self._out(core, z)


StateMixerOps = ShortConvOps | DeltaNetOps


def bind_state_mixer(mixer: torch.nn.Module) -> StateMixerOps:
    """A decoder.LinearAttention or decoder.ShortConv bound for the forward (projections to their kernels)."""
    if hasattr(mixer, "decay_rate"):
        device = mixer.decay_rate.device  # the Triton step on CUDA only: a CPU runs the torch step (its figures)
        return DeltaNetOps(bind_projection(mixer.in_proj), bind_projection(mixer.gate_proj),
                           bind_projection(mixer.out_proj), mixer.conv_weight,
                           mixer.dt_bias, mixer.decay_rate, mixer.norm_weight, mixer.k_heads, mixer.v_heads,
                           mixer.key_dim, mixer.value_dim, mixer.eps,
                           delta_step_kernel(device) if device.type == "cuda" else None)
    return ShortConvOps(bind_projection(mixer.in_proj), bind_projection(mixer.out_proj), mixer.conv_weight,
                        mixer.conv_bias)
