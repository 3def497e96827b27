"""Call the decoder's projections and norms with as little Python per call as the weights allow.

A CPU decode step of a small model is bound by per-call overhead, not by arithmetic: bitsandbytes' Linear4bit
walks five Python layers (module forward, matmul_4bit, gemv_4bit, the op dispatcher, the backend kernel) before
its fused AVX512-BF16 kernel runs, and transformers' RMSNorm is six tensor ops. Here each projection is bound
once to its 4-bit op and its unpacked quantization state, and each norm to torch's fused `rms_norm`; both
compute the same numbers as the modules they stand for (tests/test_runtime.py compares logits with the modules).
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch
import torch.nn.functional as F

from oval_edge.kernels.cpu import cpu_kernels

from .grouped.linear import GroupedLinear, bind_grouped, describe_grouped_path

Projection = Callable[[torch.Tensor], torch.Tensor]

# The packed 4-bit GEMV as an opaque operator, so the static decode step traces whole under torch.compile (dynamo
# cannot trace a ctypes call). Eager calls skip the dispatcher (PackedCpu4bit.__call__). The registry handle lives
# as long as the process; it is never mutated after these lines.
_LIBRARY = torch.library.Library("oval_edge", "FRAGMENT")
_LIBRARY.define("gemv_4bit_cpu(Tensor x, Tensor weight, Tensor absmax, Tensor code, int[] shape, int blocksize, "
                "str quant_type) -> Tensor")


class PackedCpu4bit:
    """A bitsandbytes Linear4bit whose weight was repacked for its fused CPU kernel (runtime/model/quantize.py packs at
    load). x [n, in] -> [n, out] in x's dtype.

    Same arithmetic as Linear4bit.forward on this path: the kernel takes bf16 activations, the bias is added in
    bf16, the result is cast back to the caller's dtype. The kernel is called through bitsandbytes' own C entry
    point (the one its CPU backend calls) when the loaded library exports it: the registered op around it adds
    ~25 us of Python per call (measured on 576x960 nf4: 16 us kernel, 38 us through the op), about 5 ms per
    decode step of a 30-layer model. Without that entry point the public op is used.
    """

    path = "bitsandbytes' fused 4-bit CPU GEMV (AVX512-BF16), weights repacked at load"

    def __init__(self, module: torch.nn.Module) -> None:
        state = module.weight.quant_state
        self.weight = module.weight.data  # packed [out, in / 2] uint8
        self.shape, self.absmax, self.code, self.blocksize = state.shape, state.absmax, state.code, state.blocksize
        self.bias = None if module.bias is None else module.bias.data.to(torch.bfloat16)
        self.out_features, self.in_features = int(state.shape[0]), int(state.shape[1])
        self.quant_type = state.quant_type
        self.kernel = _cpu_kernel(state.quant_type)
        self._out: torch.Tensor | None = None  # decode-sized output buffer, reused (see __call__)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if torch.compiler.is_compiling():
            out = torch.ops.oval_edge.gemv_4bit_cpu(xb, self.weight, self.absmax, self.code, list(self.shape),
                                                    self.blocksize, self.quant_type)
        else:
            out = _gemv_4bit(xb, self.weight, self.absmax, self.code, self.shape, self.blocksize, self.kernel,
                             self._buffer(xb) if x.dtype != torch.bfloat16 else None)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


    def _buffer(self, xb: torch.Tensor) -> torch.Tensor | None:
        """The bf16 output buffer for a decode-sized input (<= DECODE_ROWS rows), reused while the row count stays.

        Why: one fresh `empty` per projection is ~120 dispatched ops per decode step. Only used when the caller's
        dtype is not bf16, so the buffer is always consumed by the copy back (`.to(x.dtype)`) before the next call.
        """
        rows = xb.shape[0]
        if rows > DECODE_ROWS or xb.dim() != 2:
            return None
        if self._out is None or self._out.shape[0] != rows:
            self._out = torch.empty((rows, self.out_features), dtype=torch.bfloat16)
        return self._out


DECODE_ROWS = 8  # inputs up to this many rows reuse one output buffer per projection (bounded: 8 x out x 2 B)


def _gemv_4bit(xb: torch.Tensor, weight: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape,
               blocksize: int, kernel, out: torch.Tensor | None = None) -> torch.Tensor:
    """xb [n, in] bf16 -> [n, out] bf16 through the fused kernel when it takes the input, else bitsandbytes' op.
    out: a [n, out] bf16 buffer to write into (the fused kernel only)."""
    if kernel is None or xb.dim() != 2 or not xb.is_contiguous():
        return torch.ops.bitsandbytes.gemv_4bit.default(xb, weight, shape, absmax, code, blocksize)
    out_features, in_features = int(shape[0]), int(shape[1])
    if out is None:
        out = torch.empty((xb.shape[0], out_features), dtype=torch.bfloat16)
    kernel(
        ctypes.c_int64(xb.shape[0]), ctypes.c_int64(out_features), ctypes.c_int64(in_features),
        ctypes.c_void_p(xb.data_ptr()), ctypes.c_void_p(weight.data_ptr()),
        ctypes.c_void_p(absmax.data_ptr()), ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int64(blocksize), ctypes.c_int64(xb.stride(0)), ctypes.c_int64(out.stride(0)),
    )
    return out


def _gemv_4bit_op(x, weight, absmax, code, shape, blocksize, quant_type):
    return _gemv_4bit(x.contiguous(), weight, absmax, code, torch.Size(shape), blocksize, _cpu_kernel(quant_type))


_LIBRARY.impl("gemv_4bit_cpu", _gemv_4bit_op, "CPU")


@torch.library.register_fake("oval_edge::gemv_4bit_cpu")
def _gemv_4bit_fake(x, weight, absmax, code, shape, blocksize, quant_type):
    return x.new_empty((x.shape[0], shape[0]), dtype=torch.bfloat16)


def _cpu_kernel(quant_type: str):
    """bitsandbytes' fused CPU 4-bit GEMV for this quant type, or None if its library does not export one."""
    try:
        from bitsandbytes.cextension import lib
    except ImportError:
        return None
    return getattr(lib, f"gemv_4bit_inference_cpu_{quant_type}_bf16", None)


