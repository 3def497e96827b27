"""Assemble a DecoderModel from a weight stream, quantizing each layer as soon as its tensors are read.

Only one decoder layer is ever held in 16 bits: its q/k/v (and gate/up) rows are stacked and quantized as one
4-bit layer (bitsandbytes quantizes blocks of 64 consecutive weights, so with rows a multiple of 64 long every
row gets exactly the codes it would get alone), then dropped. The embedding and the head are one int8 table each in
4-bit modes, else kept in 16 bits (embeddings.py), and shared when the model ties them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .config import DecoderConfig
from .decoder import (DecoderAttention, DecoderLayer, DecoderMLP, DecoderModel, DecoderStack, LinearAttention,
                      PerLayerEmbedding, PerLayerInput, RMSNorm, ShortConv)
from .families.hybrid import HYBRID_TYPES, RenamedWeights
from .embeddings import (Int8Embedding, Int8Head, StoredEmbedding, StoredHead, int8_head_applies, int8_table_applies,
                         int8_table_from_rows)
from .heap import release_heap
from .grouped.gguf_blocks import FALLBACK
from .grouped.linear import grouped_projection
from .grouped.layout import quantize_grouped
from .quantize import linear4bit, pack_for_cpu

BNB_QUANTS = ("nf4", "fp4")
GROUP_BLOCK, BNB_BLOCK = 32, 64  # the input width a row must be a multiple of: grouped codes; bitsandbytes on a CPU

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_REQUIRED = {"attention": ("self_attn.o_proj.weight", "mlp.down_proj.weight"),
             "linear_attention": ("linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias",
                                  "linear_attn.norm.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight"),
             "conv": ("conv.conv1d.weight", "conv.in_proj.weight", "conv.out_proj.weight", "mlp.down_proj.weight")}
# Qwen3.5's fused DeltaNet input projections (decoder.LinearAttention): rows q | k | v | z, and b | a
_LINEAR_PARTS = ["in_proj_qkv", "in_proj_z"]
_GATE_PARTS = ["in_proj_b", "in_proj_a"]
_LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_SANDWICH_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")  # Gemma
# The q/k/v and gate/up projections, stored apart (Llama, Qwen, SmolLM) or already fused in the checkpoint (Phi-3:
# qkv_proj [(Hq + 2 Hkv) D, hidden] rows q | k | v, gate_up_proj [2 I, hidden] rows gate | up), read as they are.
_ATTENTION_PARTS = (["q_proj", "k_proj", "v_proj"], ["qkv_proj"])
_MLP_PARTS = (["gate_proj", "up_proj"], ["gate_up_proj"])


def build_decoder(weights, config: DecoderConfig, quant: str, device: torch.device, dtype: torch.dtype,
                  storage: torch.dtype) -> DecoderModel:
    """weights: runtime.model.weight_stream.GGUFWeights / SafetensorsWeights. dtype: activations and norms; storage:
    what the 16-bit tensors are kept (and, for 4-bit, quantized) from."""
    if config.model_type in HYBRID_TYPES:  # LFM2's names as Llama's; a multimodal checkpoint's text decoder only
        weights = RenamedWeights(weights, config.model_type)
    names = set(weights.names())
    where = weights.path
    per_layer: dict[int, set[str]] = {}
    for name in names:
        match = _LAYER.match(name)
        if match:
            per_layer.setdefault(int(match.group(1)), set()).add(match.group(2))
    if sorted(per_layer) != list(range(config.num_hidden_layers)):
        raise ValueError(f"model {where}: weights hold layers {sorted(per_layer)[:4]}..., its configuration says "
                         f"{config.num_hidden_layers}")
    for required in ("model.embed_tokens.weight", "model.norm.weight"):
        if required not in names:
            raise ValueError(f"model {where}: the weights lack {required}")

    def read(name: str, as_dtype: torch.dtype = storage) -> torch.Tensor:
        return weights.read(name, as_dtype)

    # Gemma's (1 + w), folded into the stored weight here, unless the file already holds 1 + w (llama.cpp's GGUF)
    offset = 0.0 if getattr(weights, "norms_folded", False) else config.norm_offset

    def norm(name: str) -> RMSNorm:
        """An RMSNorm whose stored weight is offset + w, computed in fp32 as Gemma computes (1 + w)."""
        weight = read(name, torch.float32)
        return RMSNorm((weight + offset if offset else weight).to(device=device, dtype=dtype), config.rms_norm_eps)

    shapes = _projection_shapes(config, 0)  # rebound per layer below: Gemma 4's layers differ in D and MLP width

    def projection(parts: list[str], prefix: str, exact: bool = False) -> nn.Module:
        """One (fused) projection of the stored `parts`; a part "name:half" is the query or gate rows of a gated
        attention's q_proj (_gate_rows). exact: kept as read (16/32 bits) unless the file stores it quantized."""
        expected = (sum(shapes[p][0] for p in parts), shapes[parts[0]][1])
        if any(":" in p for p in parts):
            return _split_projection(parts, prefix)
        biases = [f"{prefix}{p}.bias" for p in parts]
        if any(b in names for b in biases) and not all(b in names for b in biases):
            raise ValueError(f"model {where}: {prefix}{parts} have biases on some projections only")
        has_bias = all(b in names for b in biases)
        # Rows narrower than every 4-bit layout's block (32 values; bitsandbytes' CPU packing: 64) stay as read: a
        # tiny model's per-layer input projection (llama.cpp stores such rows in 16 bits too)
        mode = "none" if expected[1] % (BNB_BLOCK if quant in BNB_QUANTS else GROUP_BLOCK) else quant
        if mode == "gguf":  # the file's own blocks, never held in 16 bits
            bias = torch.cat([read(b, dtype) for b in biases]).to(device) if has_bias else None
            module = grouped_projection([_grouped_part(weights, f"{prefix}{p}.weight") for p in parts], bias, device)
            shape = [module.out_features, module.in_features]
        else:
            weight = torch.cat([read(f"{prefix}{p}.weight") for p in parts])  # [sum of outs, in]
            shape = list(weight.shape)
        if tuple(shape) != expected:
            raise ValueError(f"model {where}: {prefix}{'+'.join(parts)} has shape {shape}, its "
                             f"configuration says {list(expected)}; the weights and config.json do not match")
        if mode == "gguf":
            return module
        bias = torch.cat([read(b) for b in biases]) if has_bias else None
        return _projection(weight, bias, "none" if exact else mode, dtype, storage, device)

    def _split_projection(parts: list[str], prefix: str) -> nn.Module:
        """A fused projection whose parts include row halves of a stored tensor ("q_proj:query" / "q_proj:gate"):
        16-bit rows are sliced before quantizing; a GGUF's blocks are sliced by row (rows are independent)."""
        pieces = []
        for part in parts:
            stored, _, half = part.partition(":")
            rows = _gate_rows(shapes[part][0], config.head_dim, half) if half else None
            if quant == "gguf":
                codes, scales, mins, bits, origin = _grouped_part(weights, f"{prefix}{stored}.weight")
                pieces.append((codes, scales, mins, bits, origin) if rows is None else
                              (codes[rows], scales[rows], None if mins is None else mins[rows], bits, origin))
            else:
                weight = read(f"{prefix}{stored}.weight")
                pieces.append(weight if rows is None else weight[rows])
        if quant == "gguf":
            return grouped_projection(pieces, None, device)
        return _projection(torch.cat(pieces), None, quant, dtype, storage, device)

    def state_mixer(kind: str, prefix: str) -> nn.Module:
        """A hybrid's state layer: Qwen3.5's Gated DeltaNet or LFM2's short conv (decoder.py)."""
        def conv_weight(name: str) -> torch.Tensor:  # [C, 1, K] as stored by nn.Conv1d -> [C, K]
            weight = read(name, torch.float32)
            return weight.reshape(weight.shape[0], weight.shape[-1]).to(device=device, dtype=dtype)

        if kind == "conv":
            bias = f"{prefix}conv1d.bias"
            return ShortConv(projection(["in_proj"], prefix), conv_weight(f"{prefix}conv1d.weight"),
                             read(bias, torch.float32).to(device=device, dtype=dtype) if bias in names else None,
                             projection(["out_proj"], prefix))
        vector = lambda name: read(prefix + name, torch.float32).to(device)  # noqa: E731
        # b | a set each head's write strength and decay (through a sigmoid and an exp of a softplus): 2 Hv rows,
        # kept as read rather than rounded to 4 bits (a few hundred KB for a 4B model)
        return LinearAttention(projection(_LINEAR_PARTS, prefix), projection(_GATE_PARTS, prefix, exact=True),
                               conv_weight(f"{prefix}conv1d.weight"),
                               vector("dt_bias"), vector("A_log"), vector("norm.weight").to(dtype),
                               projection(["out_proj"], prefix), config.linear_num_key_heads,
                               config.linear_num_value_heads, config.linear_key_head_dim,
                               config.linear_value_head_dim, config.rms_norm_eps)

    def attention_layer(index: int, prefix: str, parts: list[str]) -> DecoderAttention:
        stored = per_layer[index]
        source = config.kv_source(index)
        head_dim, value_eps = config.layer_head_dim(index), config.rms_norm_eps if config.value_norm else 0.0
        if source != index:  # Gemma 4: only queries here; keys and values are layer `source`'s
            q_norm = norm(prefix + "self_attn.q_norm.weight") if config.qk_norm else None
            return DecoderAttention(projection(["q_proj"], prefix + "self_attn."),
                                    projection(["o_proj"], prefix + "self_attn."), q_norm, None, True, False,
                                    head_dim, source, value_eps)
        head_norms = [f"self_attn.{n}.weight" for n in ("q_norm", "k_norm")] if config.qk_norm else []
        if any(n not in stored for n in head_norms):
            raise ValueError(f"model {where}: layer {index} lacks {' or '.join(head_norms)} ({config.model_type} "
                             "normalizes each query and key head)")
        q_norm, k_norm = (norm(prefix + n) for n in head_norms) if head_norms else (None, None)
        if config.attn_output_gate:  # Qwen3.5: q_proj's rows interleave each head's query and gate: fused q|k|v|gate
            if parts != ["q_proj", "k_proj", "v_proj"]:
                raise ValueError(f"model {where}: layer {index}: a gated attention needs q_proj, k_proj and v_proj")
            parts = ["q_proj:query", "k_proj", "v_proj", "q_proj:gate"]
        return DecoderAttention(projection(parts, prefix + "self_attn."), projection(["o_proj"], prefix + "self_attn."),
                                q_norm, k_norm, config.uses_rope(index), config.attn_output_gate, head_dim, -1,
                                value_eps)

    def per_layer_input(prefix: str) -> PerLayerInput | None:
        """Gemma 4's per-layer input block of a layer (decoder.PerLayerInput), or None without per-layer inputs."""
        if not config.hidden_size_per_layer_input:
            return None
        return PerLayerInput(projection(["per_layer_input_gate"], prefix), projection(["per_layer_projection"], prefix),
                             norm(prefix + "post_per_layer_input_norm.weight"))

    layers = []
    for index in range(config.num_hidden_layers):
        shapes = _projection_shapes(config, index)
        kind = config.layer_kind(index)
        kind = kind if config.is_state_layer(index) else "attention"
        attention_parts = _stored_parts(_ATTENTION_PARTS, "self_attn.", per_layer[index])
        if config.kv_source(index) != index:  # a Gemma 4 layer reading another's K/V stores its q_proj only
            attention_parts = ["q_proj"] if "self_attn.q_proj.weight" in per_layer[index] else None
        mlp_parts = _stored_parts(_MLP_PARTS, "mlp.", per_layer[index])
        missing = [r for r in _REQUIRED[kind] if r not in per_layer[index]]
        missing += [] if attention_parts or kind != "attention" else ["self_attn.q_proj/k_proj/v_proj (or qkv_proj)"]
        missing += [] if mlp_parts else ["mlp.gate_proj/up_proj (or gate_up_proj)"]
        if kind == "linear_attention":
            missing += [f"linear_attn.{p}.weight" for p in _LINEAR_PARTS + _GATE_PARTS
                        if f"linear_attn.{p}.weight" not in per_layer[index]]
        if missing:
            what = f" (a {kind.replace('_', ' ')} layer)" if kind != "attention" else ""
            raise ValueError(f"model {where}: layer {index} lacks {', '.join(missing)}{what}")
        prefix = f"model.layers.{index}."
        if kind != "attention":
            attention = state_mixer(kind, prefix + ("conv." if kind == "conv" else "linear_attn."))
        else:
            attention = attention_layer(index, prefix, attention_parts)
        mlp = DecoderMLP(projection(mlp_parts, prefix + "mlp."),
                         projection(["down_proj"], prefix + "mlp."), config.hidden_act)
        layer_norms = _LAYER_NORMS + (_SANDWICH_NORMS if config.sandwich_norms else ())
        missing = [n for n in layer_norms if n not in per_layer[index]]
        if missing:
            raise ValueError(f"model {where}: layer {index} lacks {', '.join(missing)} ({config.model_type} norms "
                             "the attention and MLP outputs too)")
        norms = [norm(prefix + n) for n in layer_norms]
        scalar = prefix + "layer_scalar"
        layers.append(DecoderLayer(attention, mlp, *norms, per_layer_input(prefix),
                                   read(scalar, torch.float32).to(device=device, dtype=dtype) if scalar in names
                                   else None))
        if quant in BNB_QUANTS and device.type == "cpu":
            pack_for_cpu(layers[-1])  # repacking leaves the unpacked copies behind: trim them layer by layer
        release_heap()  # glibc would keep every layer's freed 16-bit copies mapped until the end
    untied = "lm_head.weight" in names and not config.tie_word_embeddings
    embed, head = _embedding_and_head(weights, read, untied, quant, device, dtype)
    factors = read("rope_freqs", torch.float32) if "rope_freqs" in names else None
    per_layer_inputs = None
    if config.hidden_size_per_layer_input:  # Gemma 4's second embedding and its projection of the first
        table_name = "model.embed_tokens_per_layer.weight"
        if table_name not in names:
            raise ValueError(f"model {where}: the weights lack {table_name} (per-layer inputs)")
        shapes = _projection_shapes(config, 0)
        per_layer_inputs = PerLayerEmbedding(
            _embedding_table(weights, read, table_name, quant, device, dtype),
            projection(["per_layer_model_projection"], "model."), norm("model.per_layer_projection_norm.weight"),
            config.num_hidden_layers, config.hidden_size_per_layer_input)
    stack = DecoderStack(config, embed, layers, norm("model.norm.weight"), factors, per_layer_inputs)
    for rotary in (stack.rotary_emb, getattr(stack, "rotary_emb_local", None)):
        if rotary is not None:  # everything else was created on `device`; .to() would touch the 4-bit params
            rotary.to(device)
    return DecoderModel(config, stack, head).eval().requires_grad_(False)


