"""Gemma 4 (text: E2B, E4B) as DecoderConfig fields, from transformers-named config keys (Gemma4TextConfig).

What it adds to Gemma 3's shape (transformers' modeling_gemma4.py):
- two head sizes: sliding layers `head_dim` (256), full layers `global_head_dim` (512); the full layers rotate with
  "proportional" RoPE (theta 1e6): the first partial_rotary_factor (0.25) of each head's frequency pairs turn, at
  base^(-2i / head_dim), the rest have frequency 0 (they pass through), over the whole head;
- KV sharing: the last `num_kv_shared_layers` layers compute only their queries and attend to the K/V of the last
  earlier layer of their kind (oval_edge.geometry.kv_sharing); those layers' MLPs are twice as wide when
  `use_double_wide_mlp`;
- per-layer inputs (PLE): a second embedding [vocab_per_layer, layers * P] (scaled by sqrt(P)) plus a projection of
  the scaled token embedding (times hidden^-0.5, RMS-normed per layer), summed and scaled by 2^-0.5; after its MLP
  each layer adds post_norm(W_proj(gelu(W_gate(h)) * input_l)), then multiplies the residual by `layer_scalar`;
- norms multiply by w (no 1 + w), the values are RMS-normed without a scale, attention logits are not scaled (1.0),
  q/k heads normed, the final logits soft-capped (30).
Values a config.json leaves out take Gemma4TextConfig's defaults (GEMMA4_DEFAULTS), as from_pretrained would.
The 26B/31B variants (mixture of experts, keys shared as values, other KV heads on full layers) are refused.
"""

from __future__ import annotations

GEMMA4_TYPES = ("gemma4_text",)
GEMMA4_DEFAULTS = dict(vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, global_head_dim=512,
                       hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, sliding_window=512, final_logit_softcapping=None,
                       vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, attention_k_eq_v=False,
                       num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False,
                       bos_token_id=2, eos_token_id=1)
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0}}


def gemma4_text_part(d: dict) -> dict:
    """A multimodal Gemma 4 config ({"model_type": "gemma4", "text_config": {...}}) -> its text decoder's (the vision
    and audio towers are not run); any other config as it is."""
    if d.get("model_type") != "gemma4":
        return d
    text = d.get("text_config")
    return {**(text if isinstance(text, dict) else d), "model_type": "gemma4_text"}


def gemma4_fields(d: dict, where: str) -> tuple[dict, dict]:
    """(d with Gemma4TextConfig's defaults, DecoderConfig fields of a Gemma 4 text config plus the full layers' rope
    under "global_rope", which the caller pops)."""
    d = {**GEMMA4_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    for flag, what in (("enable_moe_block", "mixture-of-experts layers (Gemma 4 26B-A4B)"),
                       ("attention_k_eq_v", "keys used as values (Gemma 4 31B)")):
        if d.get(flag):
            raise ValueError(f"model {where}: {what} are not supported; Gemma 4 E2B and E4B are")
    if d.get("use_bidirectional_attention") == "all":
        raise ValueError(f"model {where}: bidirectional attention over all tokens is not a decoder; not supported")
    layers = int(d["num_hidden_layers"])
    types = list(d.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                          for i in range(layers)])
    types[-1] = "full_attention"  # as Gemma4TextConfig forces it
    rope = {**DEFAULT_ROPE, **(d.get("rope_parameters") or {})}
    local, full = dict(rope["sliding_attention"]), dict(rope["full_attention"])
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"model {where}: Gemma 4 sliding layers with rope_type={local['rope_type']!r} are not "
                         "supported")
    if full.get("rope_type", "default") not in ("default", "proportional"):
        raise ValueError(f"model {where}: Gemma 4 full layers with rope_type={full['rope_type']!r} are not supported")
    global_rope = {"rope_theta": float(full.get("rope_theta", 1000000.0))}
    if full.get("rope_type") == "proportional":  # the factor keeps the whole head (config.rotary_inv_freq)
        global_rope.update(rope_type="proportional", rope_proportion=float(full.get("partial_rotary_factor", 1.0)),
                           factor=float(full.get("factor", 1.0)))
    head_dim, full_dim = int(d["head_dim"]), int(d.get("global_head_dim") or d["head_dim"])
    overrides = d.get("per_layer_config")  # how transformers 5 saves it: {layer: {"head_dim": .., ...}}
    if isinstance(overrides, dict) and overrides:
        full_dims = {int(o.get("head_dim", head_dim)) for i, o in overrides.items() if types[int(i)] == "full_attention"}
        kv = {int(o["num_key_value_heads"]) for o in overrides.values() if "num_key_value_heads" in o}
        slid = {int(o.get("head_dim", head_dim)) for i, o in overrides.items() if types[int(i)] != "full_attention"}
        if len(full_dims) > 1 or slid - {head_dim} or kv - {int(d["num_key_value_heads"])}:
            raise ValueError(f"model {where}: per_layer_config {overrides} gives the layers of one kind different "
                             "head sizes or KV heads; one head size per kind and one KV head count are supported")
        full_dim = full_dims.pop() if full_dims else head_dim
    return d, dict(
        norm_offset=0.0, sandwich_norms=True, embedding_scale=float(d["hidden_size"]) ** 0.5, attention_scale=1.0,
        final_softcap=float(d.get("final_logit_softcapping") or 0.0), layer_types=tuple(types),
        sliding_window=int(d["sliding_window"]), local_rope_theta=float(local.get("rope_theta", 10000.0)),
        global_rope=global_rope, qk_norm=True, value_norm=True,
        global_head_dim=full_dim,
        num_kv_shared_layers=int(d.get("num_kv_shared_layers") or 0),
        hidden_size_per_layer_input=int(d.get("hidden_size_per_layer_input") or 0),
        vocab_size_per_layer_input=int(d.get("vocab_size_per_layer_input") or d["vocab_size"]),
        use_double_wide_mlp=bool(d.get("use_double_wide_mlp")),
    )