# Bytes each 4-bit weight moves per projection call, by path: the codes are 0.5 B; dequantizing also writes a
# 16-bit copy of the weight and reads it back (0.5 + 2 + 2). The absmax (one per 64 weights) adds 4/64 B where it is
# stored as fp32, 1/64 B where the fused GEMM reads the double-quantized 8-bit codes, and 9/64 B where gemv_4bit or
# dequantize_4bit rebuild fp32 values from those codes first (read 1, write 4, read 4 back), at every call.
DEQUANTIZE_BYTES_PER_WEIGHT = 4.5
FUSED_ROWS = 4  # rows bitsandbytes' fused gemm_4bit (>= 0.50) always takes fused, on every GPU it supports
ABSMAX_BYTES_PER_WEIGHT = {"fp32": 4 / 64, "nested_in_kernel": 1 / 64, "nested_rebuilt": 9 / 64}


def weight_bytes_moved(rows: int, fused_gemm: bool, nested: bool) -> dict[str, float]:
    """Bytes per 4-bit weight moved by each way of multiplying `rows` rows: the table Chunked4bit chooses from.

    fused_chunks: ceil(rows / FUSED_ROWS) calls of bnb's fused 4-bit GEMM, each reading the codes once;
    gemv_rows: one 4-bit GEMV per row (every bitsandbytes); dequantize: a 16-bit copy of the weight, then a matmul.
    nested: the absmax is double-quantized (quantize.unnest_at_load says where it is not), so every gemv_4bit and
    dequantize_4bit call rebuilds it.
    """
    absmax = ABSMAX_BYTES_PER_WEIGHT["nested_rebuilt" if nested else "fp32"]
    table = {"dequantize": DEQUANTIZE_BYTES_PER_WEIGHT + absmax,  # first wins a tie: one call
             "gemv_rows": (0.5 + absmax) * rows}
    if fused_gemm:
        in_kernel = ABSMAX_BYTES_PER_WEIGHT["nested_in_kernel" if nested else "fp32"]
        table["fused_chunks"] = (0.5 + in_kernel) * -(-rows // FUSED_ROWS)
    return table


def chunk_rows(rows: int, fused_gemm: bool, nested: bool | None = None) -> int:
    """Rows per call that move the fewest weight bytes for a `rows`-row input (rows itself: one call). nested: the
    absmax is double-quantized (None: as the loader leaves it, quantize.unnest_at_load)."""
    nested = fused_gemm if nested is None else nested
    table = weight_bytes_moved(rows, fused_gemm, nested)
    best = min(table, key=table.get)
    if best == "dequantize" or rows <= (FUSED_ROWS if fused_gemm else 1):
        return rows
    return FUSED_ROWS if best == "fused_chunks" else 1


class Chunked4bit:
    """A bitsandbytes Linear4bit on a GPU, called in the row chunks that move the fewest weight bytes.

    Why: for more than a few rows, bitsandbytes' matmul_4bit either runs its fused 4-bit GEMM or, where it has no
    calibrated fused kernel for that many rows (compute capability 8.7, the Orin, among them: bnb 0.50 takes its fused
    kernel up to 4 rows there), dequantizes the whole weight to 16 bits first: 4.5 bytes per weight instead of 0.5,
    ~9x the traffic of a decode step that is bound by reading weights. Splitting a batch of 8 into two calls of 4
    moves 1 byte per weight. With a bitsandbytes older than its fused GEMM, one 4-bit GEMV per row does the same up to
    8 rows (0.5 B x rows < 4.5). Above those sizes one call (bnb's own choice) is kept. Same arithmetic per row: each
    output row depends only on its input row. Under a CUDA graph the extra calls cost no host time.
    """

    path = "bitsandbytes' 4-bit kernels, batches in the row chunks that move the fewest bytes"

    def __init__(self, module: torch.nn.Module, fused_gemm: bool | None = None) -> None:
        from .quantize import has_fused_gemm

        self.module = module
        self.fused_gemm = has_fused_gemm() if fused_gemm is None else fused_gemm
        self.nested = bool(getattr(module.weight.quant_state, "nested", False))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 1
        step = chunk_rows(rows, self.fused_gemm, self.nested)
        if step >= rows:
            return self.module(x)
        return torch.cat([self.module(x[first:first + step]) for first in range(0, rows, step)])


class Unfused4bit:
    """A bitsandbytes Linear4bit on a CPU where bitsandbytes has no fused kernel (no AVX512-BF16): decode-sized
    inputs (<= DECODE_ROWS rows, fp32) through our own 4-bit GEMV (quant_kernels.c), larger ones (prefill, where
    dequantizing once per call is amortised over the rows) and traced ones through the module. x [n, in] -> [n, out].

    The module's arithmetic but for one rounding: the weight code * absmax stays fp32 where bitsandbytes rounds it to
    bf16 (tests/test_projections.py bounds the difference). The absmax is the fp32 one the loader un-nested
    (quantize.unnest_absmax).
    """

    path = "our 4-bit GEMV (quant_kernels.c) for decode, bitsandbytes' dequantize + matmul for prefill"

    def __init__(self, module: torch.nn.Module, kernels) -> None:
        state = module.weight.quant_state
        self.module, self.kernels = module, kernels
        self.codes = module.weight.data.view(torch.uint8).reshape(-1)
        self.absmax, self.table = state.absmax, state.code.float().contiguous()
        self.bias = None if module.bias is None else module.bias.data.to(torch.bfloat16).float()
        self.out_features, self.blocksize = int(state.shape[0]), int(state.blocksize)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= DECODE_ROWS and not torch.compiler.is_compiling():
            out = self.kernels.gemv_4bit(x, self.codes, self.absmax, self.table, self.bias, self.out_features,
                                         self.blocksize)
            if out is not None:
                return out
        return self.module(x)


def unfused_4bit_applies(module: torch.nn.Module):
    """The CPU kernels when `module` is a CPU Linear4bit that bitsandbytes did not repack for its fused kernel, with
    the absmax un-nested to fp32 and the bf16 compute dtype ours computes like, else None. Shapes the kernel refuses
    fall back to the module per call."""
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    if (state is None or module.weight.device.type != "cpu" or module.training
            or getattr(state, "packing_format_for_cpu", False) or getattr(state, "nested", True)
            or getattr(state, "absmax", None) is None or state.absmax.dtype != torch.float32
            or not state.absmax.is_contiguous() or getattr(module, "compute_dtype", None) != torch.bfloat16):
        return None
    return cpu_kernels()


def bind_projection(module: torch.nn.Module) -> Projection:
    """The fastest exact way to call `module`: the packed 4-bit kernel when it applies, our own 4-bit GEMV where
    bitsandbytes has none (Unfused4bit), row chunks of the module on a GPU (Chunked4bit), the grouped op for grouped
    integer weights (grouped/linear.py), else the module itself."""
    grouped = bind_grouped(module)
    if grouped is not None:
        return grouped
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    packed = (
        state is not None
        and module.weight.device.type == "cpu"
        and getattr(state, "packing_format_for_cpu", False)  # set by bitsandbytes when it repacked the weight
        and not getattr(state, "nested", False)  # repacking un-nests absmax; a nested one needs dequantizing
        and not module.training
        and getattr(state, "absmax", None) is not None
        and state.absmax.dtype == torch.bfloat16  # what the fused kernel reads
    )
    if packed:
        return PackedCpu4bit(module)
    kernels = unfused_4bit_applies(module)
    if kernels is not None:
        return Unfused4bit(module, kernels)
    if state is not None and module.weight.device.type == "cuda" and not module.training:
        return Chunked4bit(module)
    return module


def describe_4bit_path(model: torch.nn.Module) -> str | None:
    """Which path the 4-bit projections of `model` run (the first one's binding stands for all: one device, one
    layout), for serve's startup report; None for a model without 4-bit layers."""
    for module in model.modules():
        if isinstance(module, GroupedLinear):
            return describe_grouped_path(module.codes.device)
        if getattr(getattr(module, "weight", None), "quant_state", None) is not None:
            return getattr(bind_projection(module), "path", "bitsandbytes' Linear4bit as is (dequantize + matmul)")
    return None


def bind_norm(module: torch.nn.Module) -> Projection:
    """transformers' Llama/Qwen2 RMSNorm as one fused op (x * rsqrt(mean(x^2) + eps) * weight, in fp32)."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if weight is None or eps is None or weight.dtype != torch.float32:
        return module  # another norm, or reduced-precision activations: keep the module's own arithmetic

    def norm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return module(x)
        # On a CPU the native kernel: torch's fused op costs ~20 us per decode-sized call here (measured), 61 per
        # step. Not under tracing: torch.compile fuses the norm itself and cannot trace a ctypes call.
        kernels = cpu_kernels() if x.device.type == "cpu" and not torch.compiler.is_compiling() else None
        out = kernels.rms_norm(x, weight, eps) if kernels is not None else None
        return out if out is not None else F.rms_norm(x, (x.shape[-1],), weight, eps)

    return norm
