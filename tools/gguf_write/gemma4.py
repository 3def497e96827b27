"""Gemma 4's text decoder (`gemma4`) written as llama.cpp's convert_hf_to_gguf writes it: the header keys of its
TextModel / Gemma3Model / Gemma4Model set_gguf_parameters, the ROPE_FREQS tensor of Gemma4Model's
generate_extra_tensors, and the tensor names of the `gguf` package's own GEMMA4 tensor map (llama.cpp's gguf-py
tensor_mapping.py). The runtime's reader (runtime/model/families/gemma4_gguf.py) undoes what is changed; this module
is written apart from it so a test round trip checks the reader against the converter's behaviour.

What the converter does with a Gemma4ForCausalLM state dict:
- names only: every tensor keeps transformers' values and layout. Gemma 4's RMSNorm scales by w (norm_shift 0.0:
  no 1 + w as for Gemma 2/3); layer_scalar [1] becomes blk.N.layer_output_scale.weight; the per-layer embedding
  table [vocab, layers * per_layer_width] and per_layer_model_projection [layers * per_layer_width, hidden] are
  stored as they are (llama.cpp applies sqrt(width) and the 1/sqrt scales at run time, like transformers).
- the KV-shared layers hold what the checkpoint holds: in transformers 5 no k_proj / v_proj / k_norm.
- rope_freqs.weight [global_head_dim / 2]: 1.0 for the rotated pairs of the full layers' proportional RoPE, 1e30
  (no rotation) for the rest; the full layers then rotate the whole head (rope.dimension_count = global_head_dim).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

GEMMA4_ARCHITECTURE = "gemma4"
UNROTATED_FREQ_FACTOR = 1e30  # the converter's factor for the dims proportional RoPE leaves unrotated
EMBEDDING_TABLES = ("token_embd.weight", "per_layer_token_embd.weight")  # stored as the writer's embedding_type


def full_layer_overrides(hparams: dict) -> dict:
    """What the full-attention layers change (head_dim, and num_key_value_heads where overridden; None where not):
    transformers 5 keeps config.json's global_head_dim / num_global_key_value_heads only as per_layer_config
    entries."""
    full = [i for i, kind in enumerate(hparams["layer_types"]) if kind == "full_attention"]
    if not full:
        raise ValueError("a Gemma 4 config needs at least one full_attention layer (its last layer is one)")
    overrides = hparams.get("per_layer_config") or {}
    entry = overrides.get(str(full[0]), overrides.get(full[0], {}))
    heads = entry.get("num_key_value_heads")
    return {"head_dim": int(entry.get("head_dim", hparams["head_dim"])),
            "num_key_value_heads": None if heads is None else int(heads)}


def add_header(writer, config) -> None:
    """The header keys the converter writes for a Gemma4TextConfig besides the sizes every family has (the writer's:
    context, width, heads, vocabulary), each with the value that wins where the converter writes a key twice
    (Gemma4Model's head dims, FFN widths and kv heads over TextModel's / Gemma3Model's). Read from the config's dict,
    as the converter reads config.json: Gemma4TextConfig refuses per-layer attributes (head_dim) as attributes."""
    hparams = config.to_dict()
    layers, head_dim, kv_heads = hparams["num_hidden_layers"], hparams["head_dim"], hparams["num_key_value_heads"]
    swa = [kind == "sliding_attention" for kind in hparams["layer_types"]]
    full = full_layer_overrides(hparams)
    rope = hparams["rope_parameters"]
    writer.add_block_count(layers)
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    if hparams.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
    writer.add_sliding_window(hparams["sliding_window"])
    writer.add_shared_kv_layers(hparams["num_kv_shared_layers"])
    writer.add_embedding_length_per_layer_input(hparams.get("hidden_size_per_layer_input") or 0)
    writer.add_sliding_window_pattern(swa)
    writer.add_key_length(full["head_dim"])
    writer.add_value_length(full["head_dim"])
    writer.add_key_length_swa(head_dim)
    writer.add_value_length_swa(head_dim)
    first_shared = layers - hparams["num_kv_shared_layers"]
    width = hparams["intermediate_size"]
    if hparams.get("use_double_wide_mlp"):  # the shared layers' MLPs are twice as wide
        writer.add_feed_forward_length([width * (2 if i >= first_shared else 1) for i in range(layers)])
    else:
        writer.add_feed_forward_length(width)
    if full["num_key_value_heads"] is not None:  # config.json's num_global_key_value_heads
        writer.add_head_count_kv([kv_heads if is_swa else full["num_key_value_heads"] for is_swa in swa])
    else:
        writer.add_head_count_kv(kv_heads)
    # the full layers rotate the whole head (rope_freqs switches the rest off); the sliding layers' partial factor
    # is read from the top-level hparams, which a transformers 5 config.json does not have: 1.0
    writer.add_rope_dimension_count(full["head_dim"])
    writer.add_rope_dimension_count_swa(head_dim)


def extra_tensors(config) -> Iterator[tuple[str, np.ndarray]]:
    """generate_extra_tensors: rope_freqs.weight, the full layers' frequency factors [global_head_dim / 2]."""
    hparams = config.to_dict()
    full = hparams["rope_parameters"]["full_attention"]
    if full.get("rope_type") != "proportional":
        raise ValueError(f"full_attention rope_type {full.get('rope_type')!r}: llama.cpp's converter takes only "
                         "'proportional' for Gemma 4 (it asserts so); use rope_type='proportional'")
    head_dim = full_layer_overrides(hparams)["head_dim"]
    rotated = int(head_dim * full.get("partial_rotary_factor", 1.0) / 2)
    yield "rope_freqs.weight", np.array([1.0] * rotated + [UNROTATED_FREQ_FACTOR] * (head_dim // 2 - rotated),
                                        np.float32)


def converted(config, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, np.ndarray, bool]]:
    """(GGUF name, fp32 data, whether a quantized conversion quantizes it) for one of transformers' tensors."""
    import gguf

    gguf_name = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config.num_hidden_layers) \
        .get_name(name + (".weight" if name.endswith(".layer_scalar") else ""), try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise ValueError(f"{name}: llama.cpp's gemma4 tensor map has no name for it")
    data = np.ascontiguousarray(tensor.detach().float().numpy())
    # the converter quantizes every 2-D matrix but the norms; here the embedding tables follow embedding_type and an
    # untied head stays F32, as the writer keeps them for every family
    quantized = data.ndim == 2 and not gguf_name.endswith("norm.weight") \
        and gguf_name not in (*EMBEDDING_TABLES, "output.weight")
    yield gguf_name, data, quantized
