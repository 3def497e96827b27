"""Qwen3.5 (`qwen35`) and LFM2 (`lfm2`) written as llama.cpp's convert_hf_to_gguf writes them: the header keys and
the tensor changes of its Qwen3NextModel / _LinearAttentionVReorderBase / _Qwen35MRopeMixin and LFM2Model classes,
with the names from the `gguf` package's own tensor map (llama.cpp's gguf-py tensor_mapping.py). The runtime's
reader (runtime/model/families/hybrid_gguf.py) undoes each change; this module is written apart from it so a test
round trip checks the reader against the converter's behaviour, not against itself.
"""

from __future__ import annotations

import re
from typing import Iterator

import numpy as np
import torch

HYBRID_ARCHITECTURES = ("qwen35", "lfm2")
# llama.cpp's qwen35 loader requires rope.dimension_sections; the converter writes this default when the config has
# no mrope_section (text-only positions make the sections equal plain RoPE)
DEFAULT_MROPE_SECTIONS = [11, 11, 10, 0]
_ALWAYS_F32 = ("ssm_conv1d.weight", "shortconv.conv.weight")  # the converter keeps the convolutions in F32


def add_header(writer, config, architecture: str) -> None:
    """The header keys the converter writes for a Qwen3_5TextConfig / Lfm2Config besides the sizes every family has
    (the writer's: context, width, heads, vocabulary). A Qwen3.5 config with mtp_num_hidden_layers (its
    config.json's multi-token-prediction blocks) counts them in block_count, as _Qwen35MtpMixin does."""
    mtp = _mtp_layers(config, architecture)
    writer.add_block_count(config.num_hidden_layers + mtp)
    if mtp:
        writer.add_nextn_predict_layers(mtp)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    if architecture == "lfm2":  # head_count_kv per layer, 0 for the convolutions
        writer.add_head_count_kv([0 if kind == "conv" else config.num_key_value_heads for kind in config.layer_types])
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_shortconv_l_cache(config.conv_L_cache)
        writer.add_feed_forward_length(_lfm2_feed_forward_length(config))
        return
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_full_attention_interval(_full_attention_interval(config.layer_types))
    rope = config.rope_parameters
    writer.add_rope_dimension_count(int(config.head_dim * rope.get("partial_rotary_factor", 0.25)))
    sections = list(rope.get("mrope_section") or [])
    writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)) if sections else DEFAULT_MROPE_SECTIONS)


def converted(config, architecture: str, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, np.ndarray, bool]]:
    """(GGUF name, fp32 data, whether the converter quantizes it) for one of transformers' tensors."""
    import gguf

    tensor = tensor.detach().float()
    if architecture == "qwen35" and name.startswith("mtp."):
        name = _mtp_renamed(config, name)
    if architecture == "qwen35":
        tensor = _tiled_value_heads(config, name, tensor)
        if name.endswith(".A_log"):
            tensor = -torch.exp(tensor)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = tensor + 1  # transformers' Qwen3.5 RMSNorm scales by 1 + w, llama.cpp's by the stored weight
    if name.endswith(("conv1d.weight", "conv.conv.weight")):
        tensor = tensor.squeeze(1)  # [channels, 1, taps] -> [channels, taps]
    kind = gguf.MODEL_ARCH.QWEN35 if architecture == "qwen35" else gguf.MODEL_ARCH.LFM2
    blocks = config.num_hidden_layers + _mtp_layers(config, architecture)
    gguf_name = gguf.get_tensor_name_map(kind, blocks).get_name(name, try_suffixes=(".weight", ".bias")) \
        or _nextn_name(name)
    if gguf_name is None:
        raise ValueError(f"{name}: llama.cpp's {architecture} tensor map has no name for it")
    data = np.ascontiguousarray(tensor.numpy())
    quantized = (gguf_name.startswith("blk.") and data.ndim == 2 and not gguf_name.endswith("_norm.weight")
                 and not gguf_name.endswith(_ALWAYS_F32))
    yield gguf_name, data, quantized


