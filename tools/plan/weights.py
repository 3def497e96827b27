"""Weight bytes as the runtime really holds them (runtime/model/quantize.py + runtime/model/loader.py), without torch.

4-bit: every nn.Linear inside the decoder layers becomes a bitsandbytes Linear4bit (nf4 or fp4, blocksize 64,
compress_statistics=True). For a weight W [N out, K in], n = N*K, blocks = ceil(n / 64), bitsandbytes stores:

  nested layout (CUDA/Jetson, and CPUs without AVX512-BF16) - functional.quantize_4bit:
      codes       uint8 [ceil(n/2), 1]            two 4-bit codes per byte
      absmax      uint8 [blocks]                  double quantization: the fp32 absmax quantized to 8 bits ...
      state2.absmax fp32 [ceil(blocks/256)]       ... in blocks of 256, with their own scale
      state2.code fp32 [256]                      the 8-bit dynamic map (one copy per layer)
      offset      fp32 []                         mean absmax subtracted before the 8-bit quantization
      code        fp32 [16]                       the nf4/fp4 code book
  packed CPU layout (x86 with AVX512-BF16: Linear4bit.forward calls
  functional._convert_weight_packed_for_cpu; the runtime does it at load, quantize._pack_for_cpu):
      codes       uint8 [N, K/2]                  re-tiled for the fused kernel, same byte count
      absmax      bf16  [K/64, N]                 un-nested: state2 is dropped, absmax back to 16 bits
      code        fp32 [16]
  unnested CPU layout (CPUs without AVX512-BF16, native kernels on: our own GEMV reads bitsandbytes' layout,
  runtime/model/projections.Unfused4bit; quantize.unnest_absmax at load):
      codes       uint8 [ceil(n/2), 1]            as nested
      absmax      fp32 [blocks]                   un-nested: state2 and offset dropped
      code        fp32 [16]
The counting matches runtime.model.quantize.weight_bytes (each storage once; offset only while nested).

In 4-bit modes the embedding (and an untied head) is an int8 table (runtime/model/embeddings.py) when hidden is a
multiple of 32: one code byte per weight and one fp32 scale per 32 weights. On a CPU the vocabulary is padded to a
multiple of 32 (the native kernel's panels); on CUDA the rows are stored as they are ([vocab, hidden] codes and
[vocab, hidden / 32] scales, no padding). On CUDA the head is int8 only with its Triton kernel
(embeddings.int8_head_applies); without it (a JetPack torch has no Triton, and `plan` counts that case) the head
is 16 bits: a tied model then holds one 16-bit table for both, an untied one its int8 embedding and a 16-bit head. Everything else stays dense (runtime/model/loader.py): RMSNorm weights in
the activation dtype (fp32 on CPU, fp16 on CUDA/Jetson), 2 or 4 per layer (families.py) plus Qwen3/Gemma-3's
q_norm and k_norm ([head_dim] each); q/k/v biases (Qwen2) in the 4-bit layers' compute dtype
(bf16 on CPU, fp16 on CUDA), since bitsandbytes casts the bias to it on the first forward. A tied lm_head is the
embedding tensor and is counted once. quant 'none' keeps every projection dense in the activation dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from oval_edge.runtime.model.grouped.gguf_blocks import held_bytes, held_layout
from oval_edge.runtime.model.origin.source import AUTO_16BIT, GROUPED_QUANTS, QUANT_TYPES

from .model import ModelShape

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256  # bitsandbytes quantize_blockwise of the absmax (blocksize=256 in quantize_4bit)
CODE_BOOK_BYTES = 16 * 4
DYNAMIC_MAP_BYTES = 256 * 4
OFFSET_BYTES = 4
CPU_PACK_BLOCK_N = 32  # _convert_weight_packed_for_cpu asserts N % 32 == 0
INT8_BLOCK = INT8_PANEL = 32  # runtime/model/embeddings.py: weights per fp32 scale, vocabulary rows per panel

# Storage dtypes per target kind, mirroring runtime/model/loader.py (compute_dtype_for / load_dtype). If the loader
# changes, tests/test_plan.py::test_weight_bytes_match_loaded_model fails and points here.
ACTIVATION_BYTES = {"cpu": 4, "cuda": 2}  # embedding, untied head, norms, 'none' projections
LINEAR4_COMPUTE_BYTES = {"cpu": 2, "cuda": 2}  # bf16 on CPU, fp16 on CUDA: Qwen2 biases of 4-bit layers
LAYOUTS = ("nested", "cpu-packed", "cpu-unnested")
INT4_LAYOUT = (4, 32)  # quant int4: (code bits, weights per scale and min), runtime/model/grouped/layout.py
BNB_QUANTS = ("nf4", "fp4")
NATIVE_ENV = "OVAL_EDGE_NATIVE"  # oval_edge/kernels/cpu.py: "0" turns the native kernels (and so un-nesting) off


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def linear4bit_bytes(n_out: int, n_in: int, layout: str) -> tuple[int, int]:
    """(packed code bytes, quantization-state bytes) of one Linear4bit weight [n_out, n_in]."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; allowed: {', '.join(LAYOUTS)}")
    n = n_out * n_in
    codes = ceil_div(n, 2)
    if layout == "cpu-packed":
        return codes, (n_in // BLOCKSIZE) * n_out * 2 + CODE_BOOK_BYTES
    blocks = ceil_div(n, BLOCKSIZE)
    if layout == "cpu-unnested":
        return codes, blocks * 4 + CODE_BOOK_BYTES
    nested = blocks + 4 * ceil_div(blocks, NESTED_BLOCKSIZE) + DYNAMIC_MAP_BYTES + OFFSET_BYTES
    return codes, nested + CODE_BOOK_BYTES


def kept_as_read(width: int, quant: str) -> bool:
    """Whether runtime/model/decoder_build.py keeps a projection of input width `width` as read (in the activation
    dtype) under a 4-bit `quant`: rows that are not a whole number of the layout's blocks (grouped codes: 32;
    bitsandbytes: 64), such as a tiny Gemma 4's per-layer input projection (llama.cpp stores those in 16 bits too)."""
    return quant != "none" and width % (BLOCKSIZE if quant in BNB_QUANTS else INT4_LAYOUT[1]) != 0


def cpu_layout(shape: ModelShape, cpu_flags: frozenset[str], native: bool | None = None) -> str:
    """Which 4-bit layout a CPU run ends up with: packed when bitsandbytes' AVX512-BF16 kernel applies, else unnested
    when the native kernels are on (native None: unless $OVAL_EDGE_NATIVE is "0"; they build wherever a C compiler
    is), else nested."""
    packable = all(n % CPU_PACK_BLOCK_N == 0 for _, n, k in shape.all_projections() if k % BLOCKSIZE == 0)
    if "avx512_bf16" in cpu_flags and packable:
        return "cpu-packed"
    if native is None:
        native = os.environ.get(NATIVE_ENV, "1").strip() != "0"
    return "cpu-unnested" if native else "nested"


@dataclass(frozen=True)
class WeightBreakdown:
    quant: str
    layout: str  # "nested" | "cpu-packed" | "cpu-unnested" | "dense" | "grouped"
    target: str  # "cpu" | "cuda"
    linear_codes: int  # 4/8-bit codes of all projections (0 for quant 'none')
    quant_state: int  # absmax / code books / nested state, or the grouped scales and mins, of all projections
    dense_linear: int  # projections kept dense (quant 'none')
    biases: int
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    norms: int  # and the other vectors kept in the activation dtype (ModelShape.vector_parameters)
    per_layer_table: int = 0  # Gemma 4's per-layer input table, a lookup like the embedding (0 without one)

    @property
    def total(self) -> int:
        return (self.linear_codes + self.quant_state + self.dense_linear + self.biases + self.embedding
                + self.lm_head + self.norms + self.per_layer_table)

    @property
    def read_per_decode_step(self) -> int:
        """Bytes of weights one decode step streams: everything but the embedding table (only B rows of it are
        read), except that a tied head reads the whole embedding matrix for the logits; never the per-layer input
        table (B rows of it)."""
        return (self.total if self.lm_head == 0 else self.total - self.embedding) - self.per_layer_table

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {
            "total": self.total, "read_per_decode_step": self.read_per_decode_step}


def weight_bytes(shape: ModelShape, quant: str, target: str, cpu_flags: frozenset[str] = frozenset(),
                 int8_head_kernel: bool = False) -> WeightBreakdown:
    """Bytes of every weight the runtime keeps for `shape` on a `target` ("cpu" or "cuda"; Jetson is cuda).
    int8_head_kernel: on CUDA, whether the int8 head's Triton kernel runs there (default: no, a JetPack torch)."""
    if quant not in QUANT_TYPES:
        raise ValueError(f"quant={quant!r} is unknown; allowed: {', '.join(QUANT_TYPES)}")
    quant = resolve_planned_quant(quant, shape)
    if target not in ACTIVATION_BYTES:
        raise ValueError(f"target={target!r} is unknown; allowed: {', '.join(ACTIVATION_BYTES)}")
    act = ACTIVATION_BYTES[target]
    codes = state = dense = 0
    # every projection for quant 'none'; else those too narrow for the 4-bit layout (kept_as_read; a GGUF's as stored)
    stored = [(n, k) for n, k, _ in shape.stored_projections] if quant == "gguf" else \
        [(n, k) for _, n, k in shape.all_projections()]
    dense = sum(n * k for n, k in stored if quant == "none" or kept_as_read(k, quant)) * act
    if quant == "none":
        layout = "dense"
        bias_bytes = act
    elif quant in GROUPED_QUANTS:
        layout = "grouped"
        codes, state = grouped_projection_bytes(shape, quant)
        bias_bytes = act  # the op adds the bias in the activation dtype
    else:
        layout = cpu_layout(shape, cpu_flags) if target == "cpu" else "nested"
        for _, n, k in shape.all_projections():
            if kept_as_read(k, quant):
                continue
            c, s = linear4bit_bytes(n, k, layout)
            codes += c
            state += s
        bias_bytes = LINEAR4_COMPUTE_BYTES[target]
    biases = shape.layers * (shape.heads + 2 * shape.kv_heads) * shape.head_dim * bias_bytes if shape.qkv_bias else 0
    # a hybrid's state-layer weights kept as read: b | a, conv taps and the small vectors (fp32 ones counted at 4)
    dense += shape.state_exact_parameters() * act
    embedding, lm_head = _table_bytes(shape, quant, target, int8_head_kernel)
    return WeightBreakdown(
        quant=quant, layout=layout, target=target, linear_codes=codes, quant_state=state, dense_linear=dense,
        biases=biases, embedding=embedding, lm_head=lm_head,
        # 2 (or Gemma's 4) RMSNorms per layer, q/k norms where the family has them, the final norm, Gemma 4's
        # per-layer input norms and layer scalars
        norms=shape.vector_parameters() * act,
        per_layer_table=_per_layer_table_bytes(shape, quant, target),
    )


def resolve_planned_quant(quant: str, shape: ModelShape) -> str:
    """quant as the loader resolves it (source.resolve_quant): auto -> gguf for a GGUF, else AUTO_16BIT."""
    if quant == "auto":
        return "gguf" if shape.stored_projections else AUTO_16BIT
    if quant == "gguf" and not shape.stored_projections:
        raise ValueError(f"quant=gguf serves a GGUF file's own blocks; {shape.path} is not a GGUF file")
    return quant


def grouped_projection_bytes(shape: ModelShape, quant: str) -> tuple[int, int]:
    """(code bytes, scale + min bytes) of every projection held grouped: each GGUF tensor in the layout its type is
    served in (gguf_blocks.held_layout), or every projection as 4-bit codes per 32 (int4)."""
    if quant == "gguf":
        totals = [held_bytes(rows, width, *held_layout(kind)) for rows, width, kind in shape.stored_projections
                  if not kept_as_read(width, quant)]
    else:
        totals = [held_bytes(n, k, *INT4_LAYOUT) for _, n, k in shape.all_projections() if not kept_as_read(k, quant)]
    return sum(c for c, _ in totals), sum(s for _, s in totals)


def _table_bytes(shape: ModelShape, quant: str, target: str, int8_head_kernel: bool) -> tuple[int, int]:
    """(embedding bytes, head bytes; 0 when tied). 'none' keeps both in the activation dtype; 4-bit modes keep an
    int8 table when hidden is a multiple of 32 (the vocabulary padded to whole panels on a CPU), else 16 bits; on
    CUDA the head is int8 only with its kernel (module doc)."""
    tied = shape.tied_embeddings
    if quant == "none":
        dense = shape.vocab * shape.hidden * ACTIVATION_BYTES[target]
        return dense, 0 if tied else dense
    sixteen = shape.vocab * shape.hidden * 2
    if shape.hidden % INT8_BLOCK:
        return sixteen, 0 if tied else sixteen
    int8 = int8_table_bytes(shape.vocab, shape.hidden, target)
    if target == "cpu" or int8_head_kernel:
        return int8, 0 if tied else int8
    return (sixteen, 0) if tied else (int8, sixteen)


def int8_table_bytes(rows: int, width: int, target: str) -> int:
    """An int8 table [rows, width] (runtime/model/embeddings.py): a code byte per weight and an fp32 scale per 32,
    the rows padded to whole panels of 32 on a CPU (Int8Table), stored as they are on CUDA (CudaInt8Table)."""
    rows = ceil_div(rows, INT8_PANEL) * INT8_PANEL if target == "cpu" else rows
    return rows * width + rows * (width // INT8_BLOCK) * 4


def _per_layer_table_bytes(shape: ModelShape, quant: str, target: str) -> int:
    """Gemma 4's per-layer input table [per_layer_vocab, layers x P] as decoder_build._embedding_table keeps it:
    in the activation dtype for quant 'none'; in 4-bit modes an int8 table where its width is a multiple of 32
    (a lookup only: on CUDA too, with or without the head's kernel), else 16 bits. E2B: 262144 x 8960, 2.35 G
    values, its largest tensor (2.46 GiB as int8 + scales, 4.38 GiB in 16 bits)."""
    width = shape.layers * shape.per_layer_input
    if not width:
        return 0
    if quant == "none":
        return shape.per_layer_vocab * width * ACTIVATION_BYTES[target]
    if width % INT8_BLOCK:
        return shape.per_layer_vocab * width * 2
    return int8_table_bytes(shape.per_layer_vocab, width, target)
