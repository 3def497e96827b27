"""The token embedding and the output head: an int8 table on a CPU in 4-bit modes, else kept in 16 bits.

Why: in 4-bit modes the embedding is the largest tensor left (SmolLM2: 49152 x 576) and the head reads all of it at
every decode step. Kept in bf16 it is 57 MB a step, through a bf16 GEMM that rounds the logits to bf16 (exact ties
between top tokens). NF4 would read 14 MB but costs +14% perplexity on SmolLM2; int8 codes with one scale per 32
weights (llama.cpp's Q8_0 block) read 29 MB and match the 16-bit head within bf16's own rounding (docs/serving.md
gives both measurements). The head multiplies through the native kernel (oval_edge/kernels/head_kernels.c: fp32
activations, fp32 logits, ~2x faster than the bf16 GEMM at 8 rows, ~3.5x at 1); the embedding dequantizes only the
rows it looks up. One table serves both when the model ties them.

Int8 layout on a CPU (what the kernel reads): output rows in panels of 32, codes [panels, hidden, 32] int8 and
scales [panels, hidden / 32, 32] fp32; the vocabulary is padded with zero rows to a multiple of 32.

On CUDA (CudaInt8Table) the same codes and scales are stored row-major, codes [vocab, hidden] and scales
[vocab, hidden / 32], unpadded (oval_edge/kernels/triton_kernels/triton_int8_head.py says why that layout reads coalesced). The
embedding is always this table there; the head is too only where its Triton kernel imports, passes its check and
takes the activation dtype (int8_head_applies). Without it (a stock JetPack torch has no Triton) the torch
fallback would expand PACK_ROWS rows at a time to fp32 and run an fp32 matmul: 17 bytes moved per weight and
step (the code read, its fp32 copy written and read for the scale product, the product written and read by the
matmul: 1 + 4 + 4 + 4 + 4) against 2 for a 16-bit head, so the head is kept in 16 bits instead, and a tied model keeps one 16-bit table for both (2 bytes a
weight, not an int8 copy beside a 16-bit one). The table records which kernel its head runs as a name (`kernel`),
not as the module: the weight cache stores plain values and tensors, and the module is looked up per call.
Both stay capturable (no host reads, shapes from the tensors), and the head returns fp32 logits.

Elsewhere (quant 'none', hidden not a multiple of 32, a CPU without the native kernels) the 16-bit classes hold
the tensor: the residual stream stays in the activation dtype, lookups are upcast, the head multiplies in 16 bits
and returns the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oval_edge.kernels.cpu import cpu_kernels
from oval_edge.kernels.gpu import int8_head_kernel

BLOCK = 32  # weights per scale along the hidden dimension (the kernel's BLOCK)
PANEL = 32  # output rows stored side by side (the kernel's PANEL)
PACK_ROWS = 2048  # rows converted per pass at load: the fp32 transients stay ~5 MB each at hidden 576

# The head's kernel as an opaque operator, so the static decode step traces whole under torch.compile (dynamo
# cannot trace a ctypes call). The registry handle lives as long as the process and is never mutated after these
# lines.
_LIBRARY = torch.library.Library("oval_edge", "FRAGMENT")
_LIBRARY.define("int8_head_cpu(Tensor x, Tensor codes, Tensor scales) -> Tensor")
_LIBRARY.define("int8_head_rows(Tensor x, Tensor codes, Tensor scales) -> Tensor")  # CudaInt8Table's layout


def int8_table_applies(hidden: int, device: torch.device) -> bool:
    """Whether a [vocab, hidden] matrix on `device` is held as an int8 table: on a CPU when the native kernel is
    there (Int8Table), on CUDA always (CudaInt8Table: Triton or its torch fallback), for hidden % 32 == 0."""
    if hidden % BLOCK:
        return False
    return device.type == "cuda" or (device.type == "cpu" and cpu_kernels() is not None)


def int8_head_applies(hidden: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the output head is an int8 table on `device` for activations of `dtype`: on a CPU where the table
    is (the native kernel); on CUDA only where the Triton head kernel loads, passes its check and takes `dtype`
    (fp16/bf16), since its torch fallback moves ~8x the bytes of a 16-bit head (module doc)."""
    if not int8_table_applies(hidden, device):
        return False
    if device.type != "cuda":
        return True
    kernel = int8_head_kernel(device)
    return kernel is not None and dtype in kernel.DOT_DTYPES


