"""Write a model as a GGUF file the way llama.cpp's convert_hf_to_gguf names it (tests' checkpoints, bench's
synthetic model).

Tensors are stored under llama.cpp's names, in F32 unless a quantized type is asked for; for the `llama`
architecture family q/k rows are permuted into llama.cpp's interleaved rotary order (Qwen models are stored as is).
Qwen3.5 (`qwen35`) and LFM2 (`lfm2`) take their header keys and tensor changes from hybrid.py, Gemma 4 (`gemma4`)
from gemma4.py. A matrix whose rows are not whole blocks of the quantized type asked for is stored F16, as the
converter falls back.
The tokenizer fields are copied from the bundled SmolLM2 GGUF, so the file tokenizes exactly as the bundled model
does (the tiny test models use that vocabulary too).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from . import gemma4, hybrid
from .gemma4 import EMBEDDING_TABLES, GEMMA4_ARCHITECTURE
from .hybrid import HYBRID_ARCHITECTURES

LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3: fused as in the checkpoint
}
# Gemma: four norms per layer under their own names, each stored as 1 + w (convert_hf_to_gguf adds the 1)
GEMMA_LAYER_NAMES = {**LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA = ("gemma2", "gemma3")
PERMUTED = ("llama", "smollm3")  # architectures whose q/k llama.cpp stores in its interleaved rotary order


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' rotate_half rows -> llama.cpp's interleaved rows (convert_hf_to_gguf's permute)."""
    out, cols = weight.shape
    return weight.view(heads, 2, out // heads // 2, cols).transpose(1, 2).reshape(out, cols)


def write_gguf(model, path: str, architecture: str, projection_type: str = "F32") -> str:
    """A transformers model's config and state dict as GGUF (see write_gguf_tensors)."""
    return write_gguf_tensors(model.config, model.state_dict().items(), path, architecture, projection_type)


def write_gguf_tensors(config, tensors: Iterable[tuple[str, torch.Tensor]], path: str, architecture: str,
                       projection_type: str = "F32", embedding_type: str = "F32", model_name: str | None = None) -> str:
    """config: a transformers config (its sizes become the header); tensors: (transformers name, tensor) pairs,
    e.g. a state dict's items or a generator that makes each tensor only when asked (the writer keeps only the
    encoded bytes). projection_type: how the decoder layers' projection matrices are stored ("F32", or a GGML type
    gguf's quantizer writes, e.g. "Q4_1", "Q8_0"); embedding_type: the same for the token embedding; everything
    else (norms) is F32. model_name: general.name (a synthetic model says so there)."""
    import gguf

    from oval_edge.runtime.model.origin.source import bundled_gguf_path

    writer = gguf.GGUFWriter(path, architecture)
    if model_name:
        writer.add_name(model_name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    if architecture in HYBRID_ARCHITECTURES:
        hybrid.add_header(writer, config, architecture)
    elif architecture == GEMMA4_ARCHITECTURE:
        gemma4.add_header(writer, config)
    else:
        _add_header(writer, config, architecture)
    _copy_tokenizer(writer, gguf.GGUFReader(bundled_gguf_path()))
    names = GEMMA_LAYER_NAMES if architecture in GEMMA else LAYER_NAMES
    for name, tensor in tensors:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if architecture in HYBRID_ARCHITECTURES or architecture == GEMMA4_ARCHITECTURE:
            pairs = gemma4.converted(config, name, tensor) if architecture == GEMMA4_ARCHITECTURE else \
                hybrid.converted(config, architecture, name, tensor)
            for gguf_name, data, quantized in pairs:
                stored = projection_type if quantized else embedding_type if gguf_name in EMBEDDING_TABLES else "F32"
                _add_tensor(writer, gguf_name, data, stored)
            continue
        tensor = tensor.detach().float()
        if architecture in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = _permute(tensor, heads)
        if architecture in GEMMA and name.endswith("norm.weight"):
            tensor = tensor + 1.0
        data = np.ascontiguousarray(tensor.numpy())
        is_projection = name.startswith("model.layers.") and "norm" not in name and data.ndim == 2
        stored = projection_type if is_projection else embedding_type if name == "model.embed_tokens.weight" else "F32"
        _add_tensor(writer, _gguf_name(name, names), data, stored)
    if architecture == GEMMA4_ARCHITECTURE:
        for gguf_name, data in gemma4.extra_tensors(config):
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_header(writer, config, architecture: str) -> None:
    """The Llama-shaped families' header keys besides the sizes every family has (Gemma's window and soft-caps,
    Phi-3's rope)."""
    import gguf

    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters
    if architecture in GEMMA:
        writer.add_sliding_window(config.sliding_window)
    if architecture == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", config.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", config.final_logit_softcapping)
    if architecture == "gemma3":  # the full layers' rope (the sliding ones' base is fixed at 10000 by llama.cpp)
        rope = rope["full_attention"]
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if architecture == "phi3":
        _add_phi3_rope(writer, config)


def _add_tensor(writer, gguf_name: str, data: np.ndarray, stored: str) -> None:
    """One tensor, F32 as it is or quantized by gguf's quantizer to the GGML type `stored`."""
    import gguf

    if stored == "F32":
        writer.add_tensor(gguf_name, data)
        return
    kind = gguf.GGMLQuantizationType[stored]
    try:
        quantized = gguf.quants.quantize(data, kind)
    except gguf.QuantError:  # rows that are not whole blocks: convert_hf_to_gguf falls back to F16
        kind = gguf.GGMLQuantizationType.F16
        quantized = gguf.quants.quantize(data, kind)
    writer.add_tensor(gguf_name, quantized, raw_dtype=kind)


def _add_phi3_rope(writer, config) -> None:
    """What llama.cpp's Phi3MiniModel converter writes besides the common keys: the rotary dims (from hidden / heads
    and partial_rotary_factor), the pretraining context, the sliding window (0 for none) and, for LongRoPE, its
    attention factor (sqrt(1 + ln(scale) / ln(original)), scale = max / original positions) and both factor
    sets as the tensors rope_factors_long / rope_factors_short."""
    import math

    rope = config.rope_parameters
    original = config.original_max_position_embeddings
    heads = config.num_attention_heads
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size) // heads)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("rope_type") != "longrope":
        return
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    for kind in ("long", "short"):
        writer.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], dtype=np.float32))


def _gguf_name(name: str, layer_names: dict) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    _, _, index, rest = name.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{layer_names[module]}.{kind}"


def _copy_tokenizer(writer, reader) -> None:
    """The bundled GGUF's tokenizer.* fields, value for value."""
    import gguf

    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            item = field.types[1]
            values = [_value(field.parts[i], item) for i in field.data]
            writer.add_array(key, values)
        else:
            writer.add_key_value(key, _value(field.parts[field.data[0]], kind), kind)


def _value(part, kind):
    import gguf

    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if kind == gguf.GGUFValueType.BOOL:
        return bool(part[0])
    return part[0].item()
