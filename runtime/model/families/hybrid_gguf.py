"""Qwen3.5 and LFM2 GGUF files (llama.cpp's `qwen35` / `lfm2`) read back as transformers holds them.

llama.cpp's converter (convert_hf_to_gguf: Qwen3NextModel and _LinearAttentionVReorderBase for Qwen3.5, LFM2Model)
renames every tensor and changes some of them; GGUFWeights undoes each change here, so a GGUF yields the state dict
of transformers' Qwen3_5ForCausalLM / Lfm2ForCausalLM (names, shapes and values), and `config_values` turns the
header into the config dict transformers' Qwen3_5TextConfig / Lfm2Config take.

What the converter does, and what is undone:
- Qwen3.5 norms: every `*norm.weight` but the DeltaNet's gated norm (linear_attn.norm) is stored as 1 + w (its
  RMSNorm scales by 1 + w; llama.cpp's by w): 1 is subtracted back.
- A_log is stored as ssm_a = -exp(A_log): A_log = log(-ssm_a). dt_bias is stored as ssm_dt.bias.
- conv1d [C, 1, K] (Qwen3.5) / conv.conv [hidden, 1, L] (LFM2) are stored squeezed to [C, K]: the 1 comes back.
- Qwen3.5 value heads: where linear_num_value_heads > linear_num_key_heads (r = V / K value heads per key head),
  transformers groups them by key head [k0v0 .. k0v(r-1), k1v0 ..] and llama.cpp tiles them [k0v0, k1v0, .., k0v1 ..]:
  the value rows of in_proj_qkv and of conv1d's channels, in_proj_z's rows (head_v_dim each), in_proj_a / in_proj_b
  rows, A_log and dt_bias (one per head), and out_proj's columns (head_v_dim each) are put back in grouped order.
- LFM2's MLP width: the header's feed_forward_length is llama.cpp's rounding of intermediate_size; the config gets
  the width the tensors have, with block_auto_adjust_ff_dim off, so transformers builds exactly that width.
- Qwen3.5's multi-token-prediction head, where the converter kept it, is block_count's last nextn_predict_layers
  blocks (blk.L.*, blk.L.nextn.*): not run, so neither listed nor counted in num_hidden_layers.
- Qwen3.5 layer kinds: llama.cpp keeps only full_attention_interval (every n-th layer is full attention); LFM2's
  attention layers are those whose head_count_kv entry is not 0.
The attention's q_proj (Qwen3.5: query and output-gate rows interleaved per head) is stored as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

QWEN35_ARCHS = ("qwen35", "qwen3_5_text", "qwen3_5")  # llama.cpp's name, then the config's model_type
LFM2_ARCHS = ("lfm2",)
HYBRID_GGUF_ARCHS = QWEN35_ARCHS + LFM2_ARCHS


def _weights(pairs: dict[str, str]) -> dict[str, str]:
    return {f"{ours}.weight": f"{theirs}.weight" for ours, theirs in pairs.items()}


# GGUF name inside blk.N. -> transformers' name inside model.layers.N.
_QWEN35_LAYER = {
    **_weights({"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_qkv": "linear_attn.in_proj_qkv",
                "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
                "ssm_alpha": "linear_attn.in_proj_a", "ssm_conv1d": "linear_attn.conv1d",
                "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}),
    "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
}
_LFM2_MODULES = {"attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_q": "self_attn.q_proj",
                 "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.out_proj",
                 "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
                 "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
                 "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
                 "shortconv.out_proj": "conv.out_proj"}
_LFM2_LAYER = {**_weights(_LFM2_MODULES), **{f"{ours}.bias": f"{theirs}.bias" for ours, theirs in
                                              _LFM2_MODULES.items() if ours.startswith("shortconv.")}}  # conv_bias
_QWEN35_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
_LFM2_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                "token_embd_norm.weight": "model.embedding_norm.weight"}  # LFM2's final norm
_LAYER = re.compile(r"blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str, architecture: str) -> str | None:
    """transformers' name of a qwen35 / lfm2 GGUF tensor; None for one that is not part of the text decoder."""
    qwen = architecture in QWEN35_ARCHS
    fixed = (_QWEN35_GLOBAL if qwen else _LFM2_GLOBAL).get(gguf_name)
    if fixed:
        return fixed
    match = _LAYER.match(gguf_name)
    inner = match and (_QWEN35_LAYER if qwen else _LFM2_LAYER).get(match.group(2))
    return f"model.layers.{match.group(1)}.{inner}" if inner else None


