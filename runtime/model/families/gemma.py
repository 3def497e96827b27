"""Gemma 2 and Gemma 3 (text) as DecoderConfig fields, from transformers-named config keys.

What they add to the Llama shape (transformers' modeling_gemma2.py / modeling_gemma3.py):
- RMSNorm scales by (1 + w) in fp32: the loader folds the 1 into the stored weight (norm_offset), so the runtime's
  one RMSNorm computes it; llama.cpp's converter already folded it into a GGUF's norms (offset 0 there).
- four norms per layer: the attention and MLP outputs are normed before their residual adds (sandwich_norms);
- the embedding is multiplied by sqrt(hidden) (a tied head uses the unscaled table);
- the MLP gate is tanh-GELU (GeGLU); attention is scaled by query_pre_attn_scalar ** -0.5;
- Gemma 2: tanh soft-capping of the attention logits (50) and of the final logits (30);
- sliding-window layers: Gemma 2 every other layer (4096 tokens), Gemma 3 five of every six (1024 for the 4B), as
  `layer_types` or Gemma 3's older `sliding_window_pattern`; Gemma 3's sliding layers rotate with their own base
  (rope_local_base_freq, 10000) and no scaling, its full layers with rope_theta (1e6) and rope_scaling;
- Gemma 3 also norms each query and key head (qk_norm, (1 + w) as well).
Values a config.json leaves out take transformers' config-class defaults (GEMMA_DEFAULTS), as from_pretrained would.
"""

from __future__ import annotations

GEMMA_TYPES = ("gemma2", "gemma3_text")
# transformers' Gemma2Config / Gemma3TextConfig defaults for the keys the published configs omit
GEMMA_DEFAULTS = {
    "gemma2": dict(vocab_size=256000, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                   max_position_embeddings=8192, rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0, bos_token_id=2, eos_token_id=1),
    "gemma3_text": dict(vocab_size=262208, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        max_position_embeddings=131072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                        sliding_window=4096, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                        rope_theta=1000000.0, rope_local_base_freq=10000.0, bos_token_id=2, eos_token_id=1),
}


def text_part(d: dict) -> dict:
    """A multimodal Gemma 3 config ({"model_type": "gemma3", "text_config": {...}}) -> its decoder's config (the
    vision tower is not run); any other config as it is."""
    if d.get("model_type") == "gemma3":  # a GGUF header read by transformers says gemma3 with no text_config
        text = d.get("text_config")
        return {**(text if isinstance(text, dict) else d), "model_type": "gemma3_text"}
    return d


def with_defaults(d: dict) -> dict:
    return {**GEMMA_DEFAULTS[d["model_type"]], **{k: v for k, v in d.items() if v is not None}}


def gemma_fields(d: dict) -> dict:
    """DecoderConfig fields of a Gemma 2/3 config `d` (defaults already merged: with_defaults), plus the full
    layers' rope parameters under "global_rope" (the caller pops it)."""
    kind, layers = d["model_type"], int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if not types:
        pattern = 2 if kind == "gemma2" else int(d.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    rope = d.get("rope_parameters") or {}
    full_rope, local_theta = dict(rope), 0.0
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5: one entry per layer type
        full_rope = dict(rope.get("full_attention") or {})
        local = dict(rope.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma sliding layers with rope_type={local['rope_type']!r} are not supported")
        local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
    elif kind == "gemma3_text":
        full_rope = dict(d.get("rope_scaling") or {})
        full_rope.setdefault("rope_theta", d.get("rope_theta", 1000000.0))
        local_theta = float(d.get("rope_local_base_freq", 10000.0))
    window = int(d.get("sliding_window") or 0)
    return dict(
        norm_offset=1.0, sandwich_norms=True, embedding_scale=float(d["hidden_size"]) ** 0.5,
        attention_scale=float(d["query_pre_attn_scalar"]) ** -0.5,
        attn_softcap=float(d.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(d.get("final_logit_softcapping") or 0.0),
        layer_types=tuple(types) if window else (), sliding_window=window,
        local_rope_theta=local_theta if kind == "gemma3_text" else 0.0, global_rope=full_rope,
    )
