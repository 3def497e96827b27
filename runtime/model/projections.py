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


def bind_projection(module: torch.nn.Module) -> Projection:
    """The fastest exact way to call `module`: the packed 4-bit kernel when it applies, else the module itself."""
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
    return PackedCpu4bit(module) if packed else module


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
