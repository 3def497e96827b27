"""Gemma 4 text GGUF files (llama.cpp's `gemma4`) read back as transformers holds the model.

llama.cpp's converter (convert_hf_to_gguf: Gemma4Model over Gemma3Model and TextModel) renames the text decoder's
tensors and writes its config as header keys; GGUFWeights lists the tensors under Gemma4ForCausalLM's names (their
shapes and values are stored as transformers has them), and `config_values` turns the header back into the dict
transformers' Gemma4TextConfig takes.

What the converter does, and what is undone:
- Norms: Gemma 4's RMSNorm scales by w, and the converter stores w (norm_shift 0.0; Gemma 2/3 store 1 + w): read
  as they are. v_norm has no weight; nothing is stored for it.
- layer_scalar ([1], a buffer in the state dict) is blk.N.layer_output_scale.weight, stored as it is.
- The per-layer embedding table model.embed_tokens_per_layer [vocab_per_layer, layers * per_layer_width] and
  model.per_layer_model_projection [layers * per_layer_width, hidden] are stored as they are, layer-major along the
  width (llama.cpp reshapes a row to [per_layer_width, layers]); the sqrt(width) / 1/sqrt(hidden) / 1/sqrt(2)
  scales are applied at run time by both, never folded into the weights.
- rope_freqs.weight [global_head_dim / 2], which the converter adds: 1.0 for the pairs the full layers' proportional
  RoPE rotates, 1e30 for the rest (llama.cpp rotates the whole head with those factors). Not a transformers tensor:
  it becomes rope_parameters.full_attention.partial_rotary_factor (rotated pairs * 2 / global_head_dim).
- KV-shared layers (the last attention.shared_kv_layers): transformers has no k_proj / v_proj / k_norm there; a
  file that holds them anyway (a checkpoint that kept them) has them left out, as transformers leaves them out.
- A full layer with attn_k but no attn_v is attention_k_eq_v (the values are the keys).
- Vision and audio towers are written to a separate mmproj GGUF; `v.*` / `a.*` / `mm.*` tensors in a text file are
  not listed.
Header -> config: layer_types from attention.sliding_window_pattern (true: sliding), head_dim / global_head_dim from
attention.key_length_swa / key_length, the kv heads from head_count_kv (one per layer when the config had
num_global_key_value_heads), intermediate_size and use_double_wide_mlp from feed_forward_length (one per layer when
the shared layers' MLPs are double width), rope thetas from rope.freq_base / rope.freq_base_swa.
"""

from __future__ import annotations

import re

import numpy as np

GEMMA4_GGUF_ARCHS = ("gemma4", "gemma4_text")  # llama.cpp's name, then the text config's model_type


def _weights(pairs: dict[str, str]) -> dict[str, str]:
    return {f"{ours}.weight": f"{theirs}.weight" for ours, theirs in pairs.items()}