def _stored_parts(choices: tuple[list[str], ...], module: str, stored: set[str]) -> list[str] | None:
    """Which of the ways to store a fused projection this layer uses (its tensors all present), or None."""
    for parts in choices:
        if all(f"{module}{p}.weight" in stored for p in parts):
            return parts
    return None


def _projection_shapes(config: DecoderConfig, layer: int) -> dict[str, tuple[int, int]]:
    """[out, in] of each projection the configuration implies for layer `layer`, stored apart or fused (a hybrid's
    state layers' too: Qwen3.5's DeltaNet projections, LFM2's conv in/out projections; Gemma 4's per-layer input
    projections)."""
    d = config.layer_head_dim(layer)
    hq, hkv = config.num_attention_heads * d, config.num_key_value_heads * d
    hidden, inner = config.hidden_size, config.layer_intermediate(layer)
    shapes = {"q_proj": (hq, hidden), "k_proj": (hkv, hidden), "v_proj": (hkv, hidden),
              "qkv_proj": (hq + 2 * hkv, hidden), "o_proj": (hidden, hq), "gate_proj": (inner, hidden),
              "up_proj": (inner, hidden), "gate_up_proj": (2 * inner, hidden), "down_proj": (hidden, inner),
              "in_proj": (3 * hidden, hidden), "out_proj": (hidden, hidden)}
    if config.hidden_size_per_layer_input:
        width = config.hidden_size_per_layer_input
        shapes.update({"per_layer_input_gate": (width, hidden), "per_layer_projection": (hidden, width),
                       "per_layer_model_projection": (config.num_hidden_layers * width, hidden)})
    if config.attn_output_gate:
        shapes.update({"q_proj:query": (hq, hidden), "q_proj:gate": (hq, hidden)})
    if config.linear_num_value_heads:
        keys, values = config.linear_num_key_heads * config.linear_key_head_dim, \
            config.linear_num_value_heads * config.linear_value_head_dim
        heads = config.linear_num_value_heads
        shapes.update({"in_proj_qkv": (2 * keys + values, hidden), "in_proj_z": (values, hidden),
                       "in_proj_b": (heads, hidden), "in_proj_a": (heads, hidden), "out_proj": (hidden, values)})
    return shapes


