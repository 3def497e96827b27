"""A model's shape for planning, read without loading weights: a Hugging Face config.json or GGUF metadata.

GGUF keys (llama.cpp's naming, prefixed by `general.architecture`, e.g. "llama."): block_count,
embedding_length, feed_forward_length, attention.head_count, attention.head_count_kv, attention.key_length
(optional head dim), context_length; the vocabulary is the length of tokenizer.ggml.tokens. A GGUF without an
`output.weight` tensor ties the output head to the embedding. Qwen2 GGUFs carry attn_q/k/v biases, Qwen3 and Gemma-3
GGUFs attn_q_norm / attn_k_norm, Gemma GGUFs post_attention_norm and post_ffw_norm (4 norms per layer) and
`{arch}.attention.sliding_window`. What each family adds is in families.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace

from oval_edge.runtime.model.origin.source import bundled_gguf_path

from oval_edge.geometry import kv_sharing
from oval_edge.state_layout import StateLayer, StateLayout, state_layout

from .families import GEMMA4_GGUF_ARCHS, GEMMA4_TYPES, HYBRID_TYPES, PLANNED_ARCHITECTURES, QK_NORM, gemma4_config, \
    gemma4_gguf_config, hybrid_config, layer_kinds, norms_per_layer, text_part

# ModelShape.kinds -> transformers' layer_types, for oval_edge.geometry's formulas (kv_config)
LAYER_TYPE_NAMES = {"full": "full_attention", "sliding": "sliding_attention", "state": "linear_attention"}


@dataclass(frozen=True)
class ModelShape:
    name: str
    path: str
    architecture: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_context: int
    tied_embeddings: bool
    qkv_bias: bool
    source: str  # "GGUF metadata" | "config.json"
    file_bytes: int  # size of the checkpoint on disk (GGUF file; 0 when only a config was given)
    norms_per_layer: int = 2  # RMSNorm vectors of `hidden` per layer: 2 (Llama), 4 (Gemma 2/3)
    qk_norm: bool = False  # q_norm and k_norm per layer (Qwen3, Gemma 3): 2 x head_dim weights
    layer_kinds: tuple[str, ...] = ()  # "full" | "sliding" | "state" per layer; () = every layer full
    sliding_window: int = 0  # tokens a sliding layer attends to (0: none)
    rotary_dim: int = 0  # dims of each head that rotate (partial_rotary_factor); 0 = head_dim
    notes: tuple[str, ...] = ()  # what reading the config left out or filled in
    # a GGUF's decoder projections as stored: (rows, width, GGML type) per tensor; () for a config.json
    stored_projections: tuple[tuple[int, int, str], ...] = ()
    # a hybrid's state layers (oval_edge/state_layout.py; dtype: float32 here, geometry_for sets the target's) and
    # Qwen3.5's attention output gate (q_proj twice as wide)
    states: StateLayout | None = None
    attn_output_gate: bool = False
    # Gemma 4 (families.gemma4_config): the full layers' head dim (0: head_dim), the last layers reading an earlier
    # layer's K/V (oval_edge.geometry.kv_sharing), per-layer inputs of width P (0: none) from a table of
    # per_layer_vocab rows, the shared layers' MLPs twice as wide
    global_head_dim: int = 0
    kv_shared_layers: int = 0
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    double_wide_mlp: bool = False

    def __post_init__(self) -> None:
        if self.layer_kinds and len(self.layer_kinds) != self.layers:
            raise ValueError(f"{self.path}: {len(self.layer_kinds)} layer kinds for {self.layers} layers")
        if self.sliding_layers and self.sliding_window < 1:
            raise ValueError(f"{self.path}: sliding layers need a sliding_window >= 1, got {self.sliding_window}")

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.layer_kinds or ("full",) * self.layers

    @property
    def full_layers(self) -> int:
        """Layers whose KV lives in the page pool (OVAL pages, scored)."""
        return self.kinds.count("full")

    @property
    def sliding_layers(self) -> int:
        """Layers whose KV lives in per-sequence rings (oval_edge/kv/ring.py)."""
        return self.kinds.count("sliding")

    def kv_config(self) -> SimpleNamespace:
        """The shape under transformers' config names, for oval_edge.geometry's kv_dims, ring_layout, ring_head_dim
        and kv_sharing: the pool is sized with the formulas the engine uses (runtime/engine/setup.pool_geometry)."""
        return SimpleNamespace(
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            hidden_size=self.hidden, head_dim=self.head_dim, global_head_dim=self.global_head_dim,
            layer_types=[LAYER_TYPE_NAMES[k] for k in self.kinds], sliding_window=self.sliding_window,
            num_kv_shared_layers=self.kv_shared_layers)

    def kv_sources(self) -> dict[int, int]:
        """{shared layer: the layer whose K/V it reads} (Gemma 4's last kv_shared_layers); {} for other models."""
        return dict(kv_sharing(self.kv_config()))

    def layer_head_dim(self, layer: int) -> int:
        """Layer `layer`'s head dim: Gemma 4's full layers have their own (global_head_dim)."""
        return self.global_head_dim if self.global_head_dim and self.kinds[layer] == "full" else self.head_dim

    def layer_projections(self, layer: int, sources: dict[int, int] | None = None) -> list[tuple[str, int, int]]:
        """(name, out_features N, in_features K) of the nn.Linear layers inside attention layer `layer`, as
        runtime/model/decoder_build.py builds them: a layer reading another's K/V (sources: kv_sources()) has no
        k/v projections and, with double_wide_mlp, an MLP twice as wide; Gemma 4 adds the per-layer input's gate
        (hidden -> P) and projection (P -> hidden)."""
        sources = self.kv_sources() if sources is None else sources
        d = self.layer_head_dim(layer)
        q, kv = self.heads * d, self.kv_heads * d
        h, i = self.hidden, self.intermediate * (2 if self.double_wide_mlp and layer in sources else 1)
        kv_proj = [] if layer in sources else [("k_proj", kv, h), ("v_proj", kv, h)]
        per_layer = [("per_layer_input_gate", self.per_layer_input, h),
                     ("per_layer_projection", h, self.per_layer_input)] if self.per_layer_input else []
        return ([("q_proj", q * (2 if self.attn_output_gate else 1), h)] + kv_proj + [
            ("o_proj", h, q), ("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)] + per_layer)

    def projections(self) -> list[tuple[str, int, int]]:
        """The projections of the largest attention layer (one layer's load and dequantization transients)."""
        sources = self.kv_sources()
        layers = [self.layer_projections(layer, sources) for layer, kind in enumerate(self.kinds) if kind != "state"]
        return max(layers, key=lambda p: sum(n * k for _, n, k in p))

    def all_projections(self) -> list[tuple[str, int, int]]:
        """The quantized projections of every layer: an attention layer's, or a state layer's own (Qwen3.5's fused
        q|k|v|z in and out projections, LFM2's conv in and out projections; runtime/model/decoder_build.py) and
        its MLP; and Gemma 4's model-level projection of the embedding to the per-layer inputs."""
        by_layer = {s.layer: s for s in self.states.layers} if self.states is not None else {}
        sources = self.kv_sources()
        out = []
        for layer in range(self.layers):
            state = by_layer.get(layer)
            out += self.layer_projections(layer, sources) if state is None else self._state_projections(state)
        if self.per_layer_input:
            out.append(("per_layer_model_projection", self.layers * self.per_layer_input, self.hidden))
        return out

    def _state_projections(self, state: StateLayer) -> list[tuple[str, int, int]]:
        h, i = self.hidden, self.intermediate
        mlp = [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]
        if state.kind == "conv":
            return [("in_proj", 3 * h, h), ("out_proj", h, h)] + mlp
        values = state.heads * state.value_dim
        return [("in_proj", state.conv_channels + values, h), ("out_proj", h, values)] + mlp

    def state_exact_parameters(self) -> int:
        """A state layer's weights the loader keeps as read (not 4-bit): Qwen3.5's b | a projection [2 Hv, hidden],
        conv taps [C, K], dt_bias and A_log [Hv], gated-norm weight [dv]; LFM2's conv taps [hidden, K]."""
        total = 0
        for s in self.states.layers if self.states is not None else ():
            total += s.conv_channels * (s.conv_width + 1)
            if s.kind == "linear_attention":
                total += 2 * s.heads * self.hidden + 2 * s.heads + s.value_dim
        return total

    def vector_parameters(self) -> int:
        """Weights kept as vectors in the activation dtype: each layer's RMSNorms of `hidden` (2, or Gemma's 4) and
        the final norm; q_norm on every attention layer and k_norm on those that keep K/V, at the layer's head dim;
        Gemma 4's per-layer input block's output norm [hidden] and layer scalar [1] per layer and its per-layer
        projection norm [P]."""
        sources = self.kv_sources()
        attention = [layer for layer, kind in enumerate(self.kinds) if kind != "state"]
        qk = sum(self.layer_head_dim(layer) * (1 if layer in sources else 2) for layer in attention) \
            if self.qk_norm else 0
        per_layer = self.layers * self.hidden + self.per_layer_input if self.per_layer_input else 0
        scalars = self.layers if self.architecture in GEMMA4_TYPES else 0
        return (self.norms_per_layer * self.layers + 1) * self.hidden + qk + per_layer + scalars

    @property
    def per_layer_table(self) -> int:
        """Values of Gemma 4's per-layer input table [per_layer_vocab, layers x P] (0 without one)."""
        return self.per_layer_vocab * self.layers * self.per_layer_input

    @property
    def parameters(self) -> int:
        biases = self.layers * (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return (sum(n * k for _, n, k in self.all_projections()) + self.state_exact_parameters()
                + self.vector_parameters() + biases + self.per_layer_table
                + self.vocab * self.hidden * (1 if self.tied_embeddings else 2))

    def describe(self) -> str:
        tie = "tied" if self.tied_embeddings else "untied"
        kinds = (f", {self.sliding_layers} of {self.layers} layers sliding on {self.sliding_window} tokens"
                 if self.sliding_layers else "")
        rotary = f", {self.rotary_dim} of {self.head_dim} dims rotate" if self.rotary_dim else ""
        if self.states is not None:
            kinds += (f", {len(self.states.layers)} of {self.layers} layers keep a state "
                      f"({self.states.describe()})")
        if self.kv_shared_layers:
            kinds += f", the last {self.kv_shared_layers} read earlier layers' K/V and keep none"
        if self.per_layer_input:
            kinds += f", per-layer inputs of {self.per_layer_input} from a {self.per_layer_vocab}-row table"
        notes = "".join(f"; {n}" for n in self.notes)
        full = f" (full layers {self.global_head_dim})" if self.global_head_dim not in (0, self.head_dim) else ""
        wide = " (x2 on the shared layers)" if self.double_wide_mlp and self.kv_shared_layers else ""
        return (
            f"{self.name} ({self.architecture}, {self.layers} layers, hidden {self.hidden}, {self.heads} q / "
            f"{self.kv_heads} kv heads x {self.head_dim}{full}, ffn {self.intermediate}{wide}, vocab {self.vocab}, "
            f"{tie} head, "
            f"{self.parameters / 1e6:.0f}M params, max context {self.max_context}{kinds}{rotary}; from {self.source}"
            f"{notes})"
        )


def read_model_shape(model: str | None) -> ModelShape:
    """'default' -> the bundled SmolLM2 GGUF; a .gguf file; a config.json; or a folder holding config.json."""
    if model in (None, "", "default"):
        return _from_gguf(bundled_gguf_path())
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ValueError(f"model path {path} does not exist; pass a .gguf file, a config.json, a Hugging Face "
                         "model folder, or 'default'")
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise ValueError(f"model folder {path} has no config.json; pass a Hugging Face model folder or a .gguf file")
        return _from_config(config)
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ValueError(f"model path {path} cannot be read: {exc.strerror or exc}") from exc
    if magic == b"GGUF":
        return _from_gguf(path)
    return _from_config(path)


def _from_config(path: str) -> ModelShape:
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except OSError as exc:
        raise ValueError(f"model config {path} cannot be read: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"model file {path} is neither a GGUF file nor a JSON config.json ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"model config {path} is not a JSON object")
    folder = os.path.dirname(path)
    name = os.path.basename(folder) if os.path.basename(path) == "config.json" else \
        os.path.splitext(os.path.basename(path))[0]
    return shape_from_config(config, path, name)


def shape_from_config(config: dict, path: str, name: str) -> ModelShape:
    """The shape a Hugging Face config.json describes (`path` names it in messages)."""
    config, notes = text_part(config, path)
    arch = config.get("model_type")
    if arch in HYBRID_TYPES:
        config = hybrid_config(config)
    if arch in ("gemma4",) + GEMMA4_TYPES:  # a bare "gemma4" config is its text decoder's, as the loader reads it
        config, filled = gemma4_config(config, path)
        arch = config["model_type"] = GEMMA4_TYPES[0]
        notes += filled
    if arch not in PLANNED_ARCHITECTURES:
        raise ValueError(f"{path}: model_type {arch!r} is not supported; oval-edge plans "
                         f"{', '.join(PLANNED_ARCHITECTURES)}")

    def need(key: str) -> int:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: '{key}' must be a positive integer, got {value!r}")
        return value

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    layers, context = need("num_hidden_layers"), int(config.get("max_position_embeddings") or 0)
    window = config.get("sliding_window") or 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{path}: 'sliding_window' must be a positive integer or null, got {window!r}")
    kinds = layer_kinds(arch, layers, window, config, context)
    rotary = config.get("partial_rotary_factor") or (config.get("rope_parameters") or {}).get("partial_rotary_factor")
    if rotary is not None and not (isinstance(rotary, (int, float)) and 0 < rotary <= 1):
        raise ValueError(f"{path}: 'partial_rotary_factor' must be in (0, 1], got {rotary!r}")
    return ModelShape(
        name=name, path=path, architecture=arch, layers=layers, hidden=hidden,
        intermediate=need("intermediate_size"), heads=heads, kv_heads=int(kv), head_dim=int(head_dim),
        vocab=need("vocab_size"), max_context=context,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama/Mistral only when attention_bias is set.
        qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        source="config.json", file_bytes=0, norms_per_layer=norms_per_layer(arch), qk_norm=arch in QK_NORM,
        layer_kinds=kinds if "sliding" in kinds or "state" in kinds else (),
        sliding_window=window if "sliding" in kinds else 0,
        rotary_dim=int(int(head_dim) * rotary) if rotary not in (None, 1, 1.0) else 0, notes=tuple(notes),
        states=state_layout(config), attn_output_gate=bool(config.get("attn_output_gate", False)),
        **(_gemma4_fields(config) if arch in GEMMA4_TYPES else {}),
    )


def _gemma4_fields(config: dict) -> dict:
    """ModelShape's Gemma 4 fields from a config families.gemma4_config filled (the loader reads them for Gemma 4
    only, so plan does too)."""
    return dict(global_head_dim=int(config["global_head_dim"]), kv_shared_layers=int(config["num_kv_shared_layers"]),
                per_layer_input=int(config["hidden_size_per_layer_input"]),
                per_layer_vocab=int(config["vocab_size_per_layer_input"]),
                double_wide_mlp=bool(config["use_double_wide_mlp"]))


def _from_gguf(path: str) -> ModelShape:
    from oval_edge.runtime.model.grouped.gguf_blocks import is_stored_projection

    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ValueError(f"reading {path} needs the 'gguf' package ({exc}); pip install gguf") from exc
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf raises ValueError/struct.error/OSError for broken files
        raise ValueError(f"model file {path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    fields = reader.fields
    arch = _scalar(fields, "general.architecture", path)
    if arch not in PLANNED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; oval-edge plans "
                         f"{', '.join(PLANNED_ARCHITECTURES)}")
    if arch in GEMMA4_GGUF_ARCHS:  # two head sizes, shared K/V, per-layer inputs: read as the loader reads them
        def header(key: str):
            return _scalar(fields, f"{arch}.{key}", path) if f"{arch}.{key}" in fields else None

        config, stored = gemma4_gguf_config(reader, path, header, lambda key: _array(fields, f"{arch}.{key}"))
        shape = shape_from_config(config, path, os.path.splitext(os.path.basename(path))[0])
        held = tuple((int(t.shape[1]), int(t.shape[0]), t.tensor_type.name) for t in stored)
        return dataclasses.replace(shape, source="GGUF metadata", file_bytes=os.path.getsize(path),
                                   stored_projections=held)
    heads = int(_scalar(fields, f"{arch}.attention.head_count", path))
    hidden = int(_scalar(fields, f"{arch}.embedding_length", path))
    key_length = fields.get(f"{arch}.attention.key_length")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(_scalar(fields, f"{arch}.vocab_size", path))
    names = {t.name for t in reader.tensors}
    layers, context = int(_scalar(fields, f"{arch}.block_count", path)), int(_scalar(fields, f"{arch}.context_length", path))
    window_key = f"{arch}.attention.sliding_window"
    window = int(_scalar(fields, window_key, path)) if window_key in fields else 0
    kinds = layer_kinds(arch, layers, window, None, context)
    return ModelShape(
        name=os.path.splitext(os.path.basename(path))[0], path=path, architecture=arch,
        layers=layers, hidden=hidden,
        intermediate=int(_scalar(fields, f"{arch}.feed_forward_length", path)), heads=heads,
        kv_heads=int(_scalar(fields, f"{arch}.attention.head_count_kv", path)) if f"{arch}.attention.head_count_kv" in fields else heads,
        head_dim=int(_scalar(fields, f"{arch}.attention.key_length", path)) if key_length is not None else hidden // heads,
        vocab=vocab, max_context=context,
        tied_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names,
        source="GGUF metadata", file_bytes=os.path.getsize(path),
        norms_per_layer=4 if "blk.0.post_ffw_norm.weight" in names else 2, qk_norm="blk.0.attn_q_norm.weight" in names,
        layer_kinds=kinds if "sliding" in kinds else (), sliding_window=window if "sliding" in kinds else 0,
        stored_projections=tuple((int(t.shape[1]), int(t.shape[0]), t.tensor_type.name) for t in reader.tensors
                                 if is_stored_projection(t)),
    )


def _array(fields, key: str) -> list | None:
    """A GGUF header array (numbers), None when absent or a scalar (a key llama.cpp writes either way)."""
    from gguf import GGUFValueType

    field = fields.get(key)
    return field.contents() if field is not None and field.types[0] == GGUFValueType.ARRAY else None


def _scalar(fields, key: str, path: str):
    field = fields.get(key)
    if field is None:
        raise ValueError(f"{path}: GGUF metadata has no '{key}'")
    if hasattr(field, "contents"):  # gguf >= 0.11
        return field.contents()
    part = field.parts[field.data[0]]  # older gguf: raw numpy parts
    return bytes(part).decode("utf-8") if part.dtype.kind == "u" and len(part) > 1 else part[0]
