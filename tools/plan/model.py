"""A model's shape for planning, read without loading weights: a Hugging Face config.json or GGUF metadata.

GGUF keys (llama.cpp's naming, prefixed by `general.architecture`, e.g. "llama."): block_count,
embedding_length, feed_forward_length, attention.head_count, attention.head_count_kv, attention.key_length
(optional head dim), context_length; the vocabulary is the length of tokenizer.ggml.tokens. A GGUF without an
`output.weight` tensor ties the output head to the embedding. Qwen2 GGUFs carry attn_q/k/v biases.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from oval_edge.runtime.model.source import SUPPORTED_ARCHITECTURES, bundled_gguf_path


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

    def projections(self) -> list[tuple[str, int, int]]:
        """(name, out_features N, in_features K) of the nn.Linear layers inside one decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return [
            ("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q),
            ("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i),
        ]

    @property
    def parameters(self) -> int:
        per_layer = sum(n * k for _, n, k in self.projections()) + 2 * self.hidden
        if self.qkv_bias:
            per_layer += (self.heads + 2 * self.kv_heads) * self.head_dim
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden + head + self.hidden

    def describe(self) -> str:
        tie = "tied" if self.tied_embeddings else "untied"
        return (
            f"{self.name} ({self.architecture}, {self.layers} layers, hidden {self.hidden}, {self.heads} q / "
            f"{self.kv_heads} kv heads x {self.head_dim}, ffn {self.intermediate}, vocab {self.vocab}, {tie} head, "
            f"{self.parameters / 1e6:.0f}M params, max context {self.max_context}; from {self.source})"
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
    arch = config.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: model_type {arch!r} is not supported; oval-edge runs {', '.join(SUPPORTED_ARCHITECTURES)}")

    def need(key: str) -> int:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: '{key}' must be a positive integer, got {value!r}")
        return value

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    folder = os.path.dirname(path)
    return ModelShape(
        name=os.path.basename(folder) if os.path.basename(path) == "config.json" else os.path.splitext(os.path.basename(path))[0],
        path=path, architecture=arch, layers=need("num_hidden_layers"), hidden=hidden,
        intermediate=need("intermediate_size"), heads=heads, kv_heads=int(kv), head_dim=int(head_dim),
        vocab=need("vocab_size"), max_context=int(config.get("max_position_embeddings") or 0),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama/Mistral only when attention_bias is set.
        qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        source="config.json", file_bytes=0,
    )


def _from_gguf(path: str) -> ModelShape:
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
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; oval-edge runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    heads = int(_scalar(fields, f"{arch}.attention.head_count", path))
    hidden = int(_scalar(fields, f"{arch}.embedding_length", path))
    key_length = fields.get(f"{arch}.attention.key_length")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(_scalar(fields, f"{arch}.vocab_size", path))
    names = {t.name for t in reader.tensors}
    return ModelShape(
        name=os.path.splitext(os.path.basename(path))[0], path=path, architecture=arch,
        layers=int(_scalar(fields, f"{arch}.block_count", path)), hidden=hidden,
        intermediate=int(_scalar(fields, f"{arch}.feed_forward_length", path)), heads=heads,
        kv_heads=int(_scalar(fields, f"{arch}.attention.head_count_kv", path)) if f"{arch}.attention.head_count_kv" in fields else heads,
        head_dim=int(_scalar(fields, f"{arch}.attention.key_length", path)) if key_length is not None else hidden // heads,
        vocab=vocab, max_context=int(_scalar(fields, f"{arch}.context_length", path)),
        tied_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names,
        source="GGUF metadata", file_bytes=os.path.getsize(path),
    )


def _scalar(fields, key: str, path: str):
    field = fields.get(key)
    if field is None:
        raise ValueError(f"{path}: GGUF metadata has no '{key}'")
    if hasattr(field, "contents"):  # gguf >= 0.11
        return field.contents()
    part = field.parts[field.data[0]]  # older gguf: raw numpy parts
    return bytes(part).decode("utf-8") if part.dtype.kind == "u" and len(part) > 1 else part[0]