# GGUF name inside blk.N. -> transformers' name inside model.layers.N.
_LAYER = {
    **_weights({"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
                "post_norm": "post_per_layer_input_norm"}),
    "layer_output_scale.weight": "layer_scalar",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight", "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
           "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
           "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
_SHARED_LAYER_SKIPS = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")  # KV-shared layers have none
_NOT_THE_DECODER = ("v.", "a.", "mm.")  # llama.cpp's vision / audio / projector tensors (an mmproj file's)
ROPE_FREQS = "rope_freqs.weight"
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str) -> str | None:
    """transformers' name of a gemma4 GGUF tensor; None for one that is not a Gemma 4 text decoder tensor."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _BLOCK.match(gguf_name)
    inner = match and _LAYER.get(match.group(2))
    return f"model.layers.{match.group(1)}.{inner}" if inner else None


def decoder_tensors(reader, path: str, scalar) -> dict:
    """{transformers name: GGUFReader tensor} of a gemma4 GGUF's text decoder. scalar(key): the header's
    `gemma4.<key>` (None when absent)."""
    first_shared = int(scalar("block_count") or 0) - int(scalar("attention.shared_kv_layers") or 0)
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS or tensor.name.startswith(_NOT_THE_DECODER):
            continue
        match = _BLOCK.match(tensor.name)
        if match and int(match.group(1)) >= first_shared and match.group(2) in _SHARED_LAYER_SKIPS:
            continue
        name = hf_name(tensor.name)
        if name is None:
            raise ValueError(f"model {path}: tensor {tensor.name!r} is not part of a Gemma 4 text decoder as "
                             "llama.cpp's converter writes it (a mixture-of-experts Gemma 4 is not supported)")
        tensors[name] = tensor
    return tensors


def config_values(scalar, array, tensor_shapes: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None) -> dict:
    """Config keys of a gemma4 GGUF header as transformers' Gemma4TextConfig names them. scalar(key) / array(key):
    the header's `gemma4.<key>` (None when absent); tensor_shapes: GGUF name -> shape in transformers' order;
    rope_freqs: the file's rope_freqs.weight values (None when it has none)."""
    def need(key: str):
        if (value := scalar(key)) is not None:
            return value
        raise ValueError(f"gemma4 GGUF: its header lacks gemma4.{key}, which llama.cpp's converter writes; "
                         "re-convert the model with a current convert_hf_to_gguf.py")

    layers = int(need("block_count"))
    sliding = array("attention.sliding_window_pattern")
    if sliding is None or len(sliding) != layers:
        raise ValueError(f"gemma4 GGUF: gemma4.attention.sliding_window_pattern must hold one flag per layer "
                         f"({layers}), as llama.cpp's converter writes it; got {sliding!r}")
    layer_types = ["sliding_attention" if flag else "full_attention" for flag in sliding]
    shared = int(scalar("attention.shared_kv_layers") or 0)
    head_dim, global_head_dim = int(need("attention.key_length_swa")), int(need("attention.key_length"))
    values = dict(model_type="gemma4_text", num_hidden_layers=layers, layer_types=layer_types,
                  hidden_size=int(need("embedding_length")), num_attention_heads=int(need("attention.head_count")),
                  max_position_embeddings=int(need("context_length")), head_dim=head_dim,
                  global_head_dim=global_head_dim, sliding_window=int(need("attention.sliding_window")),
                  num_kv_shared_layers=shared, rms_norm_eps=_as_given(need("attention.layer_norm_rms_epsilon")),
                  hidden_size_per_layer_input=int(scalar("embedding_length_per_layer_input") or 0))
    softcap = scalar("final_logit_softcapping")
    values["final_logit_softcapping"] = _as_given(softcap) if softcap else None
    table = tensor_shapes.get("per_layer_token_embd.weight")
    if table:
        values["vocab_size_per_layer_input"] = int(table[0])
    values.update(_feed_forward(array("feed_forward_length"), scalar("feed_forward_length"), layers - shared))
    values.update(_kv_heads(layer_types, array("attention.head_count_kv"), scalar("attention.head_count_kv"),
                            _k_eq_v(layer_types, layers - shared, tensor_shapes)))
    values["rope_parameters"] = _rope(scalar, need, head_dim, global_head_dim, rope_freqs)
    return values


def _feed_forward(per_layer: list | None, single, first_shared: int) -> dict:
    """intermediate_size and use_double_wide_mlp: the converter writes one width per layer only for double-wide
    MLPs (the shared layers twice the others)."""
    if per_layer is None:
        if single is None:
            raise ValueError("gemma4 GGUF: its header lacks gemma4.feed_forward_length")
        return {"intermediate_size": int(single), "use_double_wide_mlp": False}
    width = int(per_layer[0])
    expected = [width * (2 if i >= first_shared else 1) for i in range(len(per_layer))]
    if [int(n) for n in per_layer] != expected:
        raise ValueError(f"gemma4 GGUF: feed_forward_length {list(per_layer)} is not one width with the KV-shared "
                         f"layers' twice it ({expected}), the only per-layer widths Gemma4TextConfig can build")
    return {"intermediate_size": width, "use_double_wide_mlp": True}


