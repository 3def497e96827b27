"""The shape of a Llama-family decoder, read from a GGUF's metadata or a Hugging Face config.json.

Attribute names follow transformers' configs (hidden_size, num_key_value_heads, ...) because the rest of the
runtime, the eval tools and `apply_oval_to_model` read models through those names. Building it does not import
transformers' model classes: their import alone costs ~110 MB of resident memory (sympy, torch.distributed), a
sixth of a small Jetson's budget for serving.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from oval_edge.geometry import kv_sharing

from .families.gemma import GEMMA_TYPES, gemma_fields, text_part, with_defaults
from .families.gemma4 import GEMMA4_TYPES, gemma4_fields, gemma4_text_part
from .families.hybrid import HYBRID_TYPES, hybrid_fields, hybrid_text_part
from .origin.source import check_architecture

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "proportional")
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")  # the MLP's gate activation (Gemma: GeGLU with tanh-gelu)
# full and sliding attention; Qwen3.5's Gated DeltaNet and LFM2's short conv keep a fixed state instead of K/V
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "conv")
STATE_LAYER_TYPES = ("linear_attention", "conv")
UNIFORM_SLIDING = ("mistral", "phi3")  # families whose sliding_window, when it binds, applies to every layer


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3", "factor": 8.0, ...}; {} = plain
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head before RoPE
    rope_layers: tuple[int, ...] = ()  # SmolLM3: 1 where layer i rotates q/k, 0 for a NoPE layer; () = all rotate
    # Gemma 2/3 (gemma_family.py reads them): RMSNorm scales by (offset + w), stored folded at load; norms after the
    # attention and the MLP outputs too ("sandwich"); the embedding times sqrt(hidden); attention scaled by
    # query_pre_attn_scalar^-0.5 instead of head_dim^-0.5; tanh soft-capping of attention and final logits
    # (0: none); sliding-window layers (transformers' layer_types names) with their own RoPE base (0: the same).
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embedding_scale: float = 1.0
    attention_scale: float = 0.0  # 0: head_dim ** -0.5
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer; () = all full
    sliding_window: int = 0
    local_rope_theta: float = 0.0
    partial_rotary_factor: float = 1.0  # Phi-4-mini: 0.75, only the first head_dim * factor dims of a head rotate
    # Hybrids (families/hybrid.py). Qwen3.5: a sigmoid gate on the attention output (its rows in q_proj), the
    # linear-attention layers' sizes; LFM2: the short conv's taps and bias. 0: no such layers.
    attn_output_gate: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    conv_L_cache: int = 0
    conv_bias: bool = False
    # Gemma 4 (families/gemma4.py; transformers' names): the full layers' head dim (0: head_dim), the last layers
    # reading earlier layers' K/V, per-layer inputs of this width (0: none) from a table of this many rows, values
    # RMS-normed without a scale, the shared layers' MLPs twice as wide.
    global_head_dim: int = 0
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    value_norm: bool = False
    use_double_wide_mlp: bool = False
    where: str = ""  # the file or folder it came from, for error messages

    def __post_init__(self) -> None:
        check_architecture(self.model_type, self.where)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.where}: {name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model {self.where}: num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model {self.where}: head_dim={self.head_dim} must be even for rotary embeddings")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"model {self.where}: rope_theta={self.rope_theta!r} must be a positive number")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"model {self.where}: hidden_act={self.hidden_act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        bad_kinds = [kind for kind in self.layer_types if kind not in LAYER_TYPES]
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers or bad_kinds):
            raise ValueError(f"model {self.where}: layer_types={list(self.layer_types)} must name one of "
                             f"{', '.join(LAYER_TYPES)} per layer ({self.num_hidden_layers} layers)")
        if "linear_attention" in self.layer_types:
            sizes = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                     self.linear_value_head_dim)
            if min(sizes) < 1 or self.linear_num_value_heads % self.linear_num_key_heads \
                    or self.linear_conv_kernel_dim < 2:
                raise ValueError(f"model {self.where}: linear-attention layers need key/value heads and dims >= 1 "
                                 f"(got {sizes}), value heads a multiple of key heads and a conv kernel >= 2 (got "
                                 f"{self.linear_conv_kernel_dim})")
        if "conv" in self.layer_types and self.conv_L_cache < 2:
            raise ValueError(f"model {self.where}: short-conv layers need conv_L_cache >= 2, got {self.conv_L_cache}")
        if "sliding_attention" in self.layer_types and self.sliding_window < 1:
            raise ValueError(f"model {self.where}: sliding layers need sliding_window >= 1, got {self.sliding_window}")
        if self.global_head_dim < 0 or self.global_head_dim % 2 or not 0 <= self.num_kv_shared_layers \
                < self.num_hidden_layers or self.hidden_size_per_layer_input < 0:
            raise ValueError(f"model {self.where}: global_head_dim={self.global_head_dim} must be even, "
                             f"num_kv_shared_layers={self.num_kv_shared_layers} below the {self.num_hidden_layers} "
                             f"layers and hidden_size_per_layer_input={self.hidden_size_per_layer_input} >= 0")
        if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input < 1:
            raise ValueError(f"model {self.where}: per-layer inputs need vocab_size_per_layer_input >= 1")
        if self.num_kv_shared_layers:
            kv_sharing(self)  # raises when a shared layer's kind has no earlier layer keeping K/V
        if self.rope_layers and (len(self.rope_layers) != self.num_hidden_layers
                                 or any(flag not in (0, 1) for flag in self.rope_layers)):
            raise ValueError(f"model {self.where}: no_rope_layers={list(self.rope_layers)} must hold one 0 or 1 per "
                             f"layer ({self.num_hidden_layers} layers)")
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"model {self.where}: rope scaling {rope_type!r} is not supported; supported: "
                             f"{', '.join(ROPE_TYPES)}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"model {self.where}: partial_rotary_factor={self.partial_rotary_factor!r} gives "
                             f"{self.rotary_dim} rotary dims of head_dim={self.head_dim}; it must be in (0, 1] and "
                             "leave an even number of dims >= 2")
        if rope_type == "longrope":
            _check_longrope(self)

    def layer_kind(self, layer: int) -> str:
        """What layer `layer` is: one of LAYER_TYPES (full_attention when the model names no kinds)."""
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def is_state_layer(self, layer: int) -> bool:
        """Whether layer `layer` keeps a fixed per-sequence state (oval_edge/state_layout.py) instead of K/V."""
        return self.layer_kind(layer) in STATE_LAYER_TYPES

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends only to its last `sliding_window` positions (its K/V live in a ring)."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def layer_head_dim(self, layer: int) -> int:
        """Layer `layer`'s head dim: Gemma 4's full layers have their own (global_head_dim)."""
        return self.global_head_dim if self.global_head_dim and self.layer_kind(layer) == "full_attention" \
            else self.head_dim

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V layer `layer` attends to: itself, or for a Gemma 4 shared layer its source."""
        if layer < self.num_hidden_layers - self.num_kv_shared_layers:
            return layer
        return dict(kv_sharing(self))[layer]

    def layer_intermediate(self, layer: int) -> int:
        """Layer `layer`'s MLP width: Gemma 4's shared layers' are doubled with use_double_wide_mlp."""
        wide = self.use_double_wide_mlp and self.kv_source(layer) != layer
        return self.intermediate_size * (2 if wide else 1)

    def full_rope(self) -> "DecoderConfig":
        """The rotary shape of the full (and non-sliding) layers: Gemma 4's at their own head dim."""
        if not self.global_head_dim or self.global_head_dim == self.head_dim:
            return self
        return dataclasses.replace(self, head_dim=self.global_head_dim, global_head_dim=0)

    @property
    def scaling(self) -> float:
        """The attention logits' scale."""
        return self.attention_scale or self.head_dim ** -0.5

    def local_rope(self) -> "DecoderConfig | None":
        """The rotary shape of the sliding layers where it differs from the full ones' (Gemma 3: their own base,
        no scaling), else None."""
        if not self.local_rope_theta:
            return None
        return dataclasses.replace(self, rope_theta=self.local_rope_theta, rope_scaling={}, local_rope_theta=0.0)

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates its queries and keys (a NoPE layer caches its keys unrotated)."""
        return not self.rope_layers or bool(self.rope_layers[layer])

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")) if self.rope_scaling \
            else "default"

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rotate (transformers' int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "DecoderConfig":
        """From transformers-named keys: a config.json, or the dict transformers parses out of a GGUF header."""
        d = gemma4_text_part(hybrid_text_part(text_part(d)))
        check_architecture(d.get("model_type"), where)
        try:
            if d["model_type"] in GEMMA_TYPES:
                d = with_defaults(d)
            family = gemma_fields(d) if d["model_type"] in GEMMA_TYPES else {}
            if d["model_type"] in HYBRID_TYPES:
                d, family = hybrid_fields(d)
            if d["model_type"] in GEMMA4_TYPES:
                d, family = gemma4_fields(d, where)
            window = d.get("sliding_window")
            sliding = "sliding_attention" in (d.get("layer_types") or [])
            if not family and window and (d.get("use_sliding_window", True) or sliding) \
                    and window < d.get("max_position_embeddings", 0):
                if d["model_type"] not in UNIFORM_SLIDING:
                    # Qwen2's max_window_layers mixes kinds by a rule not built here: refuse, not attend wrongly.
                    raise ValueError(f"model {where}: sliding-window attention ({window} tokens) is not supported "
                                     f"for {d['model_type']}; use a model without it")
                # Mistral v0.1, Phi-3-mini-4k: every layer on the window, each in a ring (no pages at all)
                family = dict(layer_types=("sliding_attention",) * int(d["num_hidden_layers"]),
                              sliding_window=int(window))
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rope = dict(family.pop("global_rope", None) or d.get("rope_parameters") or d.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
            partial = float(rope.pop("partial_rotary_factor", d.get("partial_rotary_factor") or 1.0))
            if d["model_type"] == "phi3":
                rope = _phi3_rope(rope, d)
            if rope.get("rope_type", rope.get("type")) == "default":
                rope = {}
            kind, layers = d["model_type"], int(d["num_hidden_layers"])
            rope_layers = ()
            if kind == "smollm3":  # transformers' SmolLM3Config: a NoPE layer every no_rope_layer_interval layers
                interval = int(d.get("no_rope_layer_interval") or 4)
                rope_layers = tuple(int(f) for f in (d.get("no_rope_layers")
                                                     or [int((i + 1) % interval != 0) for i in range(layers)]))
            return cls(
                model_type=d["model_type"], vocab_size=int(d["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=rope,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                hidden_act=d.get("hidden_activation") or d.get("hidden_act", "silu"),
                bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
                qk_norm=kind in ("qwen3", "gemma3_text") or bool(family.pop("qk_norm", False)),
                rope_layers=rope_layers, partial_rotary_factor=partial, where=where, **family,
            )
        except KeyError as exc:
            raise ValueError(f"model {where}: its configuration lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ValueError) and str(exc).startswith("model "):
                raise
            raise ValueError(f"model {where}: its configuration is broken ({exc})") from None


def rotary_inv_freq(config: DecoderConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] (float32) as transformers computes them for each rope type but longrope
    (longrope_inv_freq: it needs the context the runtime serves)."""
    d = config.rotary_dim  # head_dim unless the model rotates only part of each head
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    kind, s = config.rope_type, config.rope_scaling
    if kind == "proportional":
        # Gemma 4's full layers: the first proportion of the head's pairs at base^(-2i / D), the rest frequency 0
        # (cos 1, sin 0: they pass through unrotated), as transformers' _compute_proportional_rope_parameters
        turning = int(float(s.get("rope_proportion", 1.0)) * d // 2)
        inv_freq = torch.cat([inv_freq[:turning], torch.zeros(d // 2 - turning)])
        return inv_freq / float(s.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / float(s["factor"])
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
        factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


def _phi3_rope(rope: dict, d: dict) -> dict:
    """Phi-3's rope_scaling as transformers' Phi3Config reads it: the old type name 'su' is longrope, and
    original_max_position_embeddings sits at the top of config.json (transformers copies it in)."""
    rope = dict(rope)
    if rope.get("type") == "su" or rope.get("rope_type") == "su":
        rope.pop("type", None)
        rope["rope_type"] = "longrope"
    if rope.get("rope_type", rope.get("type")) == "longrope" and "original_max_position_embeddings" not in rope:
        if d.get("original_max_position_embeddings") is None:
            raise ValueError("longrope needs original_max_position_embeddings")
        rope["original_max_position_embeddings"] = int(d["original_max_position_embeddings"])
    return rope


def _check_longrope(config: DecoderConfig) -> None:
    s, where, half = config.rope_scaling, config.where, config.rotary_dim // 2
    for name in ("short_factor", "long_factor"):
        factors = s.get(name)
        if not isinstance(factors, (list, tuple)) or len(factors) != half \
                or not all(isinstance(f, (int, float)) and f > 0 for f in factors):
            raise ValueError(f"model {where}: longrope {name} must list {half} positive numbers (one per rotary "
                             f"frequency of {config.rotary_dim} rotary dims), got {factors!r:.80}")
    original = s.get("original_max_position_embeddings")
    if not isinstance(original, int) or original < 2:
        raise ValueError(f"model {where}: longrope original_max_position_embeddings={original!r} must be an "
                         "integer >= 2 (the context the model was pretrained with)")


def longrope_uses_long_factors(config: DecoderConfig, context: int) -> bool:
    """llama.cpp's rule, fixed per loaded model: the long factors when the context served per sequence exceeds the
    pretraining context. (transformers switches by the current length, which would re-rotate keys already cached.)"""
    return context > config.rope_scaling["original_max_position_embeddings"]


def longrope_inv_freq(config: DecoderConfig, long: bool) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32, attention scaling of cos and sin) for LongRoPE, as transformers computes them.

    Each frequency is divided by its factor. The scaling is the config's attention_factor, else
    sqrt(1 + ln(factor) / ln(original)) with factor = the config's, else max_position_embeddings / original; it
    applies to both factor sets.
    """
    s, d = config.rope_scaling, config.rotary_dim
    original = s["original_max_position_embeddings"]
    factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    inv_freq = 1.0 / (factors * config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = s.get("attention_factor")
    if scaling is None:
        factor = float(s.get("factor") or config.max_position_embeddings / original)
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(scaling)
