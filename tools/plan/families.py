"""What each model family adds to the Llama shape, for planning: norms per layer, q/k norms, the layer split into
full and sliding attention, and the defaults a family's config.json may leave to transformers' config class.

Families (as transformers builds them; only the weights and the KV cache matter here):
  llama, mistral, qwen2, smollm3   2 RMSNorms per layer (input, post-attention); qwen2 adds q/k/v biases
  qwen3                            + q_norm and k_norm per layer (an RMSNorm over each head's D: 2 x D weights)
  phi3 (Phi-3/3.5, Phi-4-mini)     the checkpoint fuses qkv_proj and gate_up_proj (same parameter count as the
                                   split projections); partial_rotary_factor only changes which dims rotate
  gemma2                           4 RMSNorms per layer (input, post_attention, pre_feedforward, post_feedforward),
                                   every other layer sliding (layer i sliding when (i + 1) % 2 != 0)
  gemma3 / gemma3_text             as gemma2 plus q/k norms; layer i sliding unless (i + 1) % pattern == 0 (pattern
                                   6 by default: 5 of every 6 layers on `sliding_window`)
  qwen3_5_text (Qwen3.5), lfm2     hybrids: `linear_attention` / `conv` layers keep a fixed state per sequence
                                   (state_layout.py) and their own projections; q/k norms on the attention layers
                                   (Qwen3.5's q_proj twice as wide: the output gate)
  gemma4 / gemma4_text (E2B, E4B)  Gemma 3's norms plus: full layers at their own head dim (global_head_dim), the
                                   last num_kv_shared_layers layers read an earlier layer's K/V (q/o projections and
                                   q_norm only; MLP doubled with use_double_wide_mlp), per-layer inputs (a gate and a
                                   projection of P per layer, a [vocab_per_layer, layers x P] table), a layer scalar
Gemma ties its embeddings and takes head_dim from the config (256 for Gemma-3-4B, not hidden / heads = 320).
A `layer_types` list ("sliding_attention" / "full_attention"), where a config has one, wins over the rules.

Gemma-3-4B's config.json is a multimodal Gemma3ForConditionalGeneration config ("gemma3" outside, the decoder
under "text_config" as "gemma3_text", a SigLIP "vision_config" beside it): plan reads the text part and ignores
the vision tower (oval-edge serves text only), and says so in the shape's notes.
"""

from __future__ import annotations

from oval_edge.runtime.model.families.gemma4 import GEMMA4_DEFAULTS, GEMMA4_TYPES, gemma4_fields
from oval_edge.runtime.model.families.gemma4_gguf import GEMMA4_GGUF_ARCHS, config_values, decoder_tensors
from oval_edge.runtime.model.grouped.gguf_blocks import is_stored_projection
from oval_edge.runtime.model.families.hybrid import HYBRID_TYPES, hybrid_fields
from oval_edge.runtime.model.origin.source import SUPPORTED_ARCHITECTURES as PLANNED_ARCHITECTURES  # the loader's list

GEMMA = ("gemma2", "gemma3", "gemma3_text") + GEMMA4_TYPES
QK_NORM = ("qwen3", "gemma3", "gemma3_text", "qwen3_5_text", "lfm2") + GEMMA4_TYPES
# what Gemma 4 adds to the shape, as families/gemma4.py's gemma4_fields reads it (DecoderConfig's names)
GEMMA4_SHAPE_KEYS = ("global_head_dim", "num_kv_shared_layers", "hidden_size_per_layer_input",
                     "vocab_size_per_layer_input", "use_double_wide_mlp")

# transformers' config-class defaults for keys the published configs leave out (Gemma-3-4B's text_config names
# only hidden/intermediate size, layers, rope scaling and the window). Checked against transformers' classes by
# tests/test_plan_families.py::test_family_defaults_are_transformers_defaults.
CONFIG_DEFAULTS = {
    "gemma2": {"vocab_size": 256000, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "max_position_embeddings": 8192, "sliding_window": 4096, "tie_word_embeddings": True},
    "gemma3_text": {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "sliding_window": 4096, "sliding_window_pattern": 6,
                    "tie_word_embeddings": True},
}
SLIDING_KINDS = {"sliding_attention": "sliding", "full_attention": "full"}
# A hybrid's (Qwen3.5, LFM2) layers that keep a fixed state per sequence instead of K/V (oval_edge/state_layout.py)
STATE_KINDS = {"linear_attention": "state", "conv": "state", "full_attention": "full"}


