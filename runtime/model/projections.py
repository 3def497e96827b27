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

Projection = Callable[[torch.Tensor], torch.Tensor]


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
        self.op = torch.ops.bitsandbytes.gemv_4bit.default
        self.kernel = _cpu_kernel(state.quant_type)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.kernel is None or xb.dim() != 2 or not xb.is_contiguous():
            out = self.op(xb, self.weight, self.shape, self.absmax, self.code, self.blocksize)
        else:
            out = torch.empty((xb.shape[0], self.out_features), dtype=torch.bfloat16)
            self.kernel(
                ctypes.c_int64(xb.shape[0]), ctypes.c_int64(self.out_features), ctypes.c_int64(self.in_features),
                ctypes.c_void_p(xb.data_ptr()), ctypes.c_void_p(self.weight.data_ptr()),
                ctypes.c_void_p(self.absmax.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                ctypes.c_int64(self.blocksize), ctypes.c_int64(xb.stride(0)), ctypes.c_int64(out.stride(0)),
            )
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


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
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    return norm