def _tiled_value_heads(config, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """_LinearAttentionVReorderBase: with fewer key than value heads, the value heads of every DeltaNet tensor go
    from transformers' grouped-by-key-head order to llama.cpp's tiled order (its broadcast repeats key heads)."""
    keys, values = config.linear_num_key_heads, config.linear_num_value_heads
    if keys == values or ".linear_attn." not in name:
        return tensor
    per_key, value_dim = values // keys, config.linear_value_head_dim

    def tile(part: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        shape = list(part.shape)
        split = shape[:dim] + [keys, per_key, head_dim] + shape[dim + 1:]
        return part.reshape(split).transpose(dim, dim + 1).reshape(shape)

    qk = 2 * keys * config.linear_key_head_dim  # q | k rows (channels) ahead of the value heads
    if name.endswith("in_proj_qkv.weight"):
        return torch.cat([tensor[:qk], tile(tensor[qk:], 0, value_dim)])
    if name.endswith("conv1d.weight"):
        flat = tensor.squeeze(1)
        return torch.cat([flat[:qk], tile(flat[qk:], 0, value_dim)]).unsqueeze(1)
    if name.endswith("in_proj_z.weight"):
        return tile(tensor, 0, value_dim)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
        return tile(tensor, 0, 1)
    if name.endswith((".A_log", ".dt_bias")):
        return tile(tensor.unsqueeze(-1), 0, 1).squeeze(-1)
    if name.endswith("out_proj.weight"):
        return tile(tensor, 1, value_dim)
    return tensor


def _mtp_layers(config, architecture: str) -> int:
    return int(getattr(config, "mtp_num_hidden_layers", 0) or 0) if architecture == "qwen35" else 0


# _Qwen35MtpMixin: the multi-token-prediction head's own tensors, as block L's (L = num_hidden_layers)
_MTP_PARTS = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
              "norm": "shared_head.norm"}


def _mtp_renamed(config, name: str) -> str:
    """mtp.layers.N.X -> model.layers.{L + N}.X; mtp.fc / its norms -> model.layers.L.eh_proj / enorm / hnorm /
    shared_head.norm (then converted like the decoder's tensors: the norms get their 1 + w)."""
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[1] == "layers" and parts[2].isdecimal():
        return f"model.layers.{config.num_hidden_layers + int(parts[2])}.{parts[3]}"
    if len(parts) == 3 and parts[1] in _MTP_PARTS:
        return f"model.layers.{config.num_hidden_layers}.{_MTP_PARTS[parts[1]]}.{parts[2]}"
    raise ValueError(f"{name}: not a Qwen3.5 multi-token-prediction tensor llama.cpp's converter knows")


def _nextn_name(name: str) -> str | None:
    """GGUF name of an MTP head tensor (blk.L.nextn.*), which this gguf package's qwen35 tensor map lacks."""
    import gguf

    kinds = {"eh_proj": gguf.MODEL_TENSOR.NEXTN_EH_PROJ, "enorm": gguf.MODEL_TENSOR.NEXTN_ENORM,
             "hnorm": gguf.MODEL_TENSOR.NEXTN_HNORM, "shared_head.norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM}
    match = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
    if match is None or match.group(2) not in kinds:
        return None
    return gguf.TENSOR_NAMES[kinds[match.group(2)]].format(bid=int(match.group(1))) + ".weight"


def _full_attention_interval(layer_types) -> int:
    """llama.cpp's qwen35 keeps only full_attention_interval: every n-th layer is full attention."""
    interval = list(layer_types).index("full_attention") + 1 if "full_attention" in layer_types else 0
    expected = ["linear_attention" if interval and (i + 1) % interval else "full_attention"
                for i in range(len(layer_types))]
    if not interval or list(layer_types) != expected:
        raise ValueError(f"layer_types {list(layer_types)} is not 'every n-th layer full attention', the only "
                         "pattern a qwen35 GGUF can hold (full_attention_interval); use such a pattern")
    return interval


def _lfm2_feed_forward_length(config) -> int:
    """LFM2Model._add_feed_forward_length: 2/3 of intermediate_size, times the multiplier, rounded up to
    block_multiple_of (the rounding applies with no multiplier too, where transformers' Lfm2MLP skips it)."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
        size = config.block_multiple_of * ((size + config.block_multiple_of - 1) // config.block_multiple_of)
    return size