def _gate_rows(rows: int, head_dim: int, half: str) -> torch.Tensor:
    """The rows of a gated attention's q_proj [heads * 2 D, in] that are each head's query ("query") or its gate
    ("gate"): head h's query is rows [2 h D, 2 h D + D), its gate the next D (transformers' Qwen3_5Attention views
    the output as [heads, 2 D] and splits it in halves). rows: the half's row count, heads * D."""
    heads = rows // head_dim
    start = torch.arange(heads)[:, None] * 2 * head_dim + (head_dim if half == "gate" else 0)
    return (start + torch.arange(head_dim)).reshape(-1)


def _embedding_and_head(weights, read, untied: bool, quant: str, device: torch.device, dtype: torch.dtype):
    """The embedding and the head: in 4-bit modes one int8 table each (one in all when tied; the CPU's panel layout
    or CUDA's row-major one, embeddings.py says why), built from row slices of the file where the stream offers them,
    the head returning fp32 logits; else kept in 16 bits, the head then sharing the embedding's tensor when tied.
    On CUDA without the int8 head's kernel (embeddings.int8_head_applies) the head stays in 16 bits: an untied
    model keeps its int8 embedding beside it, a tied one one 16-bit table for both."""
    names = ["model.embed_tokens.weight"] + (["lm_head.weight"] if untied else [])
    if quant != "none":
        sources = [_row_source(weights, read, name) for name in names]  # (read_rows, vocab, hidden) each
        hidden = sources[0][2]
        int8_head = int8_head_applies(hidden, device, dtype)
        if int8_table_applies(hidden, device) and (int8_head or untied):
            embed = Int8Embedding(int8_table_from_rows(*sources[0], device), dtype)
            if not int8_head:
                return embed, StoredHead(nn.Parameter(read(names[1]).to(device), requires_grad=False), dtype)
            table = embed.table if not untied else int8_table_from_rows(*sources[1], device)
            return embed, Int8Head(table, torch.float32)
    embed = StoredEmbedding(read(names[0]).to(device), dtype)  # [vocab, hidden]
    if untied:
        return embed, StoredHead(nn.Parameter(read(names[1]).to(device), requires_grad=False), dtype)
    return embed, StoredHead(embed.weight, dtype)