def text_part(config: dict, path: str) -> tuple[dict, list[str]]:
    """The decoder's config (a multimodal config's "text_config", with its family's defaults filled in) and notes
    on what was left out."""
    notes: list[str] = []
    outer = config.get("model_type")
    text = config.get("text_config")
    if isinstance(text, dict):
        skipped = [k for k in ("vision_config", "audio_config") if k in config]
        notes.append(f"read the decoder from text_config ({outer} -> {text.get('model_type')}); "
                     f"{' and '.join(skipped) or 'nothing else'} ignored: oval-edge serves text only")
        # The outer config carries tie_word_embeddings for the whole model (Gemma3Config); the text part wins.
        text = {"tie_word_embeddings": config["tie_word_embeddings"]} | text if "tie_word_embeddings" in config \
            else dict(text)
        text.setdefault("model_type", f"{outer}_text" if outer else None)
        config = text
    elif text is not None:
        raise ValueError(f"{path}: 'text_config' must be a JSON object, got {type(text).__name__}")
    arch = config.get("model_type")
    defaults = CONFIG_DEFAULTS.get("gemma3_text" if arch == "gemma3" else arch, {})
    filled = [k for k in defaults if k not in config]
    if filled:
        notes.append(f"{arch} defaults (transformers' config class) for {', '.join(filled)}")
    return defaults | config, notes


def hybrid_config(config: dict) -> dict:
    """A Qwen3.5 / LFM2 text config as the loader reads it (runtime/model/families/hybrid.py: transformers' defaults,
    LFM2's MLP width, layer_types filled in), so plan counts what the loader builds."""
    merged, fields = hybrid_fields(config)
    return merged | {"layer_types": list(fields["layer_types"])} | {
        k: v for k, v in fields.items() if k.startswith(("linear_", "conv_"))} | {
        "attn_output_gate": bool(fields.get("attn_output_gate"))}


def gemma4_config(config: dict, path: str) -> tuple[dict, list[str]]:
    """A Gemma 4 text config as the loader reads it (runtime/model/families/gemma4.py: Gemma4TextConfig's defaults,
    layer_types with the last layer full, the full layers' head dim also from transformers 5's per_layer_config),
    and a note naming the defaults filled in."""
    given = set(k for k, v in config.items() if v is not None) | (  # transformers 5 saves the full head dim there
        {"global_head_dim"} if config.get("per_layer_config") else set())
    filled = [k for k in ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim") + GEMMA4_SHAPE_KEYS
              if k not in given and k in GEMMA4_DEFAULTS]
    merged, fields = gemma4_fields(config, path)
    notes = [f"gemma4_text defaults (transformers' config class) for {', '.join(filled)}"] if filled else []
    return merged | {"layer_types": list(fields["layer_types"])} | {k: fields[k] for k in GEMMA4_SHAPE_KEYS}, notes


def gemma4_gguf_config(reader, path: str, scalar, array) -> tuple[dict, list]:
    """A Gemma 4 GGUF (llama.cpp's gemma4) as the loader reads it: its header as Gemma4TextConfig keys
    (families/gemma4_gguf.config_values, the vocabulary and the tie added as runtime/model/gguf_metadata.py adds
    them), and the tensors the loader holds as projections in the file's blocks: the decoder layers' (a shared layer's
    stored K/V left out, as decoder_tensors leaves it) and the per-layer model projection. scalar(key) / array(key):
    the header's `gemma4.<key>`, None when absent."""
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # transformers' order
    try:  # rope_freqs' values only set the rotation, no byte: the header alone is read (`pull` plans from it)
        values = config_values(scalar, array, shapes, None)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    values.update(vocab_size=len(tokens.data) if tokens is not None else scalar("vocab_size"),
                  tie_word_embeddings="output.weight" not in shapes)
    kept = decoder_tensors(reader, path, scalar).values()
    return values, [t for t in kept if is_stored_projection(t) or t.name == "per_layer_model_proj.weight"]


def norms_per_layer(arch: str) -> int:
    """RMSNorm weight vectors of `hidden` per decoder layer."""
    return 4 if arch in GEMMA else 2


def layer_kinds(arch: str, layers: int, window: int | None, config: dict | None = None,
                max_context: int = 0) -> tuple[str, ...]:
    """'full' or 'sliding' per layer: Gemma's rules or the config's layer_types. Only a window below the model's
    context binds (else every layer is full)."""
    config = config or {}
    types = config.get("layer_types")
    if arch in HYBRID_TYPES:  # hybrid_config filled layer_types; no sliding layers in these families
        if not isinstance(types, list) or len(types) != layers or any(t not in STATE_KINDS for t in types):
            raise ValueError(f"layer_types must list {layers} of {', '.join(STATE_KINDS)}, got {types!r}")
        return tuple(STATE_KINDS[t] for t in types)
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or any(t not in SLIDING_KINDS for t in types):
            raise ValueError(f"layer_types must list {layers} of {', '.join(SLIDING_KINDS)}, got {types!r}")
        kinds = tuple(SLIDING_KINDS[t] for t in types)
    elif arch == "gemma2":
        kinds = tuple("sliding" if (i + 1) % 2 else "full" for i in range(layers))
    elif arch in ("gemma3", "gemma3_text"):
        pattern = config.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
        kinds = tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers))
    else:  # Llama, Qwen, Phi: every layer full (a Mistral v0.1 / Phi-3-mini-4k window is counted as full: over)
        kinds = ("full",) * layers
    binds = bool(window) and (not max_context or window < max_context)
    return kinds if binds else ("full",) * layers