def int8_table_from_rows(read_rows, vocab: int, hidden: int, device: torch.device):
    """The table int8_table_applies picks for `device`, from read_rows(start, stop) -> rows [stop - start, hidden]."""
    if device.type == "cuda":
        return CudaInt8Table.from_rows(read_rows, vocab, hidden, device)
    return Int8Table.from_rows(read_rows, vocab, hidden)


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [n, K] float -> (codes [n, K] int8, scales [n, K/32] fp32): per block of 32, scale = absmax / 127."""
    blocks = rows.float().view(rows.shape[0], -1, BLOCK)  # [n, K/32, 32]
    scale = blocks.abs().amax(-1) / 127.0  # [n, K/32]
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-127, 127)
    return q.to(torch.int8).view(rows.shape), scale


class Int8Table:
    """A [vocab, hidden] matrix as int8 codes and per-32 fp32 scales in the kernel's panel layout (module doc)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, rows: int) -> None:
        self.codes, self.scales, self.rows = codes, scales, rows  # [P, K, 32] int8, [P, K/32, 32] fp32, vocab
        self.hidden = codes.shape[1]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Table":
        """weight [vocab, hidden] (any float dtype) -> the table: per row and block of 32, scale = absmax / 127."""
        return cls.from_rows(lambda start, stop: weight[start:stop], weight.shape[0], weight.shape[1])

    @classmethod
    def from_rows(cls, read_rows, vocab: int, hidden: int) -> "Int8Table":
        """The table from read_rows(start, stop) -> rows [stop - start, hidden], read PACK_ROWS at a time: the
        loader passes slices of the file, so no 16-bit copy of the whole matrix is ever held."""
        if hidden % BLOCK:
            raise ValueError(f"an int8 table needs hidden % {BLOCK} == 0, got hidden = {hidden}")
        panels = -(-vocab // PANEL)
        codes = torch.zeros((panels, hidden, PANEL), dtype=torch.int8)
        scales = torch.zeros((panels, hidden // BLOCK, PANEL), dtype=torch.float32)
        for first in range(0, vocab, PACK_ROWS):  # PACK_ROWS is a multiple of PANEL: chunks fill whole panels
            rows = read_rows(first, min(vocab, first + PACK_ROWS)).float()
            n = rows.shape[0]
            pad = -n % PANEL
            if pad:
                rows = torch.cat([rows, rows.new_zeros((pad, hidden))])
            q, scale = _quantize_rows(rows)  # [n + pad, K] int8, [n + pad, K/32]
            p0, p1 = first // PANEL, (first + n + pad) // PANEL
            codes[p0:p1] = q.view(p1 - p0, PANEL, hidden).transpose(1, 2)
            scales[p0:p1] = scale.view(p1 - p0, PANEL, hidden // BLOCK).transpose(1, 2)
        return cls(codes, scales, vocab)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] dequantized -> [n, hidden] fp32 (only those rows' codes are read)."""
        kernels = cpu_kernels() if ids.device.type == "cpu" and not torch.compiler.is_compiling() else None
        out = kernels.int8_rows(self.codes, self.scales, self.rows, ids) if kernels is not None else None
        if out is not None:
            return out
        if not torch.compiler.is_compiling() and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.rows):
            raise IndexError(f"a token id lies outside the vocabulary 0..{self.rows - 1}")
        panel, column = ids // PANEL, ids % PANEL
        codes = self.codes[panel, :, column].float()  # [n, K]
        scales = self.scales[panel, :, column]  # [n, K/32]
        return (codes.view(ids.shape[0], -1, BLOCK) * scales[..., None]).view(ids.shape[0], self.hidden)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> x W^T [n, vocab] fp32: the native kernel, or a dequantizing torch fallback."""
        if x.dtype != torch.float32 or not x.is_contiguous():  # fp32 rows already (the CPU's activations): no op
            x = x.float().contiguous()
        if torch.compiler.is_compiling():
            out = torch.ops.oval_edge.int8_head_cpu(x, self.codes, self.scales)
        else:
            out = _int8_head(x, self.codes, self.scales)
        return out[:, :self.rows] if out.shape[1] != self.rows else out



def _int8_head(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [n, K] fp32 contiguous -> [n, panels * 32] fp32."""
    kernels = cpu_kernels() if x.device.type == "cpu" else None
    out = kernels.int8_head(x, codes, scales) if kernels is not None else None
    if out is not None:
        return out
    # The reference arithmetic, a panel range at a time (bounded transient): the kernel's torch twin.
    panels, hidden, _ = codes.shape
    out = x.new_empty((x.shape[0], panels * PANEL))
    step = PACK_ROWS // PANEL
    for p0 in range(0, panels, step):
        c, s = codes[p0:p0 + step].float(), scales[p0:p0 + step]  # [p, K, 32], [p, K/32, 32]
        w = (c.view(c.shape[0], hidden // BLOCK, BLOCK, PANEL) * s[:, :, None]).view(c.shape[0], hidden, PANEL)
        out[:, p0 * PANEL:(p0 + c.shape[0]) * PANEL] = (x @ w.permute(1, 0, 2).reshape(hidden, -1))
    return out


_LIBRARY.impl("int8_head_cpu", _int8_head, "CPU")


@torch.library.register_fake("oval_edge::int8_head_cpu")
def _int8_head_fake(x, codes, scales):
    return x.new_empty((x.shape[0], codes.shape[0] * PANEL), dtype=torch.float32)


class CudaInt8Table:
    """A [vocab, hidden] matrix on CUDA as int8 codes [vocab, hidden] and fp32 scales [vocab, hidden / 32], row-major
    (module doc). `kernel` names what multiplies it as a head: "triton" (the checked Triton module, looked up per
    call: a module object would make the model uncacheable) or "torch" (the dequantizing fallback)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self.codes, self.scales = codes, scales
        self.rows, self.hidden = codes.shape
        self.kernel = "triton" if int8_head_kernel(codes.device) is not None else "torch"

    @property
    def head_kernel(self):
        """The Triton module the head runs (None: the torch fallback), from the declarative `kernel`."""
        return int8_head_kernel(self.codes.device) if self.kernel == "triton" else None

    @classmethod
    def from_rows(cls, read_rows, vocab: int, hidden: int, device: torch.device) -> "CudaInt8Table":
        """Quantized on `device` PACK_ROWS rows at a time (an fp32 transient of PACK_ROWS x hidden)."""
        if hidden % BLOCK:
            raise ValueError(f"an int8 table needs hidden % {BLOCK} == 0, got hidden = {hidden}")
        codes = torch.empty((vocab, hidden), dtype=torch.int8, device=device)
        scales = torch.empty((vocab, hidden // BLOCK), dtype=torch.float32, device=device)
        for first in range(0, vocab, PACK_ROWS):
            last = min(vocab, first + PACK_ROWS)
            codes[first:last], scales[first:last] = _quantize_rows(read_rows(first, last).to(device))
        return cls(codes, scales)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] -> [n, hidden] fp32. No range check: it would read ids back to the host inside a captured
        step (an id past the vocabulary trips CUDA's own index assertion)."""
        codes = self.codes[ids].float().view(ids.shape[0], -1, BLOCK)  # [n, K/32, 32]
        return (codes * self.scales[ids][..., None]).view(ids.shape[0], self.hidden)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> x W^T [n, vocab] fp32."""
        if not x.is_contiguous():
            x = x.contiguous()
        if torch.compiler.is_compiling():
            return torch.ops.oval_edge.int8_head_rows(x, self.codes, self.scales)
        out = self.head_kernel.int8_head(x, self.codes, self.scales) if self.head_kernel is not None else None
        return out if out is not None else _int8_head_rows(x, self.codes, self.scales)


def _int8_head_rows(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The torch fallback for CudaInt8Table: x [n, K] -> [n, vocab] fp32, PACK_ROWS vocabulary rows dequantized at
    a time (transient PACK_ROWS x K fp32: 32 MiB at K = 4096)."""
    vocab, hidden = codes.shape
    xf = x.float()
    out = xf.new_empty((x.shape[0], vocab))
    for first in range(0, vocab, PACK_ROWS):
        c, s = codes[first:first + PACK_ROWS], scales[first:first + PACK_ROWS]
        w = (c.float().view(c.shape[0], -1, BLOCK) * s[..., None]).view(c.shape[0], hidden)
        out[:, first:first + c.shape[0]] = xf @ w.T
    return out


def _int8_head_rows_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    kernel = int8_head_kernel(codes.device)
    out = kernel.int8_head(x, codes, scales) if kernel is not None else None
    return out if out is not None else _int8_head_rows(x, codes, scales)


_LIBRARY.impl("int8_head_rows", _int8_head_rows_op, "CUDA")
_LIBRARY.impl("int8_head_rows", _int8_head_rows_op, "CPU")  # the same layout on CPU tensors (tests, interpreter)


@torch.library.register_fake("oval_edge::int8_head_rows")
def _int8_head_rows_fake(x, codes, scales):
    return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)


class _Int8Module(nn.Module):
    """Holds an int8 table; its tensors are registered so weight_bytes counts them (a shared table once)."""

    def __init__(self, table, out_dtype: torch.dtype):
        super().__init__()
        self.table, self.out_dtype = table, out_dtype
        self.register_buffer("codes", table.codes, persistent=False)
        self.register_buffer("scales", table.scales, persistent=False)

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.out_dtype else t.to(self.out_dtype)  # a same-dtype .to() is still one op


class Int8Embedding(_Int8Module):
    """ids [n] -> [n, hidden] in `out_dtype`, from an Int8Table or CudaInt8Table."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() == 1:
            return self._out(self.table.lookup(ids))
        return self._out(self.table.lookup(ids.reshape(-1)).view(*ids.shape, self.table.hidden))


class Int8Head(_Int8Module):
    """hidden [n, hidden] -> logits [n, vocab] fp32 (then `out_dtype`), from an int8 table (shared when tied)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() == 2:
            return self._out(self.table.matmul(hidden))
        flat = hidden.reshape(-1, hidden.shape[-1])
        return self._out(self.table.matmul(flat).view(*hidden.shape[:-1], -1))


class StoredEmbedding(nn.Module):
    """ids -> rows of a 16-bit table, upcast to the activation dtype."""

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [vocab, hidden] in the storage dtype
        self.out_dtype = out_dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(self.out_dtype)


class StoredHead(nn.Module):
    """logits = x W^T with W stored in 16 bits (shared with the embedding when tied)."""

    def __init__(self, weight: nn.Parameter, out_dtype: torch.dtype):
        super().__init__()
        self.weight = weight
        self.out_dtype = out_dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.weight.dtype), self.weight).to(self.out_dtype)