def _embedding_table(weights, read, name: str, quant: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A lookup-only table (Gemma 4's per-layer inputs): int8 in 4-bit modes where the token embedding's would be
    (embeddings.int8_table_applies), read by row slices; else kept in 16 bits."""
    if quant != "none":
        source = _row_source(weights, read, name)
        if int8_table_applies(source[2], device):
            return Int8Embedding(int8_table_from_rows(*source, device), dtype)
    return StoredEmbedding(read(name).to(device), dtype)


def _row_source(weights, read, name: str):
    """(read_rows(start, stop) -> fp32 rows, vocab, hidden) of a 2-D tensor: slices of the file where the stream
    reads rows (GGUF, safetensors), else slices of the tensor read whole (a plain state dict)."""
    if hasattr(weights, "read_rows"):
        hidden = weights.read_rows(name, torch.float32, 0, 1).shape[1]
        return (lambda a, b: weights.read_rows(name, torch.float32, a, b)), weights.rows(name), hidden
    whole = read(name)
    return (lambda a, b: whole[a:b]), whole.shape[0], whole.shape[1]


def _grouped_part(weights, name: str) -> tuple:
    """(codes, scales, mins, bits, origin) of one stored projection: its own blocks where gguf_blocks has a form for
    its type, else its dequantized weights re-quantized to gguf_blocks.FALLBACK (origin says which)."""
    stored = weights.stored_type(name) if hasattr(weights, "stored_type") else "float"
    grouped = weights.read_grouped(name) if hasattr(weights, "read_grouped") else None
    if grouped is not None:
        return (*grouped, stored)
    bits, group = FALLBACK
    codes, scales, mins = quantize_grouped(weights.read(name, torch.float32), bits, group)
    return codes, scales, mins, bits, f"{stored}->int{bits}"


def _projection(weight: torch.Tensor, bias: torch.Tensor | None, quant: str, dtype: torch.dtype,
                storage: torch.dtype, device: torch.device) -> nn.Module:
    if quant == "int4":  # 4-bit codes, scale and min per 32 (grouped/layout.py), from the weights as read
        codes, scales, mins = quantize_grouped(weight, 4, 32)
        return grouped_projection([(codes, scales, mins, 4, "int4")],
                                  None if bias is None else bias.to(device=device, dtype=dtype), device)
    if quant in BNB_QUANTS:
        return linear4bit(weight, bias, quant, compute_dtype=storage, device=device)
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
    return linear
