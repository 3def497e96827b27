"""Qwen3.5 and LFM2 (text) as DecoderConfig fields, and LFM2's tensor names as the decoder build reads them.

What the hybrids add to the Llama shape (transformers' modeling_qwen3_5.py / modeling_lfm2.py):
- Qwen3.5: three of every four layers are Gated DeltaNet (`linear_attention`): a fused q|k|v|z|b|a projection, a
  causal depthwise conv (kernel 4) with SiLU over q|k|v, the gated delta rule with a fixed-size recurrent state, a
  gated RMSNorm and an output projection. The full-attention layers have head_dim 256, RoPE on the first quarter of
  each head (partial_rotary_factor 0.25), q/k head norms and a sigmoid output gate whose rows sit interleaved with
  the query's in q_proj ([head 0 query | head 0 gate | head 1 query ...]). Its RMSNorms scale by (1 + w) (folded at
  load, as Gemma's); the DeltaNet's gated norm by w. A multimodal checkpoint (`qwen3_5`) holds the text decoder in
  text_config; the vision tower and the multi-token-prediction head are not run.
- LFM2: the layers that are not attention are gated short convs (`conv`): in_proj -> B | C | x, y = C * conv(B * x)
  with a causal depthwise conv of conv_L_cache taps, then out_proj. Attention layers norm q and k per head. The MLP
  size is derived from intermediate_size (block_auto_adjust_ff_dim), the final norm is `embedding_norm`.
Values a config.json leaves out take transformers' config-class defaults, as from_pretrained would.
"""

from __future__ import annotations

HYBRID_TYPES = ("qwen3_5_text", "lfm2")
LFM2_DEFAULTS = dict(vocab_size=65536, hidden_size=2560, intermediate_size=12288, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=128000, norm_eps=1e-5,
                     tie_word_embeddings=True, conv_bias=False, conv_L_cache=3, block_multiple_of=256,
                     block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, rope_theta=1000000.0,
                     bos_token_id=1, eos_token_id=2)
QWEN3_5_DEFAULTS = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_num_key_heads=16, linear_num_value_heads=32, head_dim=256, rms_norm_eps=1e-6,
                        full_attention_interval=4)
# LFM2's names -> the runtime's (transformers' Llama names), per layer and global; the build reads the latter.
LFM2_NAMES = {"operator_norm.": "input_layernorm.", "ffn_norm.": "post_attention_layernorm.",
              "feed_forward.w1.": "mlp.gate_proj.", "feed_forward.w3.": "mlp.up_proj.",
              "feed_forward.w2.": "mlp.down_proj.", "self_attn.out_proj.": "self_attn.o_proj.",
              "self_attn.q_layernorm.": "self_attn.q_norm.", "self_attn.k_layernorm.": "self_attn.k_norm.",
              "conv.conv.": "conv.conv1d."}
LFM2_GLOBAL = {"model.embedding_norm.weight": "model.norm.weight"}
# Tensors of a Qwen3.5 checkpoint that are not the text decoder (the vision tower, multi-token prediction).
NOT_THE_TEXT_DECODER = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def hybrid_text_part(d: dict) -> dict:
    """A multimodal Qwen3.5 config ({"model_type": "qwen3_5", "text_config": {...}}) -> its text decoder's config;
    any other config as it is."""
    if d.get("model_type") in ("qwen3_5", "qwen35"):
        text = d.get("text_config")
        return {**(text if isinstance(text, dict) else d), "model_type": "qwen3_5_text"}
    return d


def hybrid_fields(d: dict) -> tuple[dict, dict]:
    """(config dict with defaults merged, DecoderConfig fields) of a Qwen3.5 text or LFM2 config `d`."""
    kind = d["model_type"]
    if kind == "lfm2":
        d = {**LFM2_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
        # Liquid's own names, which transformers' Lfm2Config maps onto its fields (they win, as there)
        if "block_ff_dim" in d:
            d["intermediate_size"] = d["block_ff_dim"]
        if "tie_embedding" in d:
            d["tie_word_embeddings"] = d["tie_embedding"]
        layers = int(d["num_hidden_layers"])
        types = d.get("layer_types")
        if not types:
            full = set(d.get("full_attn_idxs") or range(layers))
            types = ["full_attention" if i in full else "conv" for i in range(layers)]
        fields = dict(layer_types=tuple(types), conv_L_cache=int(d["conv_L_cache"]), conv_bias=bool(d["conv_bias"]),
                      qk_norm=True)
        d = {**d, "rms_norm_eps": d.get("norm_eps", 1e-5), "intermediate_size": lfm2_ffn_size(d)}
        return d, fields
    d = {**QWEN3_5_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if not types:
        interval = int(d["full_attention_interval"])
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    fields = dict(layer_types=tuple(types), attn_output_gate=True, qk_norm=True, norm_offset=1.0,
                  **{name: int(d[name]) for name in ("linear_num_key_heads", "linear_num_value_heads",
                                                     "linear_key_head_dim", "linear_value_head_dim",
                                                     "linear_conv_kernel_dim")})
    return d, fields


def lfm2_ffn_size(d: dict) -> int:
    """The MLP width transformers' Lfm2MLP builds from the config (2/3 of intermediate_size, times the multiplier,
    rounded up to block_multiple_of), or intermediate_size as it is without block_auto_adjust_ff_dim."""
    size = int(d["intermediate_size"])
    if not d.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = d.get("block_ffn_dim_multiplier")
    if multiplier is not None:
        size = int(multiplier * size)
        step = int(d.get("block_multiple_of", 256))
        size = step * ((size + step - 1) // step)
    return size


class RenamedWeights:
    """A weight stream (weight_stream.py) seen under the runtime's names: LFM2's tensors under Llama's, and a
    multimodal Qwen3.5's text decoder without the tensors that are not run. Every reader method passes through."""

    def __init__(self, weights, model_type: str) -> None:
        self.inner, self.path = weights, weights.path
        self.norms_folded = getattr(weights, "norms_folded", False)
        self._stored: dict[str, str] = {}
        for name in weights.names():
            if name.startswith(NOT_THE_TEXT_DECODER):
                continue
            self._stored[_runtime_name(name) if model_type == "lfm2" else name] = name

    def names(self) -> list[str]:
        return list(self._stored)

    def __getattr__(self, attr: str):
        method = getattr(self.inner, attr)  # read, read_rows, rows, read_grouped, stored_type, close
        if attr in ("read", "read_rows", "rows", "read_grouped", "stored_type"):
            return lambda name, *args: method(self._stored[name], *args)
        return method


def _runtime_name(name: str) -> str:
    if name in LFM2_GLOBAL:
        return LFM2_GLOBAL[name]
    for theirs, ours in LFM2_NAMES.items():
        if f".{theirs}" in name:
            return name.replace(f".{theirs}", f".{ours}", 1)
    return name