@dataclass(frozen=True)
class HybridLayout:
    """What the inverse transforms need from the header: the family, and (Qwen3.5) the DeltaNet's head counts and
    sizes (0 for LFM2, which has no reordered heads)."""

    qwen: bool
    key_heads: int = 0
    value_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0

    def __post_init__(self):
        if self.qwen and (self.key_heads <= 0 or self.value_heads % max(self.key_heads, 1)):
            raise ValueError(f"qwen35 GGUF: ssm.time_step_rank={self.value_heads} (value heads) must be a multiple "
                             f"of ssm.group_count={self.key_heads} (key heads); the file's header is inconsistent")

    @classmethod
    def from_header(cls, architecture: str, scalar) -> "HybridLayout":
        """scalar(key) -> the header value of `qwen35.<key>` (None when absent)."""
        if architecture not in QWEN35_ARCHS:
            return cls(qwen=False)
        value_heads = int(scalar("ssm.time_step_rank") or 0)
        return cls(qwen=True, key_heads=int(scalar("ssm.group_count") or 0), value_heads=value_heads,
                   key_dim=int(scalar("ssm.state_size") or 0),
                   value_dim=int(scalar("ssm.inner_size") or 0) // max(value_heads, 1))

    def _grouped(self, head_dim: int) -> torch.Tensor:
        """Index into llama.cpp's tiled value heads [r, K, head_dim] of each grouped position [K, r, head_dim]."""
        per_key = self.value_heads // self.key_heads
        return torch.arange(self.value_heads * head_dim).reshape(per_key, self.key_heads, head_dim) \
            .transpose(0, 1).reshape(-1)

    def row_order(self, name: str) -> torch.Tensor | None:
        """Stored row of each of transformers' rows (None: as stored) of a reordered Qwen3.5 tensor."""
        if not self.qwen or self.value_heads == self.key_heads or ".linear_attn." not in name:
            return None
        qk = 2 * self.key_heads * self.key_dim  # in_proj_qkv / conv1d rows: q | k, then the value heads
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            return torch.cat([torch.arange(qk), qk + self._grouped(self.value_dim)])
        if name.endswith("in_proj_z.weight"):
            return self._grouped(self.value_dim)
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            return self._grouped(1)
        return None

    def column_order(self, name: str) -> torch.Tensor | None:
        """Stored column of each of transformers' columns: out_proj reads the value heads (head_v_dim each)."""
        if self.qwen and self.value_heads != self.key_heads and name.endswith("linear_attn.out_proj.weight"):
            return self._grouped(self.value_dim)
        return None

    def restore(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor as read from the file (fp32, dequantized) -> transformers' values and shape."""
        rows, columns = self.row_order(name), self.column_order(name)
        if rows is not None:
            tensor = tensor[rows]
        if columns is not None:
            tensor = tensor[:, columns]
        if name.endswith("A_log"):
            tensor = torch.log(-tensor)  # stored as -exp(A_log)
        elif self.qwen and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = tensor - 1.0  # stored as 1 + w
        if name.endswith(("linear_attn.conv1d.weight", "conv.conv.weight")):
            tensor = tensor.unsqueeze(1)  # [channels, taps] -> transformers' Conv1d [channels, 1, taps]
        return tensor.contiguous()


def config_values(architecture: str, scalar, array, tensor_shapes: dict[str, tuple[int, ...]]) -> dict:
    """Config keys of a qwen35 / lfm2 GGUF header as transformers' Qwen3_5TextConfig / Lfm2Config name them.
    scalar(key) / array(key): the header's `<architecture>.<key>` (None when absent); tensor_shapes: GGUF name ->
    shape in transformers' order ([rows, columns])."""
    def need(key: str):
        value = scalar(key)
        if value is None:
            raise ValueError(f"{architecture} GGUF: its header lacks {architecture}.{key}, which llama.cpp's "
                             "converter writes; re-convert the model with a current convert_hf_to_gguf.py")
        return value

    layers = int(need("block_count")) - int(scalar("nextn_predict_layers") or 0)  # Qwen3.5's MTP blocks: not run
    values = dict(num_hidden_layers=layers, hidden_size=int(need("embedding_length")),
                  num_attention_heads=int(need("attention.head_count")),
                  max_position_embeddings=int(need("context_length")))
    theta = _decimal(need("rope.freq_base"))
    eps = _decimal(need("attention.layer_norm_rms_epsilon"))
    if architecture in LFM2_ARCHS:
        kv = array("attention.head_count_kv") or [int(need("attention.head_count_kv"))] * layers
        gate = tensor_shapes.get("blk.0.ffn_gate.weight")
        return {**values, "model_type": "lfm2", "norm_eps": eps, "rope_parameters": dict(rope_type="default",
                rope_theta=theta), "num_key_value_heads": max(int(n) for n in kv),
                "layer_types": ["full_attention" if int(n) else "conv" for n in kv],
                "conv_L_cache": int(need("shortconv.l_cache")),
                "conv_bias": any(name.endswith("shortconv.in_proj.bias") for name in tensor_shapes),
                # the width the tensors have, which transformers builds as it is without the auto adjustment
                "intermediate_size": int(gate[0]) if gate else int(need("feed_forward_length")),
                "block_auto_adjust_ff_dim": False}
    head_dim = int(need("attention.key_length"))
    interval = int(need("full_attention_interval"))
    value_heads = int(need("ssm.time_step_rank"))
    rotary = int(need("rope.dimension_count"))
    return {**values, "model_type": "qwen3_5_text", "rms_norm_eps": eps, "head_dim": head_dim,
            "intermediate_size": int(need("feed_forward_length")),
            "num_key_value_heads": int(need("attention.head_count_kv")),
            "rope_parameters": dict(rope_type="default", rope_theta=theta, partial_rotary_factor=rotary / head_dim),
            "layer_types": ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)],
            "linear_conv_kernel_dim": int(need("ssm.conv_kernel")), "linear_key_head_dim": int(need("ssm.state_size")),
            "linear_num_key_heads": int(need("ssm.group_count")), "linear_num_value_heads": value_heads,
            "linear_value_head_dim": int(need("ssm.inner_size")) // value_heads}



def _decimal(stored: float) -> float:
    """A header float32 as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07): the value the
    converter was given, as the config holds it."""
    return float(str(np.float32(stored)))