def _k_eq_v(layer_types: list[str], first_shared: int, tensor_shapes: dict) -> bool:
    """A full layer that computes its own K/V but stores no attn_v uses the keys as values (attention_k_eq_v)."""
    own = [i for i, kind in enumerate(layer_types[:first_shared]) if kind == "full_attention"]
    return bool(own) and all(f"blk.{i}.attn_v.weight" not in tensor_shapes for i in own)


def _kv_heads(layer_types: list[str], per_layer: list | None, single, k_eq_v: bool) -> dict:
    """num_key_value_heads (the sliding layers'), and num_global_key_value_heads where the converter wrote one count
    per layer (it does when config.json has num_global_key_value_heads)."""
    values = {"attention_k_eq_v": k_eq_v}
    if per_layer is None:
        if single is None:
            raise ValueError("gemma4 GGUF: its header lacks gemma4.attention.head_count_kv")
        values["num_key_value_heads"] = int(single)
        return values
    counts = {kind: {int(n) for n, k in zip(per_layer, layer_types) if k == kind} for kind in set(layer_types)}
    if any(len(found) != 1 for found in counts.values()):
        raise ValueError(f"gemma4 GGUF: head_count_kv {list(per_layer)} differs between layers of one kind; "
                         "Gemma4TextConfig holds one count for the sliding and one for the full layers")
    sliding = counts.get("sliding_attention", counts["full_attention"]).pop()
    full = counts["full_attention"].pop()
    values["num_key_value_heads"] = sliding
    if k_eq_v:  # transformers takes num_global_key_value_heads only with attention_k_eq_v
        values["num_global_key_value_heads"] = full
    elif full != sliding:
        raise ValueError(f"gemma4 GGUF: the full layers have {full} kv heads and the sliding ones {sliding}, but "
                         "transformers' Gemma4TextConfig applies num_global_key_value_heads only with "
                         "attention_k_eq_v (no attn_v on the full layers); this file cannot be built as written")
    return values


def _rope(scalar, need, head_dim: int, global_head_dim: int, rope_freqs: np.ndarray | None) -> dict:
    """rope_parameters per layer kind: the full layers' proportional RoPE (its partial factor from rope_freqs) and
    the sliding layers' default RoPE (partial where rope.dimension_count_swa is under head_dim)."""
    if int(need("rope.dimension_count")) != global_head_dim:
        raise ValueError("gemma4 GGUF: rope.dimension_count must equal attention.key_length (the converter rotates "
                         "the full layers' whole head and switches pairs off with rope_freqs)")
    full = dict(rope_type="proportional", rope_theta=_as_given(need("rope.freq_base")), partial_rotary_factor=1.0)
    if rope_freqs is not None:
        factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
        rotated = int((factors == 1.0).sum())
        if factors.size != global_head_dim // 2 or not (factors[:rotated] == 1.0).all() \
                or not (factors[rotated:] > 1e20).all():
            raise ValueError(f"gemma4 GGUF: rope_freqs.weight must be {global_head_dim // 2} factors, 1.0 for the "
                             "rotated pairs then 1e30 for the rest (proportional RoPE, as the converter writes them)")
        full["partial_rotary_factor"] = 2 * rotated / global_head_dim
    sliding = dict(rope_type="default", rope_theta=_as_given(need("rope.freq_base_swa")))
    rotary_swa = int(scalar("rope.dimension_count_swa") or head_dim)
    if rotary_swa != head_dim:
        sliding["partial_rotary_factor"] = rotary_swa / head_dim
    return {"full_attention": full, "sliding_attention": sliding}


def _as_given(stored: float) -> float:
    """A header float32 as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07): the config's value."""
    return float(str(np.float32(stored)))
