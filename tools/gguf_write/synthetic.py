"""A synthetic long-context model for speed measurements: the bundled model's shape, seeded random weights, more
positions, written as GGUF (so this runtime and llama.cpp run the very same file) and cached.

Why: OVAL exists for long context, but the bundled SmolLM2-135M has 8192 positions. Decode and prefill speed depend
on the shape (layers, heads, head_dim, vocabulary), the context and the tensor types, not on the weights' values, so
a model of the bundled shape with `llama.context_length` 32768 measures speed at 32k. Its outputs mean nothing:
quality (eval, calibrate) is measured on the real model only, and every bench table built on it says so.

What the file holds: the bundled header's sizes (or a smaller shape, for tests), `context_length` = positions,
the bundled file's tokenizer (tokenizer.* fields, chat template included, so both engines tokenize the same), the
projections in the bundled file's type (Q4_1) and the token embedding in its type (Q8_0) where the gguf package can
quantize them (else Q8_0), norms = 1 in F32. Weights are normal with std 0.02 (as a freshly initialised Llama), so
activations stay in range. The embedding is tied, as in the bundled file.

Cache: $OVAL_EDGE_CACHE/synthetic-models/<name>-<hash of shape, seed, types, generator format>.gguf, written to a
staging file and renamed into place, so an existing file is complete and it is made once.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import asdict, dataclass

SYNTHETIC_MODEL = "synthetic-long"  # the --model value that selects it
DEFAULT_POSITIONS = 32768
WEIGHT_STD = 0.02  # transformers' initializer_range for Llama: residual activations stay O(1) through 30 layers
FALLBACK_TYPE = "Q8_0"  # what a tensor is stored as when gguf cannot quantize the bundled file's type
GENERATOR_FORMAT = 1  # bumped when what the file holds changes, so older cached files are redone
QUANT_BLOCK = 32  # Q4_1 and Q8_0 quantize rows in blocks of 32 values
SPEED_ONLY = "synthetic: speed only"


@dataclass(frozen=True)
class SyntheticShape:
    """The sizes of a Llama-architecture decoder (names as in transformers' LlamaConfig), its positions and seed."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    positions: int = DEFAULT_POSITIONS
    seed: int = 0
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    base_name: str = ""  # what shape it copies ("SmolLM2-135M"); empty for a made-up shape
    projection_type: str = FALLBACK_TYPE  # GGML type of the decoder's projections (the bundled file's: Q4_1)
    embedding_type: str = FALLBACK_TYPE  # GGML type of the token embedding (the bundled file's: Q8_0)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"synthetic model {name}={value!r}: must be a positive integer")
        if not 64 <= self.positions <= 1_048_576:
            raise ValueError(f"--synthetic-positions={self.positions}: allowed 64 to 1048576 positions")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--synthetic-seed={self.seed!r}: must be a non-negative integer")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"synthetic model: hidden {self.hidden} must split into {self.heads} heads of an even "
                             "size (rotary pairs)")
        if self.heads % self.kv_heads:
            raise ValueError(f"synthetic model: {self.heads} heads must be a multiple of {self.kv_heads} KV heads")
        for name in ("projection_type", "embedding_type"):
            if not _can_quantize(getattr(self, name)):
                raise ValueError(f"synthetic model {name}={getattr(self, name)!r}: the installed gguf package cannot "
                                 f"write it; use e.g. {FALLBACK_TYPE}")
        if self.hidden % QUANT_BLOCK or self.intermediate % QUANT_BLOCK:
            raise ValueError(f"synthetic model: hidden {self.hidden} and intermediate {self.intermediate} must be "
                             f"multiples of {QUANT_BLOCK} (the quantizer's block)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def describe(self) -> str:
        """The model name every bench row and report carries, e.g. 'SmolLM2-135M shape, random weights, 32k
        positions (synthetic: speed only)'."""
        shape = self.base_name or f"{self.layers}-layer {self.hidden}-wide"
        positions = f"{self.positions // 1024}k" if self.positions % 1024 == 0 else str(self.positions)
        return f"{shape} shape, random weights (seed {self.seed}), {positions} positions ({SPEED_ONLY})"


def bundled_shape(positions: int = DEFAULT_POSITIONS, seed: int = 0) -> SyntheticShape:
    """The bundled GGUF's sizes (read from its header, not assumed) with `positions` positions, and its tensor types
    (the projections' and the token embedding's), each replaced by FALLBACK_TYPE where the installed gguf package
    cannot quantize it (it quantizes Q4_0/Q4_1/Q5_x/Q8_0, not every K-quant)."""
    from gguf import GGUFReader

    from oval_edge.runtime.model.gguf_metadata import header_scalar
    from oval_edge.runtime.model.origin.source import DEFAULT_NAME, bundled_gguf_path

    path = bundled_gguf_path()
    reader = GGUFReader(path)  # parsed once: reading the 49k-entry vocabulary is most of the cost
    fields = reader.fields
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    projection, embedding = (types.get(name, FALLBACK_TYPE) for name in ("blk.0.attn_q.weight", "token_embd.weight"))
    arch = header_scalar(fields, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: the synthetic model copies a llama-architecture header, this one is {arch!r}")

    def need(key: str):
        value = header_scalar(fields, f"llama.{key}")
        if value is None:
            raise ValueError(f"{path}: header key llama.{key} is missing; the synthetic model needs it")
        return value

    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens; the synthetic model copies the bundled tokenizer")
    return SyntheticShape(
        layers=int(need("block_count")), hidden=int(need("embedding_length")),
        intermediate=int(need("feed_forward_length")), heads=int(need("attention.head_count")),
        kv_heads=int(need("attention.head_count_kv")), vocab=len(tokens.data), positions=positions, seed=seed,
        rope_theta=float(need("rope.freq_base")), rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        base_name=DEFAULT_NAME.removesuffix("-Instruct"),
        projection_type=projection if _can_quantize(projection) else FALLBACK_TYPE,
        embedding_type=embedding if _can_quantize(embedding) else FALLBACK_TYPE,
    )


def _can_quantize(kind: str) -> bool:
    import gguf
    import numpy as np

    if kind in ("F32", "F16"):
        return True
    try:
        gguf.quants.quantize(np.zeros((1, 256), dtype=np.float32), gguf.GGMLQuantizationType[kind])
    except (NotImplementedError, KeyError):
        return False
    return True


def synthetic_config(shape: SyntheticShape):
    """The transformers LlamaConfig the writer reads its header from."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.positions, rms_norm_eps=shape.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta}, tie_word_embeddings=True,
    )


def random_tensors(shape: SyntheticShape):
    """(transformers name, tensor) of every weight, made one at a time from one seeded generator (so the peak is
    one float32 tensor, not the model: SmolLM2's embedding is 49152 x 576 = 113 MB in float32)."""
    import torch

    generator = torch.Generator().manual_seed(shape.seed)

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator) * WEIGHT_STD

    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    yield "model.embed_tokens.weight", normal(shape.vocab, shape.hidden)
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}."
        yield prefix + "input_layernorm.weight", torch.ones(shape.hidden)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield prefix + f"self_attn.{name}.weight", normal(rows, shape.hidden)
        yield prefix + "self_attn.o_proj.weight", normal(shape.hidden, q)
        yield prefix + "post_attention_layernorm.weight", torch.ones(shape.hidden)
        yield prefix + "mlp.gate_proj.weight", normal(shape.intermediate, shape.hidden)
        yield prefix + "mlp.up_proj.weight", normal(shape.intermediate, shape.hidden)
        yield prefix + "mlp.down_proj.weight", normal(shape.hidden, shape.intermediate)
    yield "model.norm.weight", torch.ones(shape.hidden)


def synthetic_gguf_path(shape: SyntheticShape) -> str:
    """Where the file for this shape, seed and tensor types lives (it may not exist yet)."""
    from oval_edge.cache_dir import cache_root
    from oval_edge.runtime.model.origin.source import bundled_gguf_path

    bundled = os.stat(bundled_gguf_path())  # the tokenizer is copied from it: another bundled file, another key
    key = f"{sorted(asdict(shape).items())}|{bundled.st_size}|format {GENERATOR_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = (shape.base_name or f"{shape.layers}x{shape.hidden}") + f"-random-seed{shape.seed}-ctx{shape.positions}"
    return os.path.join(cache_root(), "synthetic-models", f"{stem}-{shape.projection_type}-{digest}.gguf")


def synthetic_gguf(shape: SyntheticShape, announce=print) -> str:
    """The cached GGUF file of this synthetic model, written first if it is not there yet."""
    from .writer import write_gguf_tensors

    path = synthetic_gguf_path(shape)
    if os.path.isfile(path):
        return path
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the synthetic model's cache folder {folder}: {exc.strerror or exc}; "
                         "set OVAL_EDGE_CACHE to a writable folder") from exc
    announce(f"writing the synthetic model {shape.describe()} to {path} (once; projections {shape.projection_type}, "
             f"embedding {shape.embedding_type})")
    handle, staging = tempfile.mkstemp(prefix=".staging-", suffix=".gguf", dir=folder)
    os.close(handle)
    try:
        write_gguf_tensors(synthetic_config(shape), random_tensors(shape), staging, "llama",
                           projection_type=shape.projection_type, embedding_type=shape.embedding_type,
                           model_name=shape.describe())
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return path

